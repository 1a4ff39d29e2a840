"""Self-distillation corpus at scale: the target answers >= 10k conversations, in resumable chunks.

What an EAGLE drafter must predict is the target's own continuation, so the labels are the target's answers
(EAGLE, Li et al. 2024, section 4 "training": fixed dataset answered by the target; EAGLE-3, Li et al. 2025,
section 3.3 trains on target-generated responses). A quarter of the conversations are sampled at
temperature > 0, as EAGLE's authors recommend against exposure bias, the rest greedy (what TreeServe's
greedy verification accepts).

Generation is batched and KV-cached (`decode_batch`): one prefill per left-padded batch, then one forward
per token for the whole batch; rows that finish leave the batch (their KV rows are dropped), so a long answer
does not keep 47 finished rows computing. Batches are formed from length-sorted prompts.

Chunks: `<out>/chunk-NNNNN.safetensors` holds `tokens` [T] (uint16 for vocabularies under 65,536, else int32), `seq_offsets` [S+1] int64 and
`answer_mask` [T] uint8 (1 at target-written answer tokens) for the chunk's conversations, with the
conversation kinds and generation statistics in its metadata. Chunk i's prompts depend only on (seed, i),
and its sampling on one generator seeded from (seed, i) and threaded through its batches, so an interrupted run
continues with the first missing chunk; a chunk is written atomically. Within it the unit of resumption is a
batch: each decoded batch is saved at once under `<out>/partial/` with the generator's state after it
(partial_chunk.py), and a resumed chunk reuses them, equal to one made without interruption (timings aside).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from treeserve.engine.devices import device_name
from treeserve.engine.models.hf_cache import cache_argument
from treeserve.engine.models.loading import chat_ids

from . import prompt_mix
from .broad_mix import BROAD_KINDS, BenchmarkGuard, MixSettings, MixSources, broad_prompt_mix, tokens_by_kind
from .heldout import split_library
from .partial_chunk import ChunkBatches, partial_dir, remove_partial
from .prompts import clean_instruction
from .sources.registry import SourceLibrary
from .sources.snapshot import fingerprint

# Where the shipped drafters' corpus lives: committed chunk by chunk, so a later run (or session) resumes it.
DEFAULT_CORPUS_DIR = Path(__file__).resolve().parent / "corpus_chunks" / "smollm2-135m-instruct-seed0"
# Where the broad corpus (issue 61) is made, its card and held-out evaluation set beside it.
BROAD_CORPUS_DIR = DEFAULT_CORPUS_DIR.with_name("smollm2-135m-instruct-broad-seed0")


@dataclass
class CorpusConfig:
    """Size and mix of the self-distillation corpus."""

    num_conversations: int = field(default=12_000, metadata={"help": "conversations in the whole corpus (before deduplication)"})
    chunk_size: int = field(default=400, metadata={"help": "conversations per chunk file (committed one by one; an "
                                                           "interrupted chunk resumes from its saved batches)"})
    batch_size: int = field(default=48, metadata={"help": "rows decoded together (KV-cached, finished rows leave the batch)"})
    max_new_tokens: int = field(default=320, metadata={"help": "longest answer per turn, in tokens"})
    # 2,304: the broad mix's long documents (up to 2,000 tokens) with their instruction and a second turn's
    # history; the committed stdlib corpus was made with 768 (its recipe keeps that).
    max_prompt_tokens: int = field(default=2304, metadata={"help": "longest prompt (history included); longer ones are cut on the left"})
    multi_turn_fraction: float = field(default=0.25, metadata={"help": "share of conversations with a second user turn"})
    sampled_fraction: float = field(default=0.25, metadata={"help": "share of conversations answered by sampling"})
    temperature: float = field(default=0.8, metadata={"help": "temperature of the sampled share"})
    instruction_tokens: int = field(default=64, metadata={"help": "longest self-written instruction, in tokens"})
    seed: int = field(default=0, metadata={"help": "seed of the prompt mix and the sampling"})
    mix: str = field(default="broad", metadata={"help": "prompt mix: 'broad' (documents, translation, passages, "
                                                        "long contexts and the stdlib kinds, balanced by tokens; "
                                                        "issue 61) or 'stdlib' (the original mix)"})
    exclude_kinds: tuple[str, ...] = field(default=(), metadata={"help": "task kinds of the broad mix kept out of "
                                                                        "this corpus (a held-out evaluation)"})
    eval_fraction: float = field(default=0.1, metadata={"help": "share of source documents reserved for held-out "
                                                                "evaluation (never in the broad mix's prompts)"})

    def __post_init__(self) -> None:
        if self.mix not in ("broad", "stdlib"):
            raise ValueError(f"unknown prompt mix {self.mix!r}: 'broad' or 'stdlib'")
        self.exclude_kinds = tuple(self.exclude_kinds)
        unknown = set(self.exclude_kinds) - set(BROAD_KINDS)
        if unknown or (self.exclude_kinds and self.mix != "broad"):
            raise ValueError(f"exclude_kinds {sorted(self.exclude_kinds)}: kinds of the broad mix only "
                             f"({', '.join(BROAD_KINDS)})")

    def mix_settings(self) -> MixSettings:
        # Long windows leave room in the prompt cap for the instruction and a second turn's history.
        top = max(64, min(2000, self.max_prompt_tokens - 300))
        return MixSettings(long_context=(min(500, top), top), max_answer_tokens=self.max_new_tokens,
                           multi_turn_fraction=self.multi_turn_fraction, sampled_fraction=self.sampled_fraction,
                           temperature=self.temperature)


# What a recipe written before a setting existed meant by it: corpora made before the broad mix are 'stdlib'.
LEGACY_RECIPE = {"mix": "stdlib", "exclude_kinds": [], "eval_fraction": 0.0}


# Settings that say how fast a chunk is made, not what it holds: a corpus may be resumed with others (a GPU
# decodes far larger batches). Each chunk's stats record the batch size and device that made it.
RUN_SETTINGS = frozenset({"batch_size"})


def recipe_fields(settings: dict) -> dict:
    """The settings two runs must share to extend one corpus (everything but RUN_SETTINGS), as JSON holds them
    (tuples as lists), with LEGACY_RECIPE's meaning for settings an older recipe lacks."""
    settings = json.loads(json.dumps({**LEGACY_RECIPE, **settings}))
    return {k: v for k, v in settings.items() if k not in RUN_SETTINGS}


def chunk_path(out: Path, index: int) -> Path:
    return out / f"chunk-{index:05d}.safetensors"


@torch.inference_mode()
def decode_batch(model, prompts: list[list[int]], max_new_tokens: int, temperatures: list[float],
                 eos_ids: set[int], pad_id: int, generator: torch.Generator | None = None,
                 feature_layers: tuple[int, ...] | None = None) -> list[list[int]] | tuple[list[list[int]], list[torch.Tensor]]:
    """Continue every prompt (left-padded into one batch) until EOS or `max_new_tokens`; returns the new
    tokens of each row (EOS included). Rows with temperature 0 are greedy, the others sampled.

    With `feature_layers`, also returns each row's target features, captured from the very forwards that
    generate (no second pass): [len(prompt) + len(new) , (len(feature_layers) + 1) * H] float16, the hidden
    states `hidden_states[i]` for i in feature_layers (transformers' indexing: 0 = embeddings) followed by the
    final post-norm hidden state, one row per token; the last new token is never fed, so its row is zero."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    batch = len(prompts)
    width = max(map(len, prompts))
    ids = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    temps = torch.tensor(temperatures, dtype=torch.float32, device=device)
    eos = torch.tensor(sorted(eos_ids), device=device)
    cache = DynamicCache(config=model.config)
    capture = feature_layers is not None
    rows_features: list[list[torch.Tensor]] = [[] for _ in range(batch)]

    def keep_features(out, live: torch.Tensor, columns: slice) -> None:
        states = out.hidden_states
        # One conversion for the batch: the rows below are views (a kernel per row would dominate on a GPU).
        fused = torch.cat([states[i][:, columns] for i in feature_layers] + [states[-1][:, columns]],
                          dim=-1).to(torch.float16)
        for b, row in enumerate(live.tolist()):
            rows_features[row].append(fused[b])

    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_argument(model, cache),
                use_cache=True, logits_to_keep=1, output_hidden_states=capture)
    logits = out.logits[:, -1].float()
    active = torch.arange(batch, device=device)  # original row of each live batch row
    if capture:
        for row, prompt in enumerate(prompts):
            states = out.hidden_states
            rows_features[row].append(torch.cat([states[i][row, width - len(prompt):] for i in feature_layers]
                                                + [states[-1][row, width - len(prompt):]], dim=-1).to(torch.float16))
    next_pos = positions[:, -1] + 1
    outputs: list[list[int]] = [[] for _ in range(batch)]
    for step in range(max_new_tokens):
        tokens = _choose(logits, temps[active], generator)
        for row, token in zip(active.tolist(), tokens.tolist()):
            outputs[row].append(token)
        done = torch.isin(tokens, eos) | (step + 1 >= max_new_tokens)
        if bool(done.all()):
            break
        if bool(done.any()):
            # Finished rows leave the batch: their KV rows, mask and positions are dropped.
            keep = (~done).nonzero().squeeze(-1)
            for layer in cache.layers:
                layer.keys = layer.keys.index_select(0, keep)
                layer.values = layer.values.index_select(0, keep)
            active, tokens, mask, next_pos = active[keep], tokens[keep], mask[keep], next_pos[keep]
        mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                    **cache_argument(model, cache), use_cache=True, output_hidden_states=capture)
        logits = out.logits[:, -1].float()
        if capture:
            keep_features(out, active, slice(-1, None))
        next_pos = next_pos + 1
    if not capture:
        return outputs
    features = []
    for row in range(batch):
        fed = torch.cat(rows_features[row])  # every token but the last new one was fed
        features.append(torch.cat([fed, fed.new_zeros(1, fed.shape[1])]).cpu())
    return outputs, features


def _choose(logits: torch.Tensor, temps: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy where the row's temperature is 0, a sample from softmax(logits / T) elsewhere."""
    choice = logits.argmax(-1)
    sampled = temps > 0
    if bool(sampled.any()):
        probs = torch.softmax(logits[sampled] / temps[sampled, None], dim=-1)
        choice[sampled] = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return choice


def generate_all(model, prompts: list[list[int]], temperatures: list[float], config: CorpusConfig,
                 eos_ids: set[int], pad_id: int, generator: torch.Generator, desc: str,
                 max_new_tokens: int | None = None, feature_layers: tuple[int, ...] | None = None,
                 saved: ChunkBatches | None = None, phase: str = ""):
    """`decode_batch` over length-sorted batches, results in the order of `prompts` (with the captured
    features as a second list when `feature_layers` is given). With `saved`, each batch of `phase` is taken
    from there when it was saved by an interrupted run, else saved once decoded."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[list[int]] = [[] for _ in prompts]
    features: list[torch.Tensor | None] = [None for _ in prompts]
    limit = max_new_tokens or config.max_new_tokens
    for batch, start in enumerate(tqdm(range(0, len(order), config.batch_size), desc=desc, leave=False)):
        rows = order[start:start + config.batch_size]
        batch_prompts, batch_temps = [prompts[i] for i in rows], [temperatures[i] for i in rows]
        key = saved.key(phase, batch_prompts, batch_temps, limit, generator) if saved is not None else ""
        done = saved.load(phase, batch, key, generator) if saved is not None else None
        if done is None:
            began = time.time()
            outs = decode_batch(model, batch_prompts, limit, batch_temps, eos_ids, pad_id, generator, feature_layers)
            done = outs if feature_layers is not None else (outs, None)
            if saved is not None:
                saved.save(phase, batch, key, *done, generator, time.time() - began)
        outs, feats = done
        if feature_layers is not None:
            for i, f in zip(rows, feats):
                features[i] = f
        for i, out in zip(rows, outs):
            results[i] = out
    return results if feature_layers is None else (results, features)


def _strip_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in eos_ids else tokens


def chunk_specs(config: CorpusConfig, index: int, exclude: frozenset[str],
                sources: MixSources | None = None) -> list[prompt_mix.ConversationSpec]:
    """The conversations of chunk `index` before the target answers them (the broad mix needs `sources`: the
    training side of the library)."""
    seed = config.seed * 100_003 + index
    if config.mix == "stdlib":
        return prompt_mix.prompt_mix(seed, config.chunk_size, config.multi_turn_fraction, config.sampled_fraction,
                                     config.temperature, exclude)
    if sources is None:
        raise ValueError("the broad mix needs its sources (build_corpus(..., library=load_library()))")
    return broad_prompt_mix(seed, config.chunk_size, sources, config.mix_settings(), BenchmarkGuard(exclude),
                            frozenset(config.exclude_kinds))


def generate_chunk(model, tokenizer, config: CorpusConfig, index: int, seen_instructions: set[str],
                   exclude: frozenset[str], feature_layers: tuple[int, ...] | None = None,
                   sources: MixSources | None = None,
                   partial: Path | None = None) -> tuple[dict[str, torch.Tensor], dict, torch.Tensor | None]:
    """Chunk `index`: self-written instructions, first answers, follow-up answers; tensors, metadata and
    (with `feature_layers`) the target features of every token, [T, (len(feature_layers) + 1) * H] float16.
    With `partial` (`partial_chunk.partial_dir`), every batch is saved there once decoded, and the batches an
    interrupted run saved are reused."""
    specs = chunk_specs(config, index, exclude, sources)
    estimated = tokens_by_kind(specs, config.mix_settings())
    device = next(model.parameters()).device
    # Sampling draws on the model's device (a CPU and a GPU run of one chunk differ in their sampled answers).
    generator = torch.Generator(device).manual_seed(config.seed * 100_003 + index)
    eos_ids = {tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])}
    eos_ids.discard(None)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    saved = ChunkBatches(partial, device, feature_layers, eos_ids, pad_id) if partial is not None else None
    started = time.time()
    generated = 0

    meta_rows = [i for i, s in enumerate(specs) if s.kind == prompt_mix.SELF_INSTRUCT]
    written = generate_all(model, [chat_ids(tokenizer, specs[i].first_turn) for i in meta_rows],
                           [1.0] * len(meta_rows), config, eos_ids, pad_id, generator, "instructions",
                           config.instruction_tokens, saved=saved, phase="instructions")
    generated += sum(map(len, written))
    dropped = set()
    for i, tokens in zip(meta_rows, written):
        text = clean_instruction(tokenizer.decode(_strip_eos(tokens, eos_ids), skip_special_tokens=True))
        key = prompt_mix.instruction_key(text) if text else ""
        if not text or key in seen_instructions or prompt_mix.normalise(text) in exclude:
            dropped.add(i)
            continue
        seen_instructions.add(key)
        specs[i].meta["meta_prompt"] = specs[i].first_turn
        specs[i].first_turn = text
    specs = [s for i, s in enumerate(specs) if i not in dropped]

    def prompt_of(messages):
        return chat_ids(tokenizer, messages)[-config.max_prompt_tokens:]

    firsts = [prompt_of([{"role": "user", "content": s.first_turn}]) for s in specs]
    answers = generate_all(model, firsts, [s.temperature for s in specs], config, eos_ids, pad_id, generator,
                           f"chunk {index} answers", feature_layers=feature_layers, saved=saved, phase="answers")
    if feature_layers is not None:
        answers, first_features = answers
    sequences = [(p, a) for p, a in zip(firsts, answers)]
    follow_rows = [i for i, s in enumerate(specs) if s.follow_up and answers[i] and answers[i][-1] in eos_ids]
    seconds = [prompt_of([{"role": "user", "content": specs[i].first_turn},
                          {"role": "assistant", "content": tokenizer.decode(_strip_eos(answers[i], eos_ids))},
                          {"role": "user", "content": specs[i].follow_up}]) for i in follow_rows]
    second_answers = generate_all(model, seconds, [specs[i].temperature for i in follow_rows], config, eos_ids,
                                  pad_id, generator, f"chunk {index} follow-ups", feature_layers=feature_layers,
                                  saved=saved, phase="follow-ups")
    if feature_layers is not None:
        second_answers, second_features = second_answers
    generated += sum(map(len, answers)) + sum(map(len, second_answers))
    kinds = [s.kind for s in specs] + [f"{specs[i].kind}+follow_up" for i in follow_rows]
    temps = [s.temperature for s in specs] + [specs[i].temperature for i in follow_rows]
    sequences += list(zip(seconds, second_answers))

    tokens, offsets, answer_mask = [], [0], []
    answers_by_kind: dict[str, int] = {}  # measured, beside the mix's estimate: the card reports both
    for (prompt, answer), kind in zip(sequences, kinds):
        base = kind.split("+", 1)[0]
        answers_by_kind[base] = answers_by_kind.get(base, 0) + len(answer)
        tokens += prompt + answer
        answer_mask += [0] * len(prompt) + [1] * len(answer)
        offsets.append(len(tokens))
    # A resumed chunk's time is what its batches took, the interrupted runs' included.
    seconds_taken = time.time() - started + (saved.reused_seconds if saved is not None else 0.0)
    answer_tokens = sum(answer_mask)
    stats = {"chunk": index, "conversations": len(specs), "sequences": len(sequences), "kinds": kinds,
             "temperatures": temps, "answer_tokens": answer_tokens, "generated_tokens": generated,
             "seconds": round(seconds_taken, 1), "tokens_per_second": round(generated / seconds_taken, 1),
             "batch_size": config.batch_size, "threads": torch.get_num_threads(),
             "device": device_name(str(device)),
             "self_instruct_kept": len(meta_rows) - len(dropped), "self_instruct_dropped": len(dropped),
             "mix": config.mix, "estimated_tokens_by_kind": estimated, "answer_tokens_by_kind": answers_by_kind,
             "doc_ids": [s.meta.get("doc_id", "") for s in specs]}
    # uint16 halves the files of vocabularies under 65,536 tokens (the chunks are committed with the drafter).
    token_dtype = torch.uint16 if len(tokenizer) <= 65_536 else torch.int32
    tensors = {"tokens": torch.tensor(tokens, dtype=token_dtype),
               "seq_offsets": torch.tensor(offsets, dtype=torch.int64),
               "answer_mask": torch.tensor(answer_mask, dtype=torch.uint8)}
    features = None
    if feature_layers is not None:
        features = torch.cat(list(first_features) + list(second_features))
        assert features.shape[0] == len(tokens)
    return tensors, stats, features


def chunk_stats(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["stats"])


def features_path(features_dir: Path, chunk: Path) -> Path:
    return features_dir / chunk.name


def save_features(path: Path, features: torch.Tensor, feature_layers: tuple[int, ...]) -> None:
    """[T, (n + 1) * H] captured rows -> `features` [T, n * H] (what EAGLE-3's fc reads) and `last_hidden`
    [T, H] (the target's post-norm state: its LM head gives the training labels), float16, atomically."""
    width = features.shape[1] // (len(feature_layers) + 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    save_file({"features": features[:, :-width].contiguous(), "last_hidden": features[:, -width:].contiguous()},
              str(tmp), metadata={"feature_layers": json.dumps(list(feature_layers))})
    os.replace(tmp, path)


def build_corpus(model, tokenizer, config: CorpusConfig, out: Path, exclude: frozenset[str] = frozenset(),
                 max_chunks: int | None = None, features_dir: Path | None = None,
                 feature_layers: tuple[int, ...] | None = None, library: SourceLibrary | None = None) -> list[Path]:
    """Generate every missing chunk of the corpus into `out` (resuming), return all chunk paths. With
    `features_dir` and `feature_layers`, the target features captured while generating are cached there
    (`features.py` computes them for chunks that have none). The broad mix draws from the training side of
    `library` (`sources.registry.load_library()`; the evaluation side is `heldout.split_library`'s other half)."""
    out.mkdir(parents=True, exist_ok=True)
    sources = MixSources.of(split_library(library, config.eval_fraction)[0]) if library is not None else None
    made_from = fingerprint(library) if library is not None else {}
    recipe = out / "corpus.json"
    if recipe.is_file():
        saved = json.loads(recipe.read_text())
        if recipe_fields(saved) != recipe_fields(asdict(config)):
            raise ValueError(f"{out} holds a corpus made with other settings ({recipe}); use another --out "
                             "or the same settings to resume it")
    else:
        recipe.write_text(json.dumps(asdict(config), indent=2) + "\n")
    n_chunks = -(-config.num_conversations // config.chunk_size)
    seen: set[str] = set()
    differs = False
    for index in range(n_chunks):
        path = chunk_path(out, index)
        if path.is_file():
            stats = chunk_stats(path)
            seen.update(stats.get("instruction_keys", []))
            earlier = stats.get("sources")
            if earlier and made_from and earlier != made_from and not differs:
                # Not an error: a corpus may be resumed elsewhere; the chunks say what each drew from.
                differs = True
                warnings.warn(f"{path.name} was made from other sources ({earlier}) than are read now "
                              f"({made_from}); new chunks draw from these (--sources-snapshot keeps them equal)")
    made = 0
    progress = tqdm(range(n_chunks), desc="corpus chunks")
    for index in progress:
        path = chunk_path(out, index)
        if path.is_file():
            remove_partial(out, index)  # a run that died between writing the chunk and removing them
            continue
        if max_chunks is not None and made >= max_chunks:
            break
        before = set(seen)
        tensors, stats, features = generate_chunk(model, tokenizer, config, index, seen, exclude,
                                                  feature_layers if features_dir is not None else None, sources,
                                                  partial_dir(out, index))
        stats["instruction_keys"] = sorted(seen - before)
        stats["sources"] = made_from  # what the broad mix drew from: chunk i's prompts depend on it
        if features is not None:
            save_features(features_path(features_dir, path), features, feature_layers)
        tmp = path.with_suffix(".partial")
        save_file(tensors, str(tmp), metadata={"stats": json.dumps(stats)})
        os.replace(tmp, path)
        remove_partial(out, index)
        made += 1
        progress.set_postfix(tokens_per_s=stats["tokens_per_second"], answer_tokens=stats["answer_tokens"])
    return [chunk_path(out, i) for i in range(n_chunks) if chunk_path(out, i).is_file()]


def corpus_summary(out: Path, chunks: list[Path] | None = None) -> dict:
    """Totals over the chunks written so far, or over `chunks` (for the model card and the command's report);
    `made_on` splits chunks and seconds by the device and batch size that generated them."""
    totals = {"chunks": 0, "sequences": 0, "answer_tokens": 0, "generated_tokens": 0, "seconds": 0.0, "kinds": {},
              "made_on": {}}
    for path in sorted(out.glob("chunk-*.safetensors")) if chunks is None else chunks:
        stats = chunk_stats(path)
        totals["chunks"] += 1
        for key in ("sequences", "answer_tokens", "generated_tokens", "seconds"):
            totals[key] += stats[key]
        for kind in stats["kinds"]:
            totals["kinds"][kind] = totals["kinds"].get(kind, 0) + 1
        for kind, count in stats.get("answer_tokens_by_kind", {}).items():
            by_kind = totals.setdefault("answer_tokens_by_kind", {})
            by_kind[kind] = by_kind.get(kind, 0) + count
        # Chunks from before devices were recorded were all made on CPUs.
        where = f"{stats.get('device', 'cpu')}, batch {stats['batch_size']}"
        made = totals["made_on"].setdefault(where, {"chunks": 0, "seconds": 0.0})
        made["chunks"] += 1
        made["seconds"] += stats["seconds"]
    return totals


@torch.inference_mode()
def compute_chunk_features(model, chunk: Path, features_dir: Path, feature_layers: tuple[int, ...],
                           batch_size: int = 8) -> Path:
    """Features of a chunk that has none cached (a fresh machine, or a corpus made without capture): one
    teacher-forced forward per batch of its sequences, written as `save_features` does."""
    from safetensors.torch import load_file

    device = next(model.parameters()).device
    data = load_file(str(chunk))
    tokens, offsets = data["tokens"].long(), data["seq_offsets"].tolist()
    spans = list(zip(offsets[:-1], offsets[1:]))
    hidden = model.config.hidden_size
    out = torch.zeros(len(tokens), (len(feature_layers) + 1) * hidden, dtype=torch.float16)
    order = sorted(range(len(spans)), key=lambda i: spans[i][1] - spans[i][0])
    for start in tqdm(range(0, len(order), batch_size), desc=f"features {chunk.name}", leave=False):
        rows = [spans[i] for i in order[start:start + batch_size]]
        width = max(e - s for s, e in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, (s, e) in enumerate(rows):
            ids[r, :e - s], mask[r, :e - s] = tokens[s:e], 1
        states = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True,
                       logits_to_keep=1).hidden_states
        fused = torch.cat([states[i] for i in feature_layers] + [states[-1]], dim=-1).to(torch.float16).cpu()
        for r, (s, e) in enumerate(rows):
            out[s:e - 1] = fused[r, :e - s - 1]  # the last token's row stays zero, as captured
    path = features_path(features_dir, chunk)
    save_features(path, out, feature_layers)
    return path
