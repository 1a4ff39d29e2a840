"""Shared fixtures: tiny randomly initialised Llama models with the default target's tokenizer.

The tokenizer comes from the embedded default model (converted once into $TREESERVE_CACHE), so tiny
models exercise the same loading path, chat template and vocabulary as the real pair.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch

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
