"""The drafter's dtype chosen by measurement: drafter dtype "auto".

The drafter only proposes: verification accepts or rejects its tokens against the target's own distribution
(and `warp_probs` turns the drafter's logits into float32 probabilities whatever dtype made them), so the
drafter's dtype changes speed, never output. The target's dtype is different: it defines the output, so it
is the user's choice and never "auto".

Which dtype is fastest depends on the machine. On a 2-core Xeon with AMX-BF16 one step of the EAGLE-3 head
takes 3.9 ms in float32 and 3.0 ms in bfloat16 (one thread, 1 node; 5.1 vs 3.1 ms at 8 nodes); on an AVX-512
CPU without bf16 units bfloat16 matmuls are slower than float32 (docs/performance.md). So "auto" times one
drafter step of a typical tree frontier in the target's dtype and in bfloat16 and keeps the faster, cached per
drafter and machine like the budget profile (engine/budget.py). The target's dtype wins near-ties: a dtype
change must pay for itself clearly to be taken.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from ..hardware.profile import machine_key, measurement_path, time_drafter_step
from .models.base import runner_forward

AUTO = "auto"
FRONTIER_NODES = 4  # nodes per drafter forward in a typical CPU tree (docs/performance.md: ~4 per step)
MIN_GAIN = 0.05  # another dtype is taken only when its step is at least 5% faster than the target dtype's


def candidate_dtypes(target_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The target's dtype first (it wins ties), then bfloat16 if that is not it."""
    return (target_dtype,) if target_dtype == torch.bfloat16 else (target_dtype, torch.bfloat16)


def fastest_dtype(load: Callable[[torch.dtype], torch.nn.Module], device: str, target_dtype: torch.dtype,
                  cache_dir: Path | None = None) -> tuple[torch.dtype, torch.nn.Module]:
    """The dtype among `candidate_dtypes(target_dtype)` whose drafter step (`FRONTIER_NODES` nodes) is fastest
    on this machine, and the drafter in it; `load(dtype)` gives the drafter in a dtype (each dtype is loaded at
    most once). Measured once per drafter and machine."""
    candidates = candidate_dtypes(target_dtype)
    loaded = {candidates[0]: load(candidates[0])}
    if len(candidates) == 1:
        return candidates[0], loaded[candidates[0]]
    key = machine_key(device, "drafter-dtype", loaded[candidates[0]].config.to_json_string(), *map(str, candidates))
    path, found = measurement_path(f"drafter-dtype-{key}.json", cache_dir)
    if found is not None:
        step_ms = json.loads(found.read_text())["step_ms"]
    else:
        loaded.update((dtype, load(dtype)) for dtype in candidates[1:])
        step_ms = {str(dtype): time_drafter_step(model, device, dtype, FRONTIER_NODES,
                                                     forward=runner_forward(model))
                   for dtype, model in loaded.items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"step_ms": step_ms, "nodes": FRONTIER_NODES}, indent=1))
    chosen = choose(candidates, step_ms)
    return chosen, loaded[chosen] if chosen in loaded else load(chosen)


def choose(candidates: tuple[torch.dtype, ...], step_ms: dict[str, float]) -> torch.dtype:
    """The fastest of `candidates` by `step_ms` (keyed by str(dtype)); the first unless another is at least
    MIN_GAIN faster."""
    best = min(candidates, key=lambda dtype: step_ms[str(dtype)])
    return best if step_ms[str(best)] <= (1 - MIN_GAIN) * step_ms[str(candidates[0])] else candidates[0]
