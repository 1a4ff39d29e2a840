"""A measured cost curve: T(n nodes, batch), the time of one tree forward, and the bounds beside it.

`treeserve profile` (cli/profile.py) measures it (engine/hardware/cost_measure.py) and writes it as JSON; the
budget chooser (engine/budget.py `profile_from_cost_curve`) and the PROJECTED table (tools/bench/projection.py)
read it instead of ASSUMED efficiencies. This module is the file's schema only: torch-free, so readers that
never run a model (the projection) load it without importing torch.

The file (schema "treeserve.costcurve/1") holds, besides the curves {batch: {nodes: ms}}:

- the device (its name), torch version, dtype, step mode (eager / static), prefix (context tokens before the
  tree), repeats and threads, and the command line;
- the model: a preset's config facts or a model directory, the tensor-parallel size and the shapes of the one
  rank measured, its parameters and the bytes of weights one forward reads;
- two measured device facts and the bounds made from them: the weight-streaming bound (weight bytes over the
  measured copy bandwidth: no forward can read its weights faster) and the FLOP bound (2 x params x tokens over
  the measured matmul peak of the dtype).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA = "treeserve.costcurve/1"


def interpolate_ms(curve: dict[int, float], nodes: float) -> float:
    """Linear interpolation of a {nodes: ms} curve, clamped below its first size and extended past its last
    along its last segment (a one-point curve is constant)."""
    sizes = sorted(curve)
    if nodes <= sizes[0]:
        return curve[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:]):
        if nodes <= hi:
            w = (nodes - lo) / (hi - lo)
            return curve[lo] * (1 - w) + curve[hi] * w
    if len(sizes) == 1:
        return curve[sizes[0]]
    last, prev = sizes[-1], sizes[-2]
    slope = (curve[last] - curve[prev]) / (last - prev)
    return curve[last] + slope * (nodes - last)


@dataclass(frozen=True)
class ModelFacts:
    """What was measured: which model, which tensor-parallel rank shapes, how many weights one forward reads."""

    source: str  # "preset" (config facts, random weights) or "directory" (a model directory's weights)
    name: str  # the preset's name or the model directory's path
    tp_size: int  # tensor-parallel size the shapes are one rank of (1: the whole model)
    # shapes of the rank measured: hidden, layers, heads, kv_heads, head_dim, intermediate, vocab
    rank_shapes: dict[str, int]
    params: int  # parameters of the model measured (one rank's under tp_size > 1)
    # parameters a forward multiplies per token: all but an untied input embedding (a lookup, not a matmul)
    matmul_params: int
    weight_bytes: int  # bytes of weights one forward reads: the matmul parameters in their dtype

    def describe(self) -> str:
        """One line: what the curve is of."""
        what = f"preset {self.name}" if self.source == "preset" else f"model {self.name}"
        rank = f", one rank of tp {self.tp_size}" if self.tp_size > 1 else ""
        params = f"{self.params / 1e9:.2f}B" if self.params >= 1e9 else f"{self.params / 1e6:.1f}M"
        gib = self.weight_bytes >= 2**30
        read = f"{self.weight_bytes / 2**30:.2f} GiB" if gib else f"{self.weight_bytes / 2**20:.1f} MiB"
        return f"{what}{rank}: {params} params, {read} of weights read per forward"


@dataclass
class CostCurve:
    """One `treeserve profile` run: the measured curves, the device facts and the bounds (see the module doc)."""

    device: str  # "cpu" or the GPU's name: timings compare only on one kind of device
    torch_version: str  # torch.__version__ of the run
    dtype: str  # weights and activations: float32, bfloat16 or float16
    model: ModelFacts  # what was measured
    copy_bytes_s: float  # measured copy bandwidth, read + write bytes per second (2 x bytes / time)
    copy_bytes: int  # size of the tensor the copy bandwidth was measured with
    matmul_flops_s: float  # measured matmul peak of `dtype` (2 x size^3 per matmul over its time)
    matmul_size: int  # side of the square matmul the peak was measured with
    prefix: int  # context tokens cached before the tree (the KV each forward's attention reads)
    step: str  # "eager" (the model's own modules) or "static" (CachedLM's static-shape step)
    cuda_graphs: bool  # with step "static" on CUDA: whether the buckets ran as captured CUDA graphs
    repeats: int  # timed forwards per point (after one warm-up), their median is the point
    threads: int  # torch CPU threads
    curves: dict[int, dict[int, float]]  # batch -> nodes -> median ms of one forward of batch x nodes
    command: list[str] = field(default_factory=list)  # the command line that measured it
    schema: str = SCHEMA  # file format version

    # ------------------------------------------------------------------ bounds
    @property
    def weight_stream_ms(self) -> float:
        """ms to stream the weights once at the measured copy bandwidth: a forward's floor at any size."""
        return 1e3 * self.model.weight_bytes / self.copy_bytes_s

    def flop_ms(self, batch: int, nodes: int) -> float:
        """ms of the forward's matmul FLOPs (2 x params x tokens) at the measured matmul peak."""
        return 1e3 * 2 * self.model.matmul_params * batch * nodes / self.matmul_flops_s

    def bound_ms(self, batch: int, nodes: int) -> float:
        """The larger of the two bounds (a roofline; the attention over the prefix is not counted)."""
        return max(self.weight_stream_ms, self.flop_ms(batch, nodes))

    def bounds(self) -> dict:
        """The bounds as written to the file."""
        return {"weight_stream_ms": self.weight_stream_ms,
                "flop_ms": {b: {n: self.flop_ms(b, n) for n in curve} for b, curve in self.curves.items()},
                "bound_ms": {b: {n: self.bound_ms(b, n) for n in curve} for b, curve in self.curves.items()}}

    # ------------------------------------------------------------------ reading the curve
    def target_ms(self, batch: int = 1) -> dict[int, float]:
        """The {nodes: ms} curve of one batch size (ValueError if it was not measured)."""
        if batch not in self.curves:
            raise ValueError(f"the cost curve has no batch {batch} (measured: {sorted(self.curves)})")
        return dict(self.curves[batch])

    def time_ms(self, nodes: float, batch: int = 1) -> float:
        """T(nodes) at `batch`, interpolated between the measured node counts."""
        return interpolate_ms(self.target_ms(batch), nodes)

    # ------------------------------------------------------------------ the file
    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        return {"schema": self.schema, **{k: v for k, v in data.items() if k != "schema"},
                "bounds": self.bounds()}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "CostCurve":
        """Read a cost-curve file (ValueError for another schema or a missing field)."""
        path = Path(path)
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{path} is not a cost curve of schema {SCHEMA} (found {found!r})")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(n for n in names - set(data) if n != "command")
        if missing:
            raise ValueError(f"{path}: cost curve without {', '.join(missing)}")
        values = {k: v for k, v in data.items() if k in names}
        values["model"] = ModelFacts(**values["model"])
        values["curves"] = {int(b): {int(n): float(ms) for n, ms in curve.items()}
                            for b, curve in values["curves"].items()}
        return cls(**values)
