"""Measuring a cost curve (engine/hardware/cost_curve.py): the device's copy bandwidth and matmul peak, then
T(n nodes, batch) through TreeServe's own `CachedLM.extend`.

A point is timed as engine/budget.py `_time_extend` times the budget chooser's curve: every session holds a
PREFIX-token context, the forward feeds a chain of n tree nodes per session (batch sessions in one forward),
CUDA is synchronised before the clock stops (kernels run asynchronously), and the point is the median of
`repeats` forwards after one untimed warm-up (the first forward of a shape allocates, packs CPU weights or
captures CUDA graphs). The prefill of the context runs once per batch size, untimed; between forwards each
session's tree is dropped back to its context by `CachedLM.begin` (no node accepted), as in a decoding step
that accepts nothing.

The two device facts are measured, not taken from a datasheet, and are the best of a few runs (a bound is what
the device can do, not what it usually does):

- copy bandwidth: one large tensor copied on the device (a few GiB on CUDA, 256 MiB on a CPU), counting the
  bytes read and written: 2 x bytes / time. A forward that reads its weights once cannot beat weight bytes
  over this;
- matmul peak: a large square matmul in the dtype, 2 x size^3 FLOPs over its time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..devices import device_name
from ..runners.cached_lm import CachedLM, ExtendRequest
from ..runners.step_settings import StaticStepSettings
from .cost_curve import CostCurve, ModelFacts

DEFAULT_NODES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_BATCHES = (1,)
STEP_MODES = ("eager", "static")
CUDA_COPY_BYTES = 2 << 30  # 2 GiB copied (4 GiB read + written): long enough that launch costs vanish
CPU_COPY_BYTES = 256 << 20  # 256 MiB: well past any CPU cache
CUDA_MATMUL_SIZE = 8192
CPU_MATMUL_SIZE = 1024
CHAIN_TOKEN = 7  # the token of every non-root node (the time does not depend on which)


@dataclass(frozen=True)
class DeviceFacts:
    """The two measured rates the bounds are made of."""

    copy_bytes_s: float  # read + write bytes per second of one large on-device copy
    copy_bytes: int  # size of the tensor copied
    matmul_flops_s: float  # FLOP/s of one large square matmul in the dtype
    matmul_size: int  # its side


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: time their end, not their launch
        torch.cuda.synchronize(device)


def _best_seconds(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Fastest of `repeats` timed calls of `run`, after one untimed one."""
    run()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def measure_device(device: str, dtype: torch.dtype, repeats: int = 5, copy_bytes: int | None = None,
                   matmul_size: int | None = None) -> DeviceFacts:
    """Copy bandwidth and matmul peak of `device` (in `dtype`); run before the model is built, so the copy's
    buffers fit beside nothing and are freed again."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    nbytes = copy_bytes or (CUDA_COPY_BYTES if cuda else CPU_COPY_BYTES)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), dev, repeats)
    del src, dst
    size = matmul_size or (CUDA_MATMUL_SIZE if cuda else CPU_MATMUL_SIZE)
    a = torch.randn(size, size, device=dev).to(dtype)
    b = torch.randn(size, size, device=dev).to(dtype)
    out = torch.empty(size, size, device=dev, dtype=dtype)
    matmul_s = _best_seconds(lambda: torch.matmul(a, b, out=out), dev, repeats)
    del a, b, out
    if cuda:
        torch.cuda.empty_cache()
    return DeviceFacts(copy_bytes_s=2 * nbytes / copy_s, copy_bytes=nbytes,
                       matmul_flops_s=2 * size ** 3 / matmul_s, matmul_size=size)


def chain_request(session: str, root: int, nodes: int) -> ExtendRequest:
    """A chain of `nodes` tree nodes (the root, then CHAIN_TOKEN each child of the previous)."""
    return ExtendRequest(session, [root] + [CHAIN_TOKEN] * (nodes - 1), [-1] + list(range(nodes - 1)))


@torch.inference_mode()
def time_curve(lm: CachedLM, context: list[int], nodes: tuple[int, ...], batch: int, repeats: int) -> dict[int, float]:
    """{n: median ms of one forward of `batch` sessions x an n-node chain} after `context` (see the module doc)."""
    sessions = [f"profile-{i}" for i in range(batch)]
    try:
        for s in sessions:  # the prefill, untimed
            lm.begin(s, context)
        lm.extend([chain_request(s, context[-1], 1) for s in sessions])
        curve = {}
        for n in nodes:
            times = []
            for _ in range(repeats + 1):
                for s in sessions:
                    lm.begin(s, context)  # the previous tree accepted nothing: back to the context
                requests = [chain_request(s, context[-1], n) for s in sessions]
                start = time.perf_counter()
                lm.extend(requests)
                _sync(lm.device)
                times.append(time.perf_counter() - start)
            curve[n] = 1e3 * statistics.median(times[1:])  # the first forward of a shape is a warm-up
        return curve
    finally:
        for s in sessions:
            lm.release(s)


def cached_lm(model: torch.nn.Module, device: str, dtype: torch.dtype, sessions: int, context_tokens: int,
              static: StaticStepSettings | None) -> CachedLM:
    """The CachedLM the curve is measured through: a bounded pool of `sessions` rows x `context_tokens` slots
    (allocated in full before timing, as a server's), the static-shape step when `static` is given (ValueError
    when the model cannot run it: the curve would silently be the eager one)."""
    lm = CachedLM(model, device, dtype, max_sessions=sessions, max_context_tokens=context_tokens, static=static)
    if static is not None and lm.static_settings is None:
        raise ValueError(f"--step static: this model cannot run the static-shape step ({lm.static_reason})")
    return lm


def measure_cost_curve(model: torch.nn.Module, facts: ModelFacts, device: str, dtype: torch.dtype,
                       device_facts: DeviceFacts, nodes: tuple[int, ...] = DEFAULT_NODES,
                       batches: tuple[int, ...] = DEFAULT_BATCHES, prefix: int = 512, repeats: int = 5,
                       static: StaticStepSettings | None = None, command: list[str] | None = None,
                       log: Callable[[str], None] | None = None) -> CostCurve:
    """T(n, batch) of `model` for every node count and batch size -> the CostCurve (bounds from
    `device_facts`, measured by `measure_device` before the model was built)."""
    nodes, batches = tuple(sorted(set(nodes))), tuple(sorted(set(batches)))
    if not nodes or nodes[0] < 1 or not batches or batches[0] < 1:
        raise ValueError("--nodes and --batch must be positive integers")
    if prefix < 0 or repeats < 1:
        raise ValueError("--prefix must be >= 0 and --repeats >= 1")
    vocab = facts.rank_shapes["vocab"]
    context = [(11 + i % 97) % vocab for i in range(prefix + 1)]  # the last one is the root
    lm = cached_lm(model, device, dtype, max(batches), prefix + 1 + nodes[-1], static)
    curves = {}
    for batch in batches:
        curves[batch] = time_curve(lm, context, nodes, batch, repeats)
        if log is not None:
            log(f"batch {batch}: " + ", ".join(f"T({n}) {ms:.2f} ms" for n, ms in curves[batch].items()))
    graphs = static is not None and static.cuda_graphs and lm.device.type == "cuda"
    return CostCurve(device=device_name(device), torch_version=torch.__version__,
                     dtype=str(dtype).removeprefix("torch."), model=facts, copy_bytes_s=device_facts.copy_bytes_s,
                     copy_bytes=device_facts.copy_bytes, matmul_flops_s=device_facts.matmul_flops_s,
                     matmul_size=device_facts.matmul_size, prefix=prefix, step="eager" if static is None else "static",
                     cuda_graphs=graphs, repeats=repeats, threads=torch.get_num_threads(), curves=curves,
                     command=list(command or []))
