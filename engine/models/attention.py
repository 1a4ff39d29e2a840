"""Grouped-query attention that reads the unexpanded KV heads, registered with transformers.

transformers' eager attention (and its SDPA path, except for one-token queries) first expands the KV
heads to the query heads (`repeat_kv`): a copy of every layer's whole K and V per forward. Tree forwards
have many query tokens and batched steps read long caches, so on a CPU that copy is a large share of a
batched step (measured: docs/performance.md section 4).

Folding each group's query heads into the query axis gives the same products from the KV heads as stored:
query [B, H, q, D] -> [B, H_kv, g * q, D] (query head h = kv head h // g, as `repeat_kv` pairs them), one
matmul against K [B, H_kv, L, D], the additive mask broadcast over the g heads, float32 softmax, one matmul
against V. These are eager's operations in eager's order, so the 4D additive tree masks behave exactly as
there (docs/design.md section 4); only matmul blocking differs (float rounding). Heads are whatever the module
holds, so a tensor-parallel shard (fewer heads per rank) works unchanged.

Which implementation runs is chosen per device (`attention_for`): this one on the CPU; on a GPU PyTorch's
fused `scaled_dot_product_attention` ("sdpa"), where eager-style matmuls are the slow path. Both take the
same additive float tree mask (transformers hands a 4D mask to the attention function as it is, and SDPA adds
a float `attn_mask` to the scores), so the tree logits agree to float rounding (tests/runners/test_attention.py).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

GROUPED_ATTENTION = "treeserve_grouped"


def grouped_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      scaling: float, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """transformers attention interface: query [B, H, q, D], key/value [B, H_kv, L, D], attention_mask
    additive [B, 1, q, L] or None -> (output [B, q, H, D], no attention weights)."""
    if dropout and module.training:
        raise ValueError("grouped attention is for inference: attention dropout must be 0")
    batch, heads, q_len, head_dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scores = torch.matmul(query.reshape(batch, kv_heads, groups * q_len, head_dim), key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores.view(batch, kv_heads, groups, q_len, length) + attention_mask[:, :, None, :, :length]
    probs = torch.softmax(scores.view(batch, kv_heads, groups * q_len, length), dim=-1, dtype=torch.float32)
    out = torch.matmul(probs.to(query.dtype), value).view(batch, heads, q_len, head_dim)
    return out.transpose(1, 2).contiguous(), None


def attention_for(device: str | torch.device) -> str:
    """The attention implementation a model runs on `device`: grouped (eager-style) on the CPU, SDPA elsewhere."""
    return GROUPED_ATTENTION if torch.device(device).type == "cpu" else "sdpa"


def use_attention(model: nn.Module, implementation: str) -> nn.Module:
    """Run `model`'s attention through `implementation` ("treeserve_grouped", "sdpa" or "eager"); returns it."""
    if implementation == GROUPED_ATTENTION:
        return use_grouped_attention(model)
    if implementation not in ("sdpa", "eager"):
        raise ValueError(f"attention implementation must be {GROUPED_ATTENTION}, sdpa or eager, got {implementation!r}")
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = implementation
    return model


def use_grouped_attention(model: nn.Module) -> nn.Module:
    """Run `model`'s attention through `grouped_attention` (idempotent); returns `model`.

    Sets the attention implementation on the model's config (the attention modules share it), after
    registering the function and its mask builder with transformers under GROUPED_ATTENTION."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    # Dict updates: idempotent. Masks the model builds itself (calls without our 4D mask) are eager's
    # additive float masks, the form `grouped_attention` adds to its scores.
    AttentionInterface.register(GROUPED_ATTENTION, grouped_attention)
    AttentionMaskInterface.register(GROUPED_ATTENTION, eager_mask)
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = GROUPED_ATTENTION
    return model
