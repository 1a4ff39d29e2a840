"""What one `treeserve bench` run measures: `BenchOptions`, filled by the command line (cli/bench.py) or by a
caller of `tools.bench.run.run_bench`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from treeserve.engine.dev_prompts import DEV_PROMPTS
from treeserve.engine.devices import check_device
from treeserve.engine.drafters.registry import DEFAULT_DRAFTER  # torch-free
from treeserve.engine.hardware.cost_curve import CostCurve  # torch-free

DEFAULT_METHODS = ("autoregressive", "chain:4", "static:60", "eagle2:32", "dyspec:32", "dyspec_threshold:32",
                   "opt_tree:32", "c2t:32", "dyspec:auto", "opt_tree:auto", "c2t:auto", "lookup:auto",
                   "c2t+lookup:auto")
SWEEP_METHODS = ("eagle2", "dyspec", "opt_tree", "c2t")
SWEEP_BUDGETS = (8, 16, 32, 64)
# Peer sets (tools/bench/peers.py): "hf" runs all three; each may also be named alone (a run that needs only
# prompt lookup saves the others' minutes).
PEER_SETS = {"hf": ("hf-generate", "hf-pld", "hf-assisted"), "hf-generate": ("hf-generate",), "hf-pld": ("hf-pld",),
             "hf-assisted": ("hf-assisted",), "hf-compiled": ("hf-compiled",)}

@dataclass
class BenchOptions:
    """Prompts, methods, peers and outputs of one bench run (each field: the `treeserve bench` option of the
    same name)."""

    # Spec-Bench-format jsonl; the vendored dev questions by default.
    prompts: Path = DEV_PROMPTS
    num_prompts: int = 24  # prompts used, balanced over categories
    max_new_tokens: int = 64  # tokens generated per prompt
    # METHOD[:BUDGET][@KIND] entries (runner.parse_entry); "autoregressive" is the speedup baseline.
    methods: tuple[str, ...] = DEFAULT_METHODS
    target: str = "default"  # target model: 'default', a directory or a .gguf
    drafter: str = DEFAULT_DRAFTER  # drafter of autoregressive-kind entries: a shipped name or a directory
    drafter_dtype: str = "auto"  # drafters' dtype (float32, bfloat16, float16, auto); the target runs in float32
    parallel_drafter: str = "parallel"  # drafter of METHOD@parallel entries
    # Drafter kind of entries without '@KIND': "autoregressive", "parallel" or "both" (each entry with both).
    drafter_kind: str = "autoregressive"
    temperature: float = 0.0  # sampling temperature (0 = greedy)
    answers_dir: Path | None = None  # one Spec-Bench answer file per method here
    json_out: Path | None = None  # the run as JSON here
    threads: int = 2  # torch CPU threads
    device: str = "cpu"  # torch device of the target, the drafters and the peers ("cpu", "cuda", "cuda:1")
    cuda_graphs: bool = True  # on CUDA: the target's static-shape step replayed as CUDA graphs (else eager)
    fused_ops: bool = True  # with cuda_graphs on CUDA: that step's norms, rotation and SiLU as compiled fused kernels
    repeats: int = 1  # timed runs of every (prompt, method), interleaved; the run of median wall time counts
    warmup_prompts: int = 2  # untimed prompts per method first (hardware-aware budgets finish exploring)
    check_greedy: bool = False  # compare every method's tokens with the target's own greedy `generate`
    peers: tuple[str, ...] = ()  # peer sets (peers.PEER_SETS): "hf"
    peer_drafter: str = "distilled"  # drafter of HF assisted generation
    plot: Path | None = None  # PNG pictures here (runs the budget sweep)
    sweep: bool = False  # run the untimed budget sweep (also run by `plot`)
    sweep_methods: tuple[str, ...] = SWEEP_METHODS  # tree builders of the budget sweep
    sweep_budgets: tuple[int, ...] = SWEEP_BUDGETS  # fixed budgets of the budget sweep
    sweep_prompts: int = 10  # prompts of the budget sweep (balanced over categories)
    projection: bool = True  # print the PROJECTED speedups on the 4xA100 layouts (projection.py)
    # a `treeserve profile` JSON: the PROJECTED table's target forward time for the layout it measured (else the
    # ASSUMED efficiencies), and the budget chooser's target curve when it measured this device and model
    cost_curve: Path | None = None

    def validate(self) -> None:
        """ValueError naming the option for a run that cannot be measured."""
        if self.max_new_tokens < 1 or self.num_prompts < 1:
            raise ValueError("--max-new-tokens and --num-prompts must be >= 1")
        if self.warmup_prompts < 0:
            raise ValueError("--warmup-prompts must be >= 0")
        if self.repeats < 1:
            raise ValueError("--repeats must be >= 1")
        if self.check_greedy and self.temperature != 0:
            raise ValueError("--check-greedy needs --temperature 0")
        if self.peers and self.temperature != 0:
            raise ValueError("--peers run greedy Hugging Face generate: they need --temperature 0")
        if self.sweep_prompts < 0 or any(b < 1 for b in self.sweep_budgets):
            raise ValueError("--sweep-prompts must be >= 0 and --sweep-budgets >= 1")

        check_device(self.device)
        if self.cost_curve is not None:  # checked now, not after the timed runs that the projection follows
            try:
                CostCurve.load(self.cost_curve)
            except (OSError, ValueError) as exc:
                raise ValueError(f"--cost-curve: {exc}") from None
        if self.drafter_kind not in ("autoregressive", "parallel", "both"):
            raise ValueError(f"--drafter-kind must be autoregressive, parallel or both, got {self.drafter_kind!r}")
