"""How a CachedLM runs its forwards: eagerly through the model's own modules, or as a static-shape step.

Torch-free, so configs, the CLI and memory estimates can read it without loading a model. The step itself
is engine/runners/static_step.py.
"""

from __future__ import annotations

from dataclasses import dataclass

# Rows x new tokens per forward are padded up to these sizes, so a handful of shapes cover every step.
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
DEFAULT_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class StaticStepSettings:
    """A static-shape step: fixed input buffers per (rows, tokens) bucket, a preallocated KV pool, CUDA graphs
    where CUDA exists (gpt-fast's static cache, vLLM's / SGLang's CUDA-graph runners)."""

    # rows per forward are padded up to the smallest of these that holds them; more rows: eager, exact shape
    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    # new tokens per row (extension + tree nodes) are padded up to these; more (a prefill): eager, exact shape
    token_buckets: tuple[int, ...] = DEFAULT_TOKEN_BUCKETS
    # capture one CUDA graph per (batch bucket, token bucket) and replay it; ignored off CUDA
    cuda_graphs: bool = True
    # on CUDA, run the decoder's RMSNorms, rotary embedding (with Qwen3's q/k norms) and SiLU(gate) * up as fused
    # kernels compiled with torch.compile (engine/runners/fused_ops.py; compiled at their first calls, which are a
    # capture's warm-up runs) instead of the modules' chains of small kernels; off: the modules' own forwards.
    # Ignored off CUDA
    fused_ops: bool = True
    # buckets of more rows x tokens than this run eagerly (padded) instead of as graphs: their launch overhead is
    # small beside their work, and their graphs' memory is not
    max_graph_tokens: int = 1024
    # the most memory the captured graphs' private pool may take (MiB); buckets beyond it are refused at start
    graph_memory_mib: int = 4096
    # KV slots per row when the CachedLM was not given max_context_tokens (the in-process engine)
    context_tokens: int = 2048
    # attention reads only the leading slots of the rows, rounded up to a context bucket: this one, doubling up
    # to the row's capacity (a short context must not pay for reading and gathering the whole row)
    min_context_bucket: int = 512

    def __post_init__(self) -> None:
        for name in ("batch_buckets", "token_buckets"):
            buckets = getattr(self, name)
            if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
                raise ValueError(f"{name} must be increasing positive sizes, got {list(buckets)}")
        if self.graph_memory_mib < 0 or min(self.context_tokens, self.max_graph_tokens, self.min_context_bucket) < 1:
            raise ValueError("graph_memory_mib must be >= 0, context_tokens, max_graph_tokens and min_context_bucket "
                             ">= 1")

    def bucket(self, buckets: tuple[int, ...], size: int) -> int | None:
        """The smallest bucket holding `size`, None past the largest (that forward runs eagerly)."""
        return next((b for b in buckets if b >= size), None)

    def context_buckets(self, capacity: int) -> tuple[int, ...]:
        """Slot counts attention reads for rows of `capacity` slots: min_context_bucket doubling, then capacity."""
        out, size = [], self.min_context_bucket
        while size < capacity:
            out.append(size)
            size *= 2
        return (*out, capacity)


def default_static_step(device: str, cuda_graphs: bool = True, graph_memory_mib: int | None = None,
                        max_rows: int | None = None, fused_ops: bool = True) -> StaticStepSettings | None:
    """The step a CachedLM on `device` runs by default: the static-shape step with CUDA graphs on a CUDA device
    (unless `cuda_graphs` is off), the model's own eager forward elsewhere (on a CPU the eager path with packed
    linears is as fast, and it grows its pool as needed). `max_rows` caps the batch buckets (a replica's
    max_sessions); `fused_ops`: the step's elementwise ops compiled into fused kernels."""
    if not cuda_graphs or not str(device).startswith("cuda"):
        return None
    batch = tuple(b for b in DEFAULT_BATCH_BUCKETS if max_rows is None or b <= max_rows) or (1,)
    if max_rows is not None and batch[-1] < min(max_rows, DEFAULT_BATCH_BUCKETS[-1]):
        batch = (*batch, min(max_rows, DEFAULT_BATCH_BUCKETS[-1]))
    memory = StaticStepSettings.graph_memory_mib if graph_memory_mib is None else graph_memory_mib
    return StaticStepSettings(batch_buckets=batch, graph_memory_mib=memory, fused_ops=fused_ops)


def static_step_bytes(settings: StaticStepSettings, context: int, layers: int, hidden: int, intermediate: int,
                      heads: int, kv_heads: int, head_dim: int, vocab: int, dtype_bytes: int) -> int:
    """Device memory the static step adds to a process (per TP rank: pass its heads and intermediate size): the
    shared input buffers (the [rows, 1, tokens, slots] mask dominates), the pool's scratch row, and the graph
    pool, which holds about one forward's activations at the largest captured bucket (graphs share one pool,
    captured largest first): its logits and features, one layer's gathered keys and values of every row, the
    MLP's and attention's intermediates."""
    rows, tokens = settings.batch_buckets[-1], settings.token_buckets[-1]
    buffers = rows * tokens * (context * dtype_bytes + 5 * 8)
    scratch = 2 * layers * kv_heads * head_dim * context * dtype_bytes
    graphed = [(b, w) for b in settings.batch_buckets for w in settings.token_buckets
               if b * w <= settings.max_graph_tokens]
    if not graphed:
        return buffers + scratch
    b, w = max(graphed, key=lambda bw: bw[0] * bw[1])
    n = b * w
    activations = n * (vocab + 4 * hidden + 3 * intermediate + (heads + 2 * kv_heads) * head_dim) * dtype_bytes
    gathered = 2 * b * kv_heads * context * head_dim * dtype_bytes
    return buffers + scratch + activations + gathered
