"""Shared fixtures: tiny randomly initialised Llama models with the default target's tokenizer.

The tokenizer comes from the embedded default model (converted once into $TREESERVE_CACHE), so tiny
models exercise the same loading path, chat template and vocabulary as the real pair.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from treeserve.engine.models.loading import chat_ids

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def make_tiny_llama(out_dir: Path, tokenizer_dir: Path, seed: int, layers: int = 2, hidden: int = 64,
                    heads: int = 4, kv_heads: int = 2) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger logits than the default init give peaked, tie-free distributions, like a trained model.
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@dataclass
class MultiEosModel:
    """A tiny Llama whose generation_config.json lists several EOS ids (as Llama-3's and Qwen2.5's do), and prompts
    on which `generate` stops at each of them."""

    path: Path
    eos_ids: list[int]  # the generation config's eos_token_id, the tokenizer's EOS among them
    prompts: list[list[int]]  # greedy `generate` from prompts[i] stops on stops[i]
    stops: list[int]  # two ids only the generation config names, then the tokenizer's EOS
    free_run: list[int]  # the greedy continuation of prompts[0] when nothing stops it

    def greedy(self, prompt: list[int], max_new_tokens: int, extra_stops: tuple[int, ...] = ()) -> list[int]:
        """What Hugging Face `generate` emits from the directory's model: greedy, stopping on its generation
        config's EOS ids (and `extra_stops`), the stop token included."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.path, local_files_only=True).eval()
        kwargs = {"eos_token_id": [*self.eos_ids, *extra_stops]} if extra_stops else {}
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=0, **kwargs)
        return out[0, len(prompt):].tolist()


def make_multi_eos_llama(out_dir: Path, tokenizer_dir: Path, seed: int = 1) -> MultiEosModel:
    """Greedy decoding of the chat prompt walks through distinct tokens t0, t1, ...; the generation config lists
    [t7, tokenizer EOS, t3] and the LM head rows of the tokenizer's EOS and t11 are swapped, so `generate` stops
    on t3 from the prompt, on t7 from the prompt + t0..t3, and on the tokenizer's EOS from the prompt + t0..t7."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    # Untied: a tied head over N(0, 1) embeddings repeats the prompt's last token; an untied one moves on.
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 1.0)

    def free_run(prompt: list[int]) -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        return out[0, len(prompt):].tolist()

    prompt = chat_ids(tokenizer, "Tell me a story about a fox.")
    eos = tokenizer.eos_token_id
    swap = free_run(prompt)[11]
    with torch.no_grad():
        model.lm_head.weight[[eos, swap]] = model.lm_head.weight[[swap, eos]]
    free = free_run(prompt)
    if free[11] != eos or len(set(free[:12])) != 12:
        raise AssertionError(f"the multi-EOS test model did not come out as designed: {free}")
    model.generation_config.eos_token_id = [free[7], eos, free[3]]
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return MultiEosModel(out_dir, [free[7], eos, free[3]], [prompt, prompt + free[:4], prompt + free[:8]],
                         [free[3], free[7], eos], free)


@pytest.fixture(scope="session")
def multi_eos_model(tmp_path_factory, default_model_dir) -> MultiEosModel:
    return make_multi_eos_llama(tmp_path_factory.mktemp("multi_eos"), default_model_dir)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from treeserve.engine.models.loading import resolve_model_dir

    return resolve_model_dir("default")


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, default_model_dir) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_target"), default_model_dir, seed=1)


@pytest.fixture(scope="session")
def tiny_drafter_dir(tmp_path_factory, default_model_dir) -> Path:
    # Same seed, one layer: shares the target's embeddings, so it agrees with the target often enough to
    # exercise long accepted paths while still being wrong sometimes.
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_drafter"), default_model_dir, seed=1, layers=1)


def _fits_any_order(gpus: int, requests: list[float]) -> bool:
    """Ray's GPU instance allocation: a whole-GPU request takes a free GPU, a fractional one the first GPU with
    room for it. True when every allocation order of `requests` succeeds on `gpus` GPUs."""
    for order in set(itertools.permutations(requests)):
        free = [1.0] * gpus
        for request in order:
            if request >= 1:
                whole = [i for i, f in enumerate(free) if f >= 1 - 1e-9][:int(request)]
                if len(whole) < request:
                    return False
                for i in whole:
                    free[i] = 0.0
            else:
                room = next((i for i, f in enumerate(free) if f >= request - 1e-9), None)
                if room is None:
                    return False
                free[room] -= request
    return True


@pytest.fixture(scope="session")
def fits_any_order():
    """Whether GPU requests (whole or fractional) fit `gpus` GPUs in every arrival order, as Ray allocates them:
    shared by the deploy layouts' and the chart's placement tests."""
    return _fits_any_order
