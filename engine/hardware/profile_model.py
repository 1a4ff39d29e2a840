"""The model a cost curve is measured on: a model directory's weights, or a preset's config facts with random
weights built directly on the device (optionally the shapes of one tensor-parallel rank).

A forward's time depends on the shapes and the dtype, not on the values of the weights, so a preset
(deploy/models/NAME/config.json: the public config facts of the deployed models) measured with random weights
gives the curve of the real model without downloading it. With `tp_size` N the model built is what one rank of
engine/tp.py's Megatron layout multiplies: attention heads, KV heads and the MLP width divided by N, embeddings,
norms and LM head whole (replicated). It runs without any process group, so the curve has no all-reduces in
it: a caller adds those itself (the projection models them).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..models.loading import load_causal_lm
from ..tp import check_tp_size
from .cost_curve import ModelFacts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The presets' config facts (one folder per model: config.json), read from the checkout.
MODELS_DIR = Path(__file__).resolve().parents[2] / "deploy" / "models"


def list_presets(models_dir: Path = MODELS_DIR) -> list[str]:
    """Names of the presets: the folders of `models_dir` that hold a config.json."""
    if not models_dir.is_dir():
        return []
    return sorted(p.name for p in models_dir.iterdir() if (p / "config.json").is_file())


def preset_config(name: str, models_dir: Path = MODELS_DIR) -> dict:
    """The config.json facts of preset `name` (ValueError naming the presets when there is none)."""
    path = models_dir / name / "config.json"
    if not path.is_file():
        known = list_presets(models_dir)
        raise ValueError(f"unknown preset {name!r} in {models_dir}; presets: {', '.join(known) or 'none'}")
    data = json.loads(path.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}  # "_comment": a note, not a config field


def rank_config(config: dict, tp_size: int) -> dict:
    """The config of one tensor-parallel rank: heads, KV heads and intermediate size divided by `tp_size`
    (ValueError unless it divides them all), head_dim stated explicitly (hidden stays whole, so it can no longer
    be derived as hidden / heads), vocabulary and hidden size unchanged."""
    try:
        check_tp_size(config, tp_size)
    except ValueError as exc:
        raise ValueError(f"--tp-size {tp_size}: {exc}") from None
    if tp_size == 1:
        return dict(config)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    return {**config, "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
            "num_attention_heads": heads // tp_size, "num_key_value_heads": kv_heads // tp_size,
            "intermediate_size": config["intermediate_size"] // tp_size}


def build_random_model(config: dict, device: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A causal LM of `config` with seeded random weights, allocated directly on `device` in `dtype` (a 70B
    rank never passes through host memory). The default dtype is restored afterwards; `dtype` is also passed
    explicitly, since transformers otherwise follows a config's own torch_dtype (the presets say float16).
    Buffers the model code makes in float32 (rotary frequencies) stay float32, as when loading weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"config model_type {model_type!r} is not a causal LM transformers knows")
    hf_config = AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager", dtype=dtype)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def rank_shapes(config) -> dict[str, int]:
    """The sizes a forward's cost depends on, of a transformers config (as built: one rank's under TP)."""
    heads = config.num_attention_heads
    return {"hidden": config.hidden_size, "layers": config.num_hidden_layers, "heads": heads,
            "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
            "intermediate": config.intermediate_size, "vocab": config.vocab_size}


def model_facts(model: torch.nn.Module, source: str, name: str, tp_size: int) -> ModelFacts:
    """Parameters and the weight bytes one forward reads: every parameter once (ties counted once), less an
    untied input embedding (a forward reads only the rows of its tokens; a tied one is the LM head, read whole)."""
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in params)
    total_bytes = sum(p.numel() * p.element_size() for p in params)
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embedding
    matmul = total - (0 if tied else embedding.numel())
    weight_bytes = total_bytes - (0 if tied else embedding.numel() * embedding.element_size())
    return ModelFacts(source=source, name=name, tp_size=tp_size, rank_shapes=rank_shapes(model.config),
                      params=total, matmul_params=matmul, weight_bytes=weight_bytes)


def load_profile_model(model: str | None = None, preset: str | None = None, tp_size: int = 1,
                       device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
                       models_dir: Path = MODELS_DIR) -> tuple[torch.nn.Module, ModelFacts]:
    """Exactly one of `model` (a directory, a .gguf or "default", through `load_causal_lm`) and `preset`
    (random weights of its config facts, `tp_size` > 1: one rank's shapes) -> (model, its facts)."""
    if (model is None) == (preset is None):
        raise ValueError("give exactly one of --model and --preset")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"--tp-size must be a positive integer, got {tp_size!r}")
    if model is not None:
        if tp_size != 1:
            raise ValueError("--tp-size needs --preset: a model directory's weights are measured whole (one rank's "
                             "shapes are built from a preset's config facts with random weights)")
        loaded = load_causal_lm(model, device, dtype)
        return loaded.model, model_facts(loaded.model, "directory", str(model), 1)
    built = build_random_model(rank_config(preset_config(preset, models_dir), tp_size), device, dtype, seed)
    return built, model_facts(built, "preset", preset, tp_size)
