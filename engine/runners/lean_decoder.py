"""A Llama-layout decoder stack as bare tensor ops over a static KV pool: the body of the static-shape step.

transformers' modules are written for generality: each forward builds its masks and cache bookkeeping in
Python, which on a GPU costs ~0.75-1 ms of host time per decoder layer (docs/performance.md, "the GPU step").
This forward runs the same weights through the same submodules (norms, projections, MLP: a tensor-parallel
plan or packed CPU linears still apply, since they replace those modules) in eager's order, with nothing
that depends on the data on the host, so one call can be captured as a CUDA graph (gpt-fast's decoder over a
static KV cache; vLLM's and SGLang's CUDA-graph runners).

Per layer: RMSNorm, q/k/v projections (+ Qwen3's per-head q/k norms), rotary embedding read from a table
built once from the model's own rotary module (Llama-3 and linear rope scaling included), the new keys and
values written into the pool at each token's (row, slot), the batch rows' leading pool slots gathered (the
step's context bucket), attention with the additive mask over them (grouped, without repeating KV heads: SDPA's `enable_gqa` on
a GPU, engine/models/attention.py on a CPU), output projection, RMSNorm, MLP.

With `DecoderParts.ops` (on CUDA by default: `StaticStepSettings.fused_ops`) the RMSNorms, the rotation (with
Qwen3's q/k norms) and the MLP's SiLU(gate) * up run as compiled fused kernels (engine/runners/fused_ops.py)
instead of the modules' elementwise chains; the projections stay the modules' own calls either way.

Supported: the Llama layout (llama, mistral without an active sliding window, qwen2 with its q/k/v bias,
qwen3); anything else (an EAGLE head, an unknown layout, a dynamic rope) is reported by `unsupported_reason`
and runs through the model's own forward instead.

The two ends of the stack are the causal LM's own `model.embed_tokens` and `lm_head` unless the caller passes
`LeanEnds`: a drafter model whose ids or head differ (the parallel drafter embeds [MASK] ids < 0 with its own
rule and has a head over a sub-vocabulary) declares them (engine/drafters/models/base.py
`DrafterModel.lean_ends`), and CachedLM hands them to `unsupported_reason` and `decoder_parts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..models.attention import grouped_attention
from ..models.hf_cache import cache_argument
from .fused_ops import DecoderOps, cuda_ops, mlp_is_fusable, norm_is_fusable, rotate_half

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
STATIC_ROPE_TYPES = ("default", "linear", "llama3")  # rope tables that do not depend on the sequence


@dataclass(frozen=True)
class LeanEnds:
    """How a model's token ids become the first hidden state and what turns the final normed state into
    logits, where these are not a causal LM's `model.embed_tokens` and `lm_head`. `embed` runs inside a captured
    forward: it may not read a device value on the host (no `if tensor.any()`)."""

    embed: Callable[[Tensor], Tensor]  # input_ids [B, W] -> [B, W, hidden]
    head: nn.Module  # [B, W', hidden] -> logits [B, W', V]


@dataclass
class DecoderParts:
    """The submodules of a causal LM the lean forward calls, found once."""

    embed: Callable[[Tensor], Tensor]  # token embedding (model.embed_tokens, or a drafter's `LeanEnds.embed`)
    layers: list[nn.Module]  # decoder layers (input_layernorm, self_attn, post_attention_layernorm, mlp)
    norm: nn.Module  # final RMSNorm
    lm_head: nn.Module  # model.lm_head, or a drafter's `LeanEnds.head`
    head_dim: int
    scaling: float  # attention score scale (head_dim ** -0.5 for every supported layout)
    cos: Tensor  # [positions, head_dim] rotary cosines, in the model's dtype (the rotary module's own values)
    sin: Tensor  # [positions, head_dim]
    ops: DecoderOps | None = None  # fused norms / rotation / SiLU-and-multiply (None: the modules' own forwards)
    fused_mlp: bool = False  # with `ops`: the MLP's activation is SiLU, so SiLU(gate) * up runs fused too


def unsupported_reason(model: nn.Module, ends: LeanEnds | None = None) -> str | None:
    """Why `model` cannot run the lean forward (None: it can); `ends`: its embedding and head when they are not
    `model.embed_tokens` and `model.lm_head` (a drafter model's `lean_ends()`)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "not a decoder-only causal LM layout (model.embed_tokens / layers / norm / rotary_emb)"
    if ends is None and not isinstance(getattr(model, "lm_head", None), nn.Module):
        return "no lm_head (a model with a head or embedding of its own passes LeanEnds)"
    rope_type = getattr(inner.rotary_emb, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r} depends on the sequence length"
    if getattr(config, "use_sliding_window", model_type == "mistral") and getattr(config, "sliding_window", None):
        return "a sliding attention window is not supported"
    return None


def decoder_parts(model: nn.Module, positions: int, device: torch.device, dtype: torch.dtype,
                  fused_ops: bool = False, ops: DecoderOps | None = None, ends: LeanEnds | None = None
                  ) -> DecoderParts:
    """The parts of a supported model (check `unsupported_reason` first) with rotary tables for `positions`;
    `ends`: the embedding and head to use instead of `model.embed_tokens` and `model.lm_head`.
    `fused_ops`: on a CUDA device the elementwise ops run compiled and fused (engine/runners/fused_ops.py);
    `ops`: run these fused ops on any device (a CPU test forces the fused path with them). Either way only when
    every norm is an RMSNorm of the Llama family; SiLU(gate) * up only when config.hidden_act is "silu"."""
    inner = model.model
    first = inner.layers[0].self_attn
    head_dim = first.head_dim
    with torch.inference_mode():
        ids = torch.arange(positions, device=device)[None]
        cos, sin = inner.rotary_emb(torch.zeros(1, dtype=dtype, device=device), ids)
    if ops is None and fused_ops and torch.device(device).type == "cuda":
        ops = cuda_ops()
    norms = [inner.norm] + [getattr(layer, name) for layer in inner.layers
                            for name in ("input_layernorm", "post_attention_layernorm")]
    norms += [getattr(layer.self_attn, name) for layer in inner.layers for name in ("q_norm", "k_norm")
              if hasattr(layer.self_attn, name)]
    if ops is not None and not all(norm_is_fusable(norm) for norm in norms):
        ops = None
    fused_mlp = ops is not None and all(mlp_is_fusable(layer.mlp, model.config) for layer in inner.layers)
    embed, head = (inner.embed_tokens, model.lm_head) if ends is None else (ends.embed, ends.head)
    return DecoderParts(embed, list(inner.layers), inner.norm, head, head_dim,
                        first.scaling, cos[0].contiguous(), sin[0].contiguous(), ops, fused_mlp)


@dataclass
class StepBuffers:
    """The inputs of one lean forward; the static step keeps one set per bucket, filled in place."""

    input_ids: Tensor  # [B, W] long
    positions: Tensor  # [B, W] long, rotary position of each token
    mask: Tensor  # [B, 1, W, C] additive attention mask over the leading C slots of each batch row's session
    write_pages: Tensor  # [B, W] long: pool page each token's keys and values go to (padding: the scratch page)
    write_offsets: Tensor  # [B, W] long: slot within that page
    read_pages: Tensor  # [B, ceil(C / page)] long: each batch row's page table over its leading C slots (past its
    # own pages, and for padding rows: the scratch page)
    features: Tensor | None = None  # [B, W, F] parent features of each row (a feature-reading drafter head only)


class PoolRows:
    """The KV pool seen by one static forward: `update` writes the new keys and values at each token's (page,
    offset) and returns each batch row's leading slots gathered through its page table. It has the
    `update(key, value, layer)` of a transformers Cache, so a drafter head's own attention
    (engine/drafters/models/eagle3.py) runs over it unchanged."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], inputs: StepBuffers):
        self.keys, self.values, self.inputs = keys, values, inputs

    def update(self, key: Tensor, value: Tensor, layer: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """key/value [B, H_kv, W, D] -> keys/values [B, H_kv, C, D] of the batch rows, the new ones included: their
        leading C slots, C = the mask's width (the step's context bucket)."""
        pages, offsets = self.inputs.write_pages, self.inputs.write_offsets
        # The pool is [H_kv, pages, P, D] (engine/runners/kv_pool.py); adjacent advanced indices stay in place, so
        # the target is [H_kv, B, W, D].
        self.keys[layer][:, pages, offsets] = key.transpose(0, 1)
        self.values[layer][:, pages, offsets] = value.transpose(0, 1)
        return self._read(self.keys[layer]), self._read(self.values[layer])

    def _read(self, pool: Tensor) -> Tensor:
        """[B, H_kv, C, D]: each batch row's leading C slots, one gather of its pages."""
        table, context = self.inputs.read_pages, self.inputs.mask.shape[-1]
        heads, _, size, dim = pool.shape
        rows = pool.index_select(1, table.flatten()).view(heads, table.shape[0], table.shape[1] * size, dim)
        return rows.transpose(0, 1)[:, :, :context]


def _attention(module: nn.Module, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scaling: float
               ) -> Tensor:
    """query [B, H, W, D], keys/values [B, H_kv, C, D], mask [B, 1, W, C] -> [B, W, H * D]."""
    batch, _, width, _ = query.shape
    if query.device.type == "cpu":
        out, _ = grouped_attention(module, query, keys, values, mask, scaling)  # [B, W, H, D]
        return out.reshape(batch, width, -1)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                         enable_gqa=keys.shape[1] != query.shape[1])
    return out.transpose(1, 2).reshape(batch, width, -1)


def lean_forward(parts: DecoderParts, keys: list[Tensor], values: list[Tensor], inputs: StepBuffers,
                 keep_from: int = 0, feature_layers: tuple[int, ...] | None = None,
                 want_hidden: bool = False) -> tuple[Tensor, Tensor | None]:
    """One forward of B rows x W tokens: writes their KV into the pool tensors (per layer [rows, H_kv, C, D]),
    returns logits [B, W - keep_from, V] of tokens keep_from.. and, with `want_hidden`, the features of every
    row [B, W, H or len(feature_layers) * H] (hidden_states indices: 0 the embeddings, i the output of layer
    i, the last the final normed state, as transformers numbers them)."""
    batch, width = inputs.input_ids.shape
    pool = PoolRows(keys, values, inputs)
    ops = parts.ops
    hidden = parts.embed(inputs.input_ids)
    cos = parts.cos[inputs.positions]  # [B, W, D]
    sin = parts.sin[inputs.positions]
    if ops is None:
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, W, D]: broadcast over heads
    states = [hidden] if want_hidden and feature_layers is not None else None
    for index, layer in enumerate(parts.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden) if ops is None else ops.norm(layer.input_layernorm, hidden)
        query = attn.q_proj(x).view(batch, width, -1, parts.head_dim)
        key = attn.k_proj(x).view(batch, width, -1, parts.head_dim)
        value = attn.v_proj(x).view(batch, width, -1, parts.head_dim)
        if ops is not None:  # one kernel: Qwen3's per-head q/k norms, then the rotation
            query, key = ops.rotate(query, key, cos, sin, getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))
            query, key = query.transpose(1, 2), key.transpose(1, 2)
        else:
            if hasattr(attn, "q_norm"):  # Qwen3 normalises each head before the rotation
                query, key = attn.q_norm(query), attn.k_norm(key)
            query, key = query.transpose(1, 2), key.transpose(1, 2)
            query = query * cos + rotate_half(query) * sin
            key = key * cos + rotate_half(key) * sin
        row_keys, row_values = pool.update(key, value.transpose(1, 2), index)
        out = _attention(attn, query, row_keys, row_values, inputs.mask, parts.scaling)
        hidden = hidden + attn.o_proj(out)
        if ops is None:
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        else:
            x = ops.norm(layer.post_attention_layernorm, hidden)
            hidden = hidden + (ops.mlp(layer.mlp, x) if parts.fused_mlp else layer.mlp(x))
        if states is not None:
            states.append(hidden)
    normed = parts.norm(hidden) if ops is None else ops.norm(parts.norm, hidden)
    logits = parts.lm_head(normed[:, keep_from:])
    if not want_hidden:
        return logits, None
    if feature_layers is None:
        return logits, normed
    states[-1] = normed
    return logits, torch.cat([states[i] for i in feature_layers], dim=-1)


def head_forward(model: nn.Module, keys: list[Tensor], values: list[Tensor], inputs: StepBuffers,
                 keep_from: int = 0) -> tuple[Tensor, Tensor]:
    """A feature-reading drafter head's own forward (EAGLE-3: one layer over the token and its parent feature)
    over the static pool: logits [B, W - keep_from, V_draft] and its predicted features `hidden` [B, W, H]."""
    out = model(input_ids=inputs.input_ids, parent_features=inputs.features, attention_mask=inputs.mask,
                position_ids=inputs.positions, **cache_argument(model, PoolRows(keys, values, inputs)),
                use_cache=True, logits_to_keep=inputs.input_ids.shape[1] - keep_from)
    return out.logits, out.hidden
