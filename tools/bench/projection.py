"""PROJECTED speedups on the mission's GPU layouts, from measured MAL and tree sizes and a cost model.

No machine here has 4x A100, so `treeserve bench` prints, in a table of its own titled PROJECTED, what each
measured method would give on the deployed layouts (deploy/llama2-70b-4xa100.yaml, deploy/vicuna-33b-4xa100.yaml):
the target tensor-parallel over 4 A100-80GB (NVLink), the 7B drafter on a fifth A100, the router on CPU.
Projected numbers are never put in a column of measured ones.

Inputs measured by the bench, per method: MAL (tokens per target forward), candidate tokens per step, drafter
forwards per step and tokens per drafter forward, the share of steps that drafted, the router's tree
construction + verification time per step (run on a CPU in the deployed layout too, so carried over as
measured), and the mean context length. They come from the CPU pair (SmolLM2-135M and its drafter): the
projection answers "what if the deployed pair accepted like the measured one", not what a 70B pair accepts.

Cost of one forward of a model over n new tokens on one GPU (a TP rank holds 1/tp of every decoder layer and a
replicated embedding and LM head, as engine/tp.py lays it out):

    t(n) = max(W_rank / (B * e_B), 2 * n * P_rank / (F * e_F))   weights streamed vs matmul FLOPs (roofline)
         + KV_rank(ctx) / (B * e_B)                             the KV cache read by attention
         + layers * A * (lat + 2 (tp-1)/tp * n * hidden * d / N) ring all-reduces (tp > 1 only)
         + layers * k                                           kernel launches (eager PyTorch)

A step costs, for a method: t_target(1 + candidates) + drafter forwards x t_drafter(tokens per forward) +
rpc (score call + rank dispatch, + the draft call on drafting steps) + the measured router overhead; plain
decoding costs t_target(1) + rpc + its own router overhead. Projected speedup = MAL x t_AR / t_step.

Constants (each with its source; ASSUMED ones are not measured anywhere and are the first to revisit once a
4x A100 box is available):

| name | value | source |
|---|---|---|
| B  | 2.039e12 B/s | NVIDIA A100 80GB SXM datasheet: HBM2e bandwidth 2,039 GB/s |
| F  | 312e12 FLOP/s | same datasheet: BF16 Tensor Core peak (dense) 312 TFLOPS |
| N  | 300e9 B/s | same datasheet: NVLink 600 GB/s per GPU, both directions together (300 GB/s each way) |
| e_B | 0.75 | ASSUMED: share of peak HBM bandwidth that decode-time small-M GEMMs reach |
| e_F | 0.5 | ASSUMED: share of peak Tensor Core FLOPs reached at 2-65 rows |
| A  | 2 all-reduces per layer | engine/tp.py: rowwise o_proj and down_proj each end in one (Megatron layout) |
| lat | 20e-6 s | ASSUMED: latency of one small NCCL all-reduce among 4 NVLink-connected GPUs |
| k  | 40e-6 s per layer | ASSUMED: ~10 kernels per decoder layer at ~4 us launch each, no CUDA graphs |
| rpc_call | 1e-3 s | docs/design.md section 3: a direct grpcio (aio) call costs ~1 ms (measured on the CPU box) |
| rank_dispatch | 1e-3 s | ASSUMED: the Target replica's coordinator handing a step to its 4 rank actors (Ray calls) |
| d  | 2 B | deploy/*-4xa100.yaml: dtype bfloat16 for target and drafter |
| model sizes | config.json | deploy/models/*/config.json (public Hugging Face config facts) |

Measured instead of ASSUMED: `load_layouts(cost_curve=FILE)` takes a `treeserve profile` file (schema
treeserve.costcurve/1, engine/hardware/cost_curve.py) of a layout's target preset at the layout's TP size (one rank's
shapes, random weights) and uses its batch-1 curve for that target's forward, replacing B, F, e_B, e_F and k:

    t(n) = T_measured(n) + KV_rank(ctx - prefix) / copy bandwidth (measured) + the ring all-reduces above

(T was measured at the file's prefix on one GPU without a process group, so the context's difference and the
all-reduces are added; the drafter keeps the cost model). `cost_source(layout)` says which one a layout used:
"measured cost curve FILE (device)" or "ASSUMED efficiencies". A measured target costs what it cost on the
device that measured it: an A100 figure only when the file was measured on an A100.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from treeserve.engine.hardware.cost_curve import CostCurve
from treeserve.engine.hardware.profile_model import MODELS_DIR

HBM_BYTES_S = 2.039e12
BF16_FLOPS = 312e12
NVLINK_BYTES_S = 300e9
HBM_EFFICIENCY = 0.75
FLOPS_EFFICIENCY = 0.5
ALLREDUCES_PER_LAYER = 2
ALLREDUCE_LATENCY_S = 20e-6
LAUNCH_S_PER_LAYER = 40e-6
RPC_S = 1e-3
RANK_DISPATCH_S = 1e-3
DTYPE_BYTES = 2
CURVE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # a measured curve's KV element size
DEPLOYED_TP = 4  # the target's tensor-parallel size in every deployed layout
# (layout, target preset, drafter preset) of the deployed layouts (deploy/*-4xa100.yaml)
DEPLOYED = (("Llama-2-70B 4xA100", "Llama-2-70b-hf", "Llama-2-7b-hf"),
            ("Vicuna-33B 4xA100", "vicuna-33b-v1.3", "vicuna-7b-v1.3"))


@dataclass(frozen=True)
class ModelSize:
    """The sizes a forward's cost depends on (from a config.json)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, data: dict) -> "ModelSize":
        heads = data["num_attention_heads"]
        return cls(hidden=data["hidden_size"], layers=data["num_hidden_layers"], heads=heads,
                   kv_heads=data.get("num_key_value_heads") or heads,
                   head_dim=data.get("head_dim") or data["hidden_size"] // heads,
                   intermediate=data["intermediate_size"], vocab=data["vocab_size"])

    @property
    def layer_params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o + k, v
        return attention + 3 * self.hidden * self.intermediate  # gate, up, down

    def rank_params(self, tp: int) -> int:
        """Parameters one rank multiplies per token: its share of the layers plus the replicated LM head."""
        return self.layers * self.layer_params // tp + self.vocab * self.hidden


@dataclass(frozen=True)
class Layout:
    name: str
    target: ModelSize
    drafter: ModelSize
    tp: int = 4
    target_curve: CostCurve | None = None  # a measured forward of one target rank (None: the cost model)
    curve_path: str = ""  # the file it came from


def cost_source(layout: Layout) -> str:
    """Which target forward time `layout` projects with: the measured curve or the ASSUMED efficiencies."""
    if layout.target_curve is None:
        return "ASSUMED efficiencies"
    return f"measured cost curve {layout.curve_path} ({layout.target_curve.device})"


def _allreduce_s(model: ModelSize, n_tokens: int, tp: int) -> float:
    """Seconds of a forward's ring all-reduces among `tp` ranks (none for one rank)."""
    if tp == 1:
        return 0.0
    ring = 2 * (tp - 1) / tp * n_tokens * model.hidden * DTYPE_BYTES / NVLINK_BYTES_S
    return model.layers * ALLREDUCES_PER_LAYER * (ALLREDUCE_LATENCY_S + ring)


def forward_s(model: ModelSize, n_tokens: int, context: float, tp: int = 1) -> float:
    """Seconds of one forward over `n_tokens` new tokens after `context` cached ones, per the module's model."""
    params = model.rank_params(tp)
    weights = params * DTYPE_BYTES / (HBM_BYTES_S * HBM_EFFICIENCY)
    flops = 2 * n_tokens * params / (BF16_FLOPS * FLOPS_EFFICIENCY)
    kv_bytes = 2 * model.layers * (model.kv_heads / tp) * model.head_dim * DTYPE_BYTES * (context + n_tokens)
    t = max(weights, flops) + kv_bytes / (HBM_BYTES_S * HBM_EFFICIENCY) + model.layers * LAUNCH_S_PER_LAYER
    return t + _allreduce_s(model, n_tokens, tp)


def target_forward_s(layout: Layout, n_tokens: int, context: float) -> float:
    """Seconds of one target forward on `layout`: its measured curve when it has one, else `forward_s`."""
    curve = layout.target_curve
    if curve is None:
        return forward_s(layout.target, n_tokens, context, layout.tp)
    model = layout.target
    kv_per_token = 2 * model.layers * (model.kv_heads / layout.tp) * model.head_dim * CURVE_DTYPE_BYTES[curve.dtype]
    return (curve.time_ms(n_tokens) / 1e3 + kv_per_token * (context - curve.prefix) / curve.copy_bytes_s
            + _allreduce_s(model, n_tokens, layout.tp))


def load_layouts(models_dir: Path = MODELS_DIR, cost_curve: str | Path | None = None) -> list[Layout]:
    """The two deployed layouts (deploy/*-4xa100.yaml), sizes from their config.json facts; with `cost_curve`,
    the layout whose target preset and TP size the file measured projects with it (ValueError if none did)."""
    def size(name: str) -> ModelSize:
        return ModelSize.from_config(json.loads((models_dir / name / "config.json").read_text()))

    curve = None if cost_curve is None else CostCurve.load(cost_curve)
    layouts = []
    for name, target, drafter in DEPLOYED:
        ours = curve is not None and curve.model.source == "preset" and curve.model.name == target \
            and curve.model.tp_size == DEPLOYED_TP
        layouts.append(Layout(name, size(target), size(drafter), DEPLOYED_TP, curve if ours else None,
                              str(cost_curve) if ours else ""))
    if curve is not None and not any(lay.target_curve for lay in layouts):
        raise ValueError(f"cost curve {cost_curve} measured {curve.model.describe()}; the deployed layouts need "
                         "one of " + ", ".join(f"--preset {t} --tp-size {DEPLOYED_TP}" for _, t, _ in DEPLOYED))
    return layouts


@dataclass(frozen=True)
class Measured:
    """What the bench measured for one method (per step means over all its timed runs)."""

    mal: float
    candidates: float
    drafter_forwards: float = 0.0
    drafter_tokens_per_forward: float = 1.0
    drafted_share: float = 0.0  # share of steps that called the drafter
    router_ms: float = 0.0  # tree construction + verification per step (CPU, carried over)


def step_s(layout: Layout, m: Measured, context: float) -> float:
    t = target_forward_s(layout, max(1, round(1 + m.candidates)), context) + RPC_S + RANK_DISPATCH_S
    if m.drafter_forwards:
        tokens = max(1, round(m.drafter_tokens_per_forward))
        t += m.drafter_forwards * forward_s(layout.drafter, tokens, context) + m.drafted_share * RPC_S
    return t + m.router_ms / 1e3


def projected_speedup(layout: Layout, method: Measured, plain: Measured, context: float) -> float:
    """MAL x t(plain step) / t(method step): the method's tokens/s over plain decoding on `layout`."""
    return method.mal * step_s(layout, plain, context) / step_s(layout, method, context)
