"""The lean decoder's elementwise work as fused kernels: RMSNorm, the rotary embedding (after Qwen3's per-head q/k
norms, in the same kernel) and the MLP's SiLU(gate) * up, compiled with `torch.compile` (inductor) on CUDA.

Why: inside a CUDA graph the launch cost is gone, but eagerly each of these is a chain of small kernels that
read and write the whole operand every time (RMSNorm: cast, square, mean, add, rsqrt, multiply, cast, multiply;
the rotation: two multiplies, a negation, a concatenation and an add, for queries and for keys), and a graph
replays them all. Compiled, each is one kernel that reads its inputs once: four per decoder layer (five with
Qwen3's q/k norms folded into the rotation's). A previous measurement of the 70B TP=4 rank's static step on an
H200 went from T(1) 19.0 ms to 15.2 ms with it (weight-streaming bound 8.2 ms); to be measured again.

What they compute is transformers' own code (LlamaRMSNorm, identical for Mistral, Qwen2 and Qwen3: the variance
in float32, then `weight * normed.to(input dtype)`; `apply_rotary_pos_emb`; the MLP's `act_fn(gate) * up` with
act_fn = SiLU). Called eagerly (`DecoderOps()`) the results are bit-identical to the modules'. Compiled, inductor
keeps a chain of half-precision operations in float32 and rounds once at the end where eager rounds after every
operation, so bfloat16 / float16 results may differ from eager's by a rounding; float32 results agree to float32
rounding. Projections are not touched: they stay the modules' own calls (a tensor-parallel shard, engine/tp.py,
or a packed CPU linear, engine/models/packed_linear.py, still applies).

Shapes: compiled with `dynamic=True` (one kernel for every size; vLLM likewise compiles one graph over a symbolic
token count) and `fullgraph=True` (a graph break, or hitting the recompile limit, raises instead of silently
running eagerly). The callers' tensors are flattened before the call ([tokens, features], [tokens, heads,
head_dim], or 1-D), so across all the static step's (rows, tokens, context) buckets dynamo only specialises on a
size of 1 (a one-token step gets its own kernel), on the dtype and on a head count of 1: a handful of entries per
function, well under the recompile limit, whatever the buckets. A function compiles at its first call for each
such variant; in the static step that is a capture's warm-up runs (on a side stream, before the capture), never
inside a captured graph.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

# Compiled entries allowed per function (where torch.compile takes a per-call limit): the variants above stay far
# below it; the margin covers a process running several models (a target and a drafter of other dtypes).
RECOMPILE_LIMIT = 32


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """LlamaRMSNorm's forward (Mistral's, Qwen2's and Qwen3's are the same): x [..., H], weight [H]."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """transformers' rotate_half: the last dim's halves swapped, the new first half negated."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(query: Tensor, key: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """apply_rotary_pos_emb over heads-second-to-last tensors: query [..., H, D], key [..., H_kv, D], cos/sin
    [..., D] (broadcast over the heads)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin


def qk_norm_rotary(query: Tensor, key: Tensor, q_weight: Tensor, k_weight: Tensor, q_eps: float, k_eps: float,
                   cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Qwen3's per-head RMSNorms of queries and keys, then the rotation (one kernel when compiled)."""
    return rotary(rms_norm(query, q_weight, q_eps), rms_norm(key, k_weight, k_eps), cos, sin)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """The MLP's act_fn(gate) * up for hidden_act "silu" (nn.SiLU is F.silu)."""
    return F.silu(gate) * up


def norm_is_fusable(module: nn.Module) -> bool:
    """Whether `module` is an RMSNorm of the Llama family (weight * normed, `variance_epsilon`), which `rms_norm`
    reproduces; anything else keeps its own forward."""
    return (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), Tensor)
            and isinstance(getattr(module, "variance_epsilon", None), float))


def mlp_is_fusable(mlp: nn.Module, config) -> bool:
    """Whether the MLP is down(act(gate(x)) * up(x)) with act = SiLU (config.hidden_act "silu")."""
    return getattr(config, "hidden_act", None) == "silu" and all(
        hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj"))


class DecoderOps:
    """The fused functions a lean forward calls, taking the decoder's own shapes and modules: `compile` wraps
    each function (None: they run eagerly, as a CPU test forces the fused path)."""

    def __init__(self, compile: Callable[[Callable], Callable] | None = None):
        wrap = compile or (lambda fn: fn)
        self._rms_norm = wrap(rms_norm)
        self._rotary = wrap(rotary)
        self._qk_norm_rotary = wrap(qk_norm_rotary)
        self._silu_mul = wrap(silu_mul)

    def norm(self, module: nn.Module, x: Tensor) -> Tensor:
        """`module(x)` of a fusable RMSNorm module (`norm_is_fusable`), over x [..., H]."""
        out = self._rms_norm(x.reshape(-1, x.shape[-1]), module.weight, module.variance_epsilon)
        return out.reshape(x.shape)

    def rotate(self, query: Tensor, key: Tensor, cos: Tensor, sin: Tensor, q_norm: nn.Module | None = None,
               k_norm: nn.Module | None = None) -> tuple[Tensor, Tensor]:
        """query [B, W, H, D] and key [B, W, H_kv, D] (heads before they move to dim 1), cos/sin [B, W, D] ->
        both rotated, same shapes; with q_norm / k_norm (Qwen3) each head is normalised first."""
        tokens, dim = query.shape[0] * query.shape[1], query.shape[-1]
        q, k = query.reshape(tokens, -1, dim), key.reshape(tokens, -1, dim)
        cos, sin = cos.reshape(tokens, dim), sin.reshape(tokens, dim)
        if q_norm is None:
            q, k = self._rotary(q, k, cos, sin)
        else:
            q, k = self._qk_norm_rotary(q, k, q_norm.weight, k_norm.weight, q_norm.variance_epsilon,
                                        k_norm.variance_epsilon, cos, sin)
        return q.reshape(query.shape), k.reshape(key.shape)

    def mlp(self, mlp: nn.Module, x: Tensor) -> Tensor:
        """`mlp(x)` of a fusable MLP (`mlp_is_fusable`): its own projections, SiLU(gate) * up fused."""
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        return mlp.down_proj(self._silu_mul(gate.reshape(-1), up.reshape(-1)).reshape(gate.shape))


def compiled_ops(backend="inductor") -> DecoderOps:
    """The functions compiled with `backend` (inductor: Triton kernels on CUDA, C++ on a CPU; a test may pass
    "aot_eager" or a counting backend). Dynamo caches per function, so every DecoderOps shares its entries."""
    options = {"fullgraph": True, "dynamic": True, "backend": backend}
    if "recompile_limit" in inspect.signature(torch.compile).parameters:  # torch >= 2.13
        options["recompile_limit"] = RECOMPILE_LIMIT
    return DecoderOps(lambda fn: torch.compile(fn, **options))


@cache
def cuda_ops() -> DecoderOps:
    """The compiled functions the static step uses on CUDA (built once per process)."""
    return compiled_ops()
