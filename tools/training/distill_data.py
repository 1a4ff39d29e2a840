"""Self-distillation data: the target answers diverse prompts; its own distributions become the labels.

Stages (each saved to `<out>/` so an interrupted run resumes):
1. self-instruct: the target writes instructions from meta prompts (sampled, temperature 1);
2. responses: the target answers prompts under its chat template (batched `generate`, greedy or
   sampled), giving the token sequences a drafter will see when serving;
3. reference text: real text (docs, jargon, code) placed as the assistant's answer, teacher-forced:
   breadth at one forward per sequence, where generation costs one forward per token;
4. teacher labels: one teacher-forced target forward per batch stores the top-k next-token
   probabilities at every answer position (KL targets), so training never runs the target again.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from treeserve.engine.models.loading import chat_ids

from . import prompts as prompt_sources


@dataclass
class DistillDataConfig:
    """How much and what kind of training text to generate."""

    self_instruct_prompts: int = field(default=700, metadata={"help": "instructions the target writes itself"})
    pydoc_prompts: int = field(default=150, metadata={"help": "prompts built from Python documentation"})
    humaneval_prompts: int = field(default=164, metadata={"help": "HumanEval completion prompts"})
    debian_prompts: int = field(default=250, metadata={"help": "prompts from Debian fortunes / Jargon File"})
    response_prompts: int = field(default=480, metadata={"help": "prompts the target answers (generation is the slow part)"})
    max_new_tokens: int = field(default=96, metadata={"help": "tokens per generated response"})
    reference_tokens: int = field(default=200_000, metadata={"help": "tokens of teacher-forced reference text (docs, jargon, code)"})
    reference_answer_tokens: int = field(default=384, metadata={"help": "longest reference answer, in tokens"})
    sampled_fraction: float = field(default=0.25, metadata={"help": "share of responses sampled at T=0.7 (rest greedy)"})
    batch_size: int = field(default=32, metadata={"help": "target generation batch size"})
    teacher_top_k: int = field(default=32, metadata={"help": "target probabilities kept per position"})
    seed: int = field(default=0, metadata={"help": "seed for prompt choice and sampling"})


@torch.inference_mode()
def batched_generate(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int, batch_size: int,
                     temperature: float, desc: str) -> list[list[int]]:
    """Generate continuations (new tokens only, EOS included, padding stripped) in left-padded batches."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    outputs: list[list[int]] = []
    for start in tqdm(range(0, len(prompt_ids), batch_size), desc=desc):
        batch = prompt_ids[start:start + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=temperature > 0, temperature=temperature or None, top_p=None, top_k=None,
                             pad_token_id=pad)
        for row in out[:, width:].tolist():
            if tokenizer.eos_token_id in row:
                row = row[:row.index(tokenizer.eos_token_id) + 1]
            outputs.append(row)
    return outputs


@torch.inference_mode()
def teacher_labels(model, sequences: list[list[int]], response_starts: list[int], top_k: int,
                   batch_size: int = 8) -> dict[str, torch.Tensor]:
    """Top-k target probabilities at each response position (the distribution of the NEXT token).

    Returns flat tensors over all sequences: tokens [T], seq_offsets [S+1], label_pos [L] (index into tokens of
    the position whose next token is labelled), topk_ids [L, k], topk_probs [L, k].
    """
    tokens, offsets, label_pos, topk_ids, topk_probs = [], [0], [], [], []
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    for start in tqdm(range(0, len(order), batch_size), desc="teacher labels"):
        idx = order[start:start + batch_size]
        width = max(len(sequences[i]) for i in idx)
        ids = torch.tensor([sequences[i] + [0] * (width - len(sequences[i])) for i in idx])
        mask = torch.tensor([[1] * len(sequences[i]) + [0] * (width - len(sequences[i])) for i in idx])
        probs = torch.softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
        top = probs.topk(top_k, dim=-1)
        for row, i in enumerate(idx):
            seq, first = sequences[i], response_starts[i]
            # Positions first-1 .. len-2 predict the response tokens.
            pos = torch.arange(first - 1, len(seq) - 1)
            label_pos.append(pos + offsets[-1])
            topk_ids.append(top.indices[row, pos].to(torch.int32))
            topk_probs.append(top.values[row, pos].to(torch.float16))
            tokens.extend(seq)
            offsets.append(offsets[-1] + len(seq))
    return {"tokens": torch.tensor(tokens, dtype=torch.int32), "seq_offsets": torch.tensor(offsets),
            "label_pos": torch.cat(label_pos), "topk_ids": torch.cat(topk_ids),
            "topk_probs": torch.cat(topk_probs)}


def build_prompts(model, tokenizer, config: DistillDataConfig, out: Path) -> list[str]:
    cache = out / "prompts.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    rng = random.Random(config.seed)
    meta = prompt_sources.self_instruct_meta_prompts(rng, tokenizer, config.self_instruct_prompts)
    torch.manual_seed(config.seed)
    written = batched_generate(model, tokenizer, [chat_ids(tokenizer, m) for m in meta], 48,
                               config.batch_size, temperature=1.0, desc="self-instruct")
    instructions = [prompt_sources.clean_instruction(tokenizer.decode(w, skip_special_tokens=True))
                    for w in written]
    prompts = [i for i in instructions if i]
    prompts += prompt_sources.pydoc_passages(rng, config.pydoc_prompts)
    prompts += prompt_sources.humaneval_prompts(config.humaneval_prompts)
    prompts += prompt_sources.debian_text_prompts(rng, config.debian_prompts)
    rng.shuffle(prompts)
    out.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(prompts, indent=0))
    return prompts


def build_distill_data(model, tokenizer, config: DistillDataConfig, out: Path) -> Path:
    """Run all stages into `out` and return the path of the labelled dataset (safetensors)."""
    data_path = out / "teacher.safetensors"
    if data_path.is_file():
        return data_path
    prompts = build_prompts(model, tokenizer, config, out)
    responses_path = out / "responses.json"
    prompt_ids = [chat_ids(tokenizer, p)[-384:] for p in prompts[:config.response_prompts]]
    if responses_path.is_file():
        responses = json.loads(responses_path.read_text())
    else:
        n_sampled = int(len(prompt_ids) * config.sampled_fraction)
        torch.manual_seed(config.seed + 1)
        responses = batched_generate(model, tokenizer, prompt_ids[:n_sampled], config.max_new_tokens,
                                     config.batch_size, temperature=0.7, desc="responses (sampled)")
        responses += batched_generate(model, tokenizer, prompt_ids[n_sampled:], config.max_new_tokens,
                                      config.batch_size, temperature=0.0, desc="responses (greedy)")
        responses_path.write_text(json.dumps(responses))
    sequences = [p + r for p, r in zip(prompt_ids, responses) if r]
    starts = [len(p) for p, r in zip(prompt_ids, responses) if r]
    ref_seqs, ref_starts = reference_sequences(tokenizer, config)
    sequences += ref_seqs
    starts += ref_starts
    save_file(teacher_labels(model, sequences, starts, config.teacher_top_k), str(data_path))
    return data_path


def reference_sequences(tokenizer, config: DistillDataConfig) -> tuple[list[list[int]], list[int]]:
    """Chat-formatted (request, reference answer) sequences up to `reference_tokens` answer tokens."""
    sequences, starts, total = [], [], 0
    for request, answer in prompt_sources.reference_texts(random.Random(config.seed + 2)):
        if total >= config.reference_tokens:
            break
        prompt = chat_ids(tokenizer, request)[-256:]
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"][:config.reference_answer_tokens]
        if len(answer_ids) < 16:
            continue
        sequences.append(prompt + answer_ids)
        starts.append(len(prompt))
        total += len(answer_ids)
    return sequences, starts


def load_distill_data(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))
