"""Tensor-parallel plan for the target, applied to an already-built transformers causal LM.

The model code stays TP-agnostic: `apply_tp(model, mesh)` swaps the projection weights of every decoder
layer for `DTensor` shards with `torch.distributed.tensor.parallel.parallelize_module` (Megatron layout):

- attention `q_proj`, `k_proj`, `v_proj` and MLP `gate_proj`, `up_proj`: `ColwiseParallel` (output features
  sharded; each rank computes `heads / tp` query heads and `kv_heads / tp` KV heads);
- attention `o_proj` and MLP `down_proj`: `RowwiseParallel` (input features sharded, outputs all-reduced),
  so two all-reduces per layer and everything between them is rank-local.

Colwise/Rowwise return plain local tensors (`use_local_output=True`), and transformers 5 attention reshapes
with `view(*input_shape, -1, head_dim)`, so each rank's attention sees its own heads only and its KV cache
holds `kv_heads / tp` heads: **the KV cache is sharded by KV head** with no change to `CachedLM` (its KV
pool takes its head count from the states the model hands it, and compaction moves slots along the sequence
axis, which every shard has in full). GQA grouping (`num_key_value_groups = heads / kv_heads`, and the grouped
attention of engine/models/attention.py) is unchanged by the split, because both counts are divided by tp.

Embeddings and LM head stay **replicated**: they are a small share of a large model's weights
(Llama-2-70B: 2 x 32000 x 8192 x 2 B = 1 GB of ~140 GB), replication needs no communication, and rank 0 gets
the full logits [N, V] that the router's verification needs without a gather. Shard them when the vocabulary
is large against the per-rank memory (e.g. 128k-256k vocabularies, or tp >= 8): embedding as a vocab-parallel
`RowwiseParallel(input_layouts=Replicate())` (an all-reduce of [B, N, H]) and the LM head as
`ColwiseParallel(output_layouts=Replicate())` (an all-gather of the logits, [B, N, V], per step).

Head counts that do not divide the world size are rejected by `check_tp_size` with a ValueError before any
process-group work (callers run it on the config before spawning ranks; `apply_tp` re-checks).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")
# Where the projections sit inside a decoder layer (Llama, Mistral, Qwen2/3, Gemma, Phi-3-style MLPs ...).
_ATTN = ("self_attn",)
_MLP = ("mlp",)


def _get(config: Any, name: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def check_tp_size(config: Any, tp_size: int) -> None:
    """Raise ValueError unless `tp_size` divides the head counts (and the MLP width) of `config`.

    `config` is a transformers PretrainedConfig or the config.json mapping. Pure arithmetic: safe to call
    before any process group exists."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp_size!r}")
    heads = _get(config, "num_attention_heads")
    if heads is None:
        raise ValueError("model config has no num_attention_heads: cannot plan tensor parallelism")
    kv_heads = _get(config, "num_key_value_heads") or heads
    facts = {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    if _get(config, "intermediate_size"):
        facts["intermediate_size"] = _get(config, "intermediate_size")
    bad = {k: v for k, v in facts.items() if v % tp_size}
    if bad:
        valid = [n for n in range(1, heads + 1) if heads % n == 0 and kv_heads % n == 0
                 and all(v % n == 0 for v in facts.values())]
        what = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's {what} "
                         f"(valid sizes for this model: {valid})")


def tp_plan_for(model: torch.nn.Module, tp_size: int | None = None) -> dict[str, Any]:
    """The module-name -> ParallelStyle plan for `model` (checked against `tp_size` when given).

    Raises ValueError when the model has no recognisable decoder projections (e.g. fused qkv), rather than
    silently running it unsharded."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if tp_size is not None:
        check_tp_size(model.config, tp_size)
    plan: dict[str, Any] = {}
    for name, module in model.named_modules():
        parts = name.rsplit(".", 2)
        if len(parts) < 3 or not isinstance(module, torch.nn.Linear):
            continue
        _, parent, leaf = parts
        if parent in _ATTN + _MLP and leaf in COLWISE:
            plan[name] = ColwiseParallel()
        elif parent in _ATTN + _MLP and leaf in ROWWISE:
            plan[name] = RowwiseParallel()
    layers = _get(model.config, "num_hidden_layers")
    expected = len(COLWISE + ROWWISE) * (layers or 0)
    if not plan or (layers and len(plan) != expected):
        raise ValueError(f"{type(model).__name__}: found {len(plan)} of {expected} expected projection "
                         f"layers ({', '.join(COLWISE + ROWWISE)} under self_attn/mlp); no TP plan for it")
    return plan


def apply_tp(model: torch.nn.Module, device_mesh, *, src_data_rank: int | None = None) -> torch.nn.Module:
    """Shard `model` in place over the 1-D `device_mesh` and return it.

    `src_data_rank=None` (default) splits each rank's own copy locally with no communication, which is right
    when every rank loaded the same weights; pass 0 to scatter rank 0's values instead (randomly initialised
    models). Parameters already holding meta tensors stay meta (their shards are loaded afterwards by
    `treeserve.engine.models.tp_loading`), so this also works on a model built on the meta device."""
    tp_size = device_mesh.size()
    plan = tp_plan_for(model, tp_size)
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, device_mesh, plan, src_data_rank=src_data_rank)
    # Modules that remember their head counts (older attention code) must see the local counts; transformers
    # 5 Llama-style attention keeps none and reshapes with -1.
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in _ATTN:
            for attr in ("num_heads", "num_key_value_heads"):
                value = getattr(module, attr, None)
                if isinstance(value, int) and value % tp_size == 0:
                    setattr(module, attr, value // tp_size)
    model._treeserve_tp_size = tp_size
    return model


def placements_for(param_name: str, plan: Mapping[str, Any]) -> tuple[str, int] | None:
    """How `param_name` is split by `plan`: ("shard", dim) or None (replicated).

    Colwise: weight [out, in] and bias split on dim 0. Rowwise: weight split on dim 1, bias replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    module_name, _, leaf = param_name.rpartition(".")
    style = plan.get(module_name)
    if isinstance(style, ColwiseParallel):
        return ("shard", 0)
    if isinstance(style, RowwiseParallel):
        return ("shard", 1) if leaf == "weight" else None
    return None
