"""Load a drafter model for a target from a path: a shipped name (engine/drafters/registry.py) or a directory.

The directory's layout (engine/drafters/models/compatibility.py) picks the model class; everything is checked
against the target from the files first, so a drafter that does not fit is refused with one line, never loaded
with random weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ...models.loading import load_model, resolve_model_dir
from ..registry import PARALLEL_KIND, SHIPPED, canonical_name, drafter_dir
from .compatibility import check_drafter, detect_layout
from .distilled import RestrictedVocabDrafter
from .eagle import EagleDrafter
from .eagle3 import Eagle3Drafter
from .formats import EAGLE3_ARCHITECTURE, PARALLEL_KEY, feature_layers_from_config
from .parallel import ParallelDrafterModel, is_parallel_drafter
from .published_eagle import PublishedEagleDrafter


def _existing_dir(path: str, kind: str | None = None) -> Path:
    """The directory `path` names; FileNotFoundError (with how to train it, for a shipped name) when absent."""
    name = canonical_name(path, kind)
    model_dir = drafter_dir(name)
    if name in SHIPPED and not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no {name} drafter in {model_dir}; train one with `{SHIPPED[name].train_hint}`")
    if not model_dir.exists():
        raise FileNotFoundError(f"drafter path {model_dir} does not exist")
    return model_dir


def load_drafter(path: str, target: nn.Module, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 target_name: str | None = None) -> nn.Module:
    """Load an autoregressive drafter for `target`: "distilled" (the shipped distilled drafter), "eagle" / "eagle3"
    (the shipped EAGLE drafters), a directory holding a TreeServe drafter, a published EAGLE-3 or EAGLE-1/2 head
    (detected from its files), or any local causal LM directory sharing the target's tokenizer.

    All return `.logits` [B, T, V] and take and return their KV cache under the keyword that
    engine/models/hf_cache.py names (`past_key_values`, but `cache` for a plain causal LM on transformers >= 5.24);
    a restricted or EAGLE drafter's logits cover only its `vocab_ids`, and an EAGLE drafter also reads
    `parent_features`. A directory that does not fit the target (vocabulary, hidden size, tokenizer, feature
    layers, missing / unexpected / misshapen weights) is refused with a one-line ValueError naming both models,
    never loaded with random weights.
    """

    model_dir = resolve_model_dir(_existing_dir(path))
    target_dir = target.config._name_or_path or ""
    target_name = target_name or target_dir or "the target"
    facts = {**target.config.to_dict(), "_path": target_dir if Path(target_dir).is_dir() else None}
    check_drafter(facts, model_dir, target_name=target_name, drafter_name=path)  # files only, before any tensor
    layout = detect_layout(model_dir)
    embeddings = target.get_input_embeddings().weight
    if layout == "eagle3":
        return Eagle3Drafter.load(model_dir, embeddings, device, dtype, target_layers=target.config.num_hidden_layers)
    if layout == "treeserve_eagle":
        return EagleDrafter.load(model_dir, embeddings, device, dtype)
    if layout == "restricted":
        return RestrictedVocabDrafter.load(model_dir, embeddings, device, dtype)
    if layout == "eagle":
        return PublishedEagleDrafter.load(model_dir, target, device, dtype, target_name=target_name)
    if layout == "parallel":
        raise ValueError(f"drafter {path} is a parallel drafter: set the drafter kind to parallel")
    return load_model(model_dir, device, dtype, strict=True)


def load_parallel_drafter(path: str, target: nn.Module, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Load a parallel drafter for `target`: "parallel" (the shipped one) or a directory."""
    model_dir = _existing_dir(path, PARALLEL_KIND)
    if not is_parallel_drafter(model_dir):
        raise ValueError(f"{model_dir} is not a parallel drafter (no {PARALLEL_KEY} in config.json)")
    return ParallelDrafterModel.load(model_dir, target.get_input_embeddings().weight, device, dtype)


def target_feature_layers(path: str, target_layers: int | None = None) -> tuple[int, ...] | None:
    """The target hidden_states a drafter directory's EAGLE-3 head fuses (None: any other drafter, including
    EAGLE-1/2, which reads the final state). Read from config.json alone, so a Target replica knows what to
    return without loading the drafter; a head whose config names no layers reads EAGLE-3's default for a
    `target_layers`-layer target."""
    config = drafter_dir(path) / "config.json"
    if not config.is_file():
        return None
    raw = json.loads(config.read_text())
    if EAGLE3_ARCHITECTURE not in raw.get("architectures", []):
        return None
    return feature_layers_from_config(raw, target_layers)
