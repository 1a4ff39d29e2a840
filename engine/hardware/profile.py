"""What a step costs on this machine: the target's forward against tree size (and batch rows) and one drafter
step, measured at start-up and cached per model and machine (`$TREESERVE_CACHE/profiles/`), or the target's
curve read from a `treeserve profile` file (engine/hardware/cost_curve.py). The budget chooser (engine/budget.py)
prices budgets with it.

Batched steps are priced by the batch they are in: `batch_target_ms[rows][nodes]` is the target forward of
`rows` sequences each feeding `nodes` tokens (a chain of nodes - 1 drafts after the root), measured at a few
row counts and chain lengths; `batch_drafter_ms[rows]` one drafter forward of `rows` one-node rows. Between
measured row counts the cost is interpolated linearly in rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..devices import device_name
from ..models.attention import GROUPED_ATTENTION
from ..models.packed_linear import LAYOUT_VERSION
from ..models.paths import cache_root
from ..runners.cached_lm import CachedLM, DrafterForward, ExtendRequest
from ..runners.step_settings import StaticStepSettings
from .cost_curve import CostCurve, interpolate_ms

PROFILE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


# Row counts and chain lengths (root included) of the measured batched curve: the batch-size buckets of
# batched C2T chains (engine/drafters/base.py) and chains up to their default depth 6.
BATCH_PROFILE_ROWS = (2, 4, 8, 16)
BATCH_PROFILE_NODES = (1, 2, 4, 7)
PROFILE_VERSION = "batch-1"  # bumped when a cached profile's contents change
# Measurements of known machines shipped with the code (named as in the cache): a first start on such a machine
# (the same model, step, dtype, core count, torch and layout: `machine_key`) serves at once instead of measuring
# for tens of seconds first. The cache's own measurement, once there is one, wins.
KNOWN_PROFILES = Path(__file__).resolve().parent / "known_profiles"


def measurement_path(name: str, cache_dir: Path | None = None) -> tuple[Path, Path | None]:
    """(where a measurement called `name` is cached, the file to read it from: the cache's, else a known
    machine's, else None: measure it)."""
    cached = (cache_dir or cache_root() / "profiles") / name
    if cached.is_file():
        return cached, cached
    known = KNOWN_PROFILES / name
    return cached, known if cache_dir is None and known.is_file() else None


@dataclass
class HardwareProfile:
    """Measured costs on this machine."""

    target_ms: dict[int, float]  # tree nodes fed (root included) -> target forward ms at the reference prefix
    drafter_step_ms: float  # one drafter forward for one node
    prefix_tokens: int  # context length the times were measured at
    # rows -> nodes per row -> target forward ms of that many rows (each at the reference prefix); empty: unmeasured
    batch_target_ms: dict[int, dict[int, float]] = field(default_factory=dict)
    batch_drafter_ms: dict[int, float] = field(default_factory=dict)  # rows -> one drafter forward of 1 node each

    def target_time_ms(self, nodes: float, rows: int = 1) -> float:
        """Target forward ms of `rows` rows of `nodes` tokens each: the batch-1 curve interpolated in nodes, the
        measured batched curves interpolated in nodes and linearly in rows (extended past the largest); without
        batched measurements, the batch-1 curve at rows x nodes tokens."""
        if rows <= 1:
            return interpolate_ms(self.target_ms, nodes)
        if not self.batch_target_ms:
            return interpolate_ms(self.target_ms, rows * nodes)
        curves = {1: self.target_ms, **self.batch_target_ms}
        return interpolate_ms({r: interpolate_ms(c, nodes) for r, c in curves.items()}, rows)

    def drafter_time_ms(self, rows: int = 1) -> float:
        """One drafter forward of `rows` one-node rows (the batch-1 step where batches were not measured)."""
        if rows <= 1 or not self.batch_drafter_ms:
            return self.drafter_step_ms
        return interpolate_ms({1: self.drafter_step_ms, **self.batch_drafter_ms}, rows)

    @property
    def mu(self) -> float:
        """OPT-Tree's mu: drafter step time over target step time."""
        return self.drafter_step_ms / self.target_ms[min(self.target_ms)]

    def opt_tree_delta(self) -> float:
        """OPT-Tree's delta: a drafter step must buy at least mu expected tokens (paper: mu <= delta < 1)."""
        return min(0.9, max(self.mu, 1e-3))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict) -> "HardwareProfile":
        return cls({int(k): v for k, v in raw["target_ms"].items()}, raw["drafter_step_ms"], raw["prefix_tokens"],
                   {int(r): {int(n): ms for n, ms in c.items()} for r, c in raw.get("batch_target_ms", {}).items()},
                   {int(r): ms for r, ms in raw.get("batch_drafter_ms", {}).items()})


@torch.inference_mode()
def _time_batch(lm: CachedLM, context: list[int], rows: int, nodes: int, repeats: int) -> float:
    """Median ms of one forward of `rows` sessions (same context) each feeding a chain of `nodes` tokens."""
    ids = [f"profile-{r}" for r in range(rows)]
    times = []
    for _ in range(repeats + 1):
        for session in ids:
            lm.begin(session, context)
        start = time.perf_counter()
        lm.extend([ExtendRequest(s, [context[-1]] + [7] * (nodes - 1), [-1] + list(range(nodes - 1))) for s in ids])
        if lm.device.type == "cuda":
            torch.cuda.synchronize(lm.device)
        times.append(time.perf_counter() - start)
    for session in ids:
        lm.release(session)
    return 1e3 * sorted(times[1:])[len(times[1:]) // 2]


@torch.inference_mode()
def _time_extend(lm: CachedLM, context: list[int], nodes: int, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        lm.begin("profile", context)
        start = time.perf_counter()
        lm.extend([ExtendRequest("profile", [context[-1]] + [7] * (nodes - 1), [-1] + list(range(nodes - 1)))])
        if lm.device.type == "cuda":  # kernels run asynchronously: time their end, not their launch
            torch.cuda.synchronize(lm.device)
        times.append(time.perf_counter() - start)
    lm.release("profile")
    return 1e3 * sorted(times[1:])[len(times[1:]) // 2]  # median, first run is warm-up


def machine_key(device: str, *parts: str) -> str:
    """A short hash of `parts` and this machine (CPU, cores, torch threads and version, the GPU's name): the
    name of a measurement cached per machine."""
    parts = [*parts, device, platform.machine(), platform.processor(), str(os.cpu_count()),
             str(torch.get_num_threads()), torch.__version__, LAYOUT_VERSION, GROUPED_ATTENTION]
    if device.startswith("cuda"):
        parts.append(torch.cuda.get_device_name(torch.device(device)))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _profile_key(target: torch.nn.Module, drafter: torch.nn.Module | None, device: str, dtype,
                 drafter_dtype, static: StaticStepSettings | None) -> str:
    return machine_key(device, target.config.to_json_string(),
                       "" if drafter is None else drafter.config.to_json_string(),
                       str(sum(p.numel() for p in target.parameters())), str(dtype), str(drafter_dtype),
                       repr(static), PROFILE_VERSION)


def time_drafter_step(drafter: torch.nn.Module, device: str, dtype: torch.dtype, nodes: int = 1,
                      prefix_tokens: int = 128, repeats: int = 20, static: StaticStepSettings | None = None,
                      rows: int = 1, forward: DrafterForward | None = None) -> float:
    """Median ms of one drafter forward over `rows` rows of `nodes` tree nodes after a `prefix_tokens` context,
    on the step the drafter runs (`static`: the static-shape step). A drafter step is a few ms, so one stall of
    this shared VM skews a short median (seen: 15.6 ms for a 5 ms step): many repeats, which cost little."""
    context = [11 + (i % 97) for i in range(prefix_tokens + 1)]
    return _time_batch(CachedLM(drafter, device, dtype, static=static, drafter=forward), context, rows, nodes, repeats)


def profile_from_cost_curve(paths: str | Path | list[str | Path], drafter_step_ms: float,
                            prefix_tokens: int | None = None) -> HardwareProfile:
    """A profile whose target curves are a `treeserve profile` file's (engine/hardware/cost_curve.py: batch 1 and
    any batch sizes it measured), with the drafter step measured by the caller. Of several files (one per
    prefix), the one measured at the prefix nearest `prefix_tokens` (default: the first file)."""
    curves = [CostCurve.load(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    wanted = prefix_tokens if prefix_tokens is not None else curves[0].prefix if curves else 0
    curve = min(curves, key=lambda c: abs(c.prefix - wanted))  # no file at all: ValueError (empty sequence)
    return _from_curve(curve, drafter_step_ms)


def _from_curve(curve: CostCurve, drafter_step_ms: float) -> HardwareProfile:
    batches = {b: curve.target_ms(b) for b in curve.curves if b > 1}
    return HardwareProfile(curve.target_ms(1), drafter_step_ms, curve.prefix, batches)


def _checked_cost_curve(path: str, target: torch.nn.Module, device: str, dtype: torch.dtype) -> CostCurve:
    """The file's curve; ValueError unless it measured this device, dtype and (unless one TP rank) size of model."""
    curve = CostCurve.load(path)
    checks = [("device", curve.device, device_name(device)), ("dtype", curve.dtype, str(dtype).removeprefix("torch."))]
    if curve.model.tp_size == 1:
        params = sum(p.numel() for p in {id(p): p for p in target.parameters()}.values())  # ties counted once
        checks.append(("params", curve.model.params, params))
    if 1 not in curve.curves:
        checks.append(("batch sizes", sorted(curve.curves), "1 needed"))
    found = [f"{what} {theirs} (here {ours})" for what, theirs, ours in checks if theirs != ours]
    if found:
        raise ValueError(f"cost curve {path} was measured for another setup: {', '.join(found)}")
    return curve


def measure_profile(target: torch.nn.Module, drafter: torch.nn.Module | None, device: str = "cpu",
                    dtype: torch.dtype = torch.float32, prefix_tokens: int = 128, repeats: int = 5,
                    cache_dir: Path | None = None, drafter_dtype: torch.dtype | None = None,
                    cost_curve: str | None = None, static: StaticStepSettings | None = None,
                    drafter_forward: DrafterForward | None = None) -> HardwareProfile:
    """Time target forwards of PROFILE_SIZES tree nodes (in `dtype`), of BATCH_PROFILE_ROWS rows x
    BATCH_PROFILE_NODES chains, and drafter steps of 1 and those rows (in `drafter_dtype`, default `dtype`), on
    the step the models run (`static`: the static-shape step, CUDA graphs on a GPU); medians, cached per model,
    step and machine. With `cost_curve` (a `treeserve profile` file of this target, device and dtype) the target
    curves are read from it and only the drafter is timed, at the file's prefix. `drafter_forward`: how the
    drafter's forward differs from a causal LM's (`DrafterModel.runner_forward`; None: it is one)."""
    drafter_dtype = drafter_dtype or dtype
    if cost_curve is not None:
        curve = _checked_cost_curve(cost_curve, target, device, dtype)
        profile = _from_curve(curve, 0.0)
        _time_drafter(profile, drafter, drafter_forward, device, drafter_dtype, curve.prefix, repeats, static)
        return profile
    key = _profile_key(target, drafter, device, dtype, drafter_dtype, static)
    path, found = measurement_path(f"{key}.json", cache_dir)
    if found is not None:
        return HardwareProfile.from_json(json.loads(found.read_text()))
    context = [11 + (i % 97) for i in range(prefix_tokens + 1)]
    lm = CachedLM(target, device, dtype, static=static)
    profile = HardwareProfile({n: _time_extend(lm, context, n, repeats) for n in PROFILE_SIZES}, 0.0, prefix_tokens,
                              {rows: {n: _time_batch(lm, context, rows, n, repeats) for n in BATCH_PROFILE_NODES}
                               for rows in BATCH_PROFILE_ROWS})
    _time_drafter(profile, drafter, drafter_forward, device, drafter_dtype, prefix_tokens, repeats, static)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_json(), indent=1))
    return profile


def _time_drafter(profile: HardwareProfile, drafter: torch.nn.Module | None, forward: DrafterForward | None,
                  device: str, dtype: torch.dtype,
                  prefix: int, repeats: int, static: StaticStepSettings | None) -> None:
    """Fill the profile's drafter step times (1 row, and BATCH_PROFILE_ROWS rows); none without a drafter."""
    if drafter is None:
        return
    profile.drafter_step_ms = time_drafter_step(drafter, device, dtype, 1, prefix, 4 * repeats, static, forward=forward)
    profile.batch_drafter_ms = {rows: time_drafter_step(drafter, device, dtype, 1, prefix, repeats, static, rows, forward)
                                for rows in BATCH_PROFILE_ROWS}
