"""`treeserve profile`: the cost curve T(n nodes, batch) of one tree forward through TreeServe's own
`CachedLM.extend`, beside the bounds the device allows.

Every point is the median time of one forward that feeds `batch` sessions a chain of n tree nodes each after a
`--prefix`-token cached context (engine/hardware/cost_measure.py; as engine/budget.py times the budget chooser's
curve). Beside it: the weight-streaming bound (bytes of weights one forward reads over the device's MEASURED
copy bandwidth) and the FLOP bound (2 x params x tokens over the MEASURED matmul peak of the dtype), their ratio
to T and the tokens fed per second.

The model is a model directory (`--model DIR`, or `default` for the embedded SmolLM2 target), or a preset's
config facts (deploy/models/NAME/config.json; `--models-dir` to read them elsewhere) with seeded random
weights built directly on the device: a forward's time depends on the shapes, not on the weights' values.
`--tp-size N` (presets only) measures the shapes of ONE tensor-parallel rank (heads, KV heads and MLP width
divided by N; embeddings and LM head whole), without the all-reduces a real TP step adds.

`--step static` runs CachedLM's static-shape step (padded buckets, CUDA graphs on a GPU;
`--no-cuda-graphs` turns the graphs off; `--no-fused-ops` keeps the modules' own norms, rotation and SiLU instead
of the fused kernels compiled on a GPU, engine/runners/fused_ops.py) instead of the model's own modules (`eager`).

`--json-out` writes the curve (schema treeserve.costcurve/1, engine/hardware/cost_curve.py); the budget chooser
(engine/budget.py `profile_from_cost_curve`, `measure_profile(cost_curve=...)`) and the PROJECTED cost model
(tools/bench/projection.py `load_layouts(cost_curve=...)`) read it instead of ASSUMED efficiencies.

usage:
  treeserve profile --model default --nodes 1 4 16 --batch 1 4 --repeats 3
  treeserve profile --preset Llama-2-7b-hf --device cuda --dtype bfloat16 --batch 1 8 32 --json-out 7b.json
  treeserve profile --preset Llama-2-70b-hf --tp-size 4 --device cuda:0 --dtype bfloat16 --step static \\
      --json-out 70b-tp4-rank.json
  treeserve profile --preset my-model --models-dir ./configs --device cpu --prefix 128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from treeserve.engine.devices import check_device
from treeserve.engine.hardware.cost_curve import CostCurve
from treeserve.engine.hardware.cost_measure import (DEFAULT_BATCHES, DEFAULT_NODES, STEP_MODES, measure_cost_curve,
                                                    measure_device)
from treeserve.engine.hardware.profile_model import DTYPES, load_profile_model, preset_config, rank_config, MODELS_DIR
from treeserve.engine.runners.step_settings import StaticStepSettings
from .main import CliError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (__doc__ or "").split("\n\n")[0]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "usage" + (__doc__ or "").split("\nusage")[-1]
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", default=None,
                        help="a model directory, a .gguf, or 'default' (the embedded SmolLM2 target)")
    source.add_argument("--preset", default=None,
                        help="a preset's config facts with random weights: a folder of --models-dir holding a "
                             "config.json (e.g. Llama-2-7b-hf, Llama-2-70b-hf, vicuna-33b-v1.3)")
    parser.add_argument("--models-dir", type=Path, default=MODELS_DIR,
                        help="where presets are read (default: the checkout's deploy/models)")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="with --preset: measure the shapes of one of N tensor-parallel ranks "
                             "(default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="weights and activations (default: %(default)s)")
    parser.add_argument("--nodes", type=int, nargs="+", default=list(DEFAULT_NODES),
                        help="tree node counts n per session (default: %(default)s)")
    parser.add_argument("--batch", type=int, nargs="+", default=list(DEFAULT_BATCHES),
                        help="batch sizes: sessions fed n nodes each in one forward (default: %(default)s)")
    parser.add_argument("--prefix", type=int, default=512,
                        help="context tokens cached before the tree (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed forwards per point after one warm-up; the median counts (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--step", choices=STEP_MODES, default="eager",
                        help="eager: the model's own modules; static: CachedLM's static-shape step "
                             "(default: %(default)s)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="with --step static: run the padded buckets without capturing CUDA graphs")
    parser.add_argument("--no-fused-ops", action="store_true",
                        help="with --step static: the modules' own RMSNorms, rotary embedding and SiLU instead of "
                             "fused kernels compiled with torch.compile (those run on CUDA only)")
    parser.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights (default: %(default)s)")
    parser.add_argument("--json-out", type=Path, default=None,
                        help="write the curve, device facts and bounds as JSON (schema treeserve.costcurve/1)")


def run(args: argparse.Namespace) -> int:
    check_device(args.device)
    if args.no_cuda_graphs and args.step != "static":
        raise CliError("--no-cuda-graphs applies to --step static")
    if args.no_fused_ops and args.step != "static":
        raise CliError("--no-fused-ops applies to --step static")
    if args.tp_size != 1 and args.preset is None:
        raise CliError("--tp-size needs --preset: one rank's shapes are built from a preset's config facts")
    if args.preset is not None:  # an unknown preset or a TP size that does not divide: refused before measuring
        rank_config(preset_config(args.preset, args.models_dir), args.tp_size)
    if min(args.nodes) < 1 or min(args.batch) < 1 or args.prefix < 0 or args.repeats < 1:
        raise CliError("--nodes and --batch must be >= 1, --prefix >= 0 and --repeats >= 1")
    if args.threads is not None:
        if args.threads < 1:
            raise CliError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    static = (StaticStepSettings(cuda_graphs=not args.no_cuda_graphs, fused_ops=not args.no_fused_ops)
              if args.step == "static" else None)
    try:
        device_facts = measure_device(args.device, dtype)  # before the model: the copy's buffers need the memory
        model, facts = load_profile_model(args.model, args.preset, args.tp_size, args.device, dtype, args.seed,
                                          args.models_dir)
        curve = measure_cost_curve(model, facts, args.device, dtype, device_facts, tuple(args.nodes),
                                   tuple(args.batch), args.prefix, args.repeats, static, command_line(args),
                                   log=lambda line: print(line, file=sys.stderr))
    except torch.OutOfMemoryError as exc:
        raise CliError(f"out of memory on {args.device} ({str(exc).splitlines()[0]}); a larger --tp-size or a "
                       "smaller --batch / --prefix / --nodes needs less") from None
    console = Console(width=200)
    for line in header(curve):
        console.print(line, highlight=False, markup=False)
    console.print(curve_table(curve))
    if args.json_out is not None:
        print(f"wrote {curve.save(args.json_out)}")
    return 0


def command_line(args: argparse.Namespace) -> list[str]:
    """The command that measured the curve, every option spelled out (defaults included, so the file says
    exactly what was run whoever called it)."""
    source = ["--model", str(args.model)] if args.model is not None else \
        ["--preset", args.preset, "--models-dir", str(args.models_dir), "--tp-size", str(args.tp_size),
         "--seed", str(args.seed)]
    return ["treeserve", "profile", *source, "--device", args.device, "--dtype", args.dtype,
            "--nodes", *map(str, args.nodes), "--batch", *map(str, args.batch), "--prefix", str(args.prefix),
            "--repeats", str(args.repeats), *(["--threads", str(args.threads)] if args.threads else []),
            "--step", args.step, *(["--no-cuda-graphs"] if args.no_cuda_graphs else []),
            *(["--no-fused-ops"] if args.no_fused_ops else []),
            *(["--json-out", str(args.json_out)] if args.json_out else [])]


def header(curve: CostCurve) -> list[str]:
    """What was measured, on what, and the two measured device rates the bounds come from."""
    fused = ", fused ops off" if "--no-fused-ops" in curve.command else ""
    graphs = f" (CUDA graphs {'on' if curve.cuda_graphs else 'off'}{fused})" if curve.step == "static" else ""
    return [f"cost curve: {curve.model.describe()}",
            f"device {curve.device}, {curve.dtype}, torch {curve.torch_version}, {curve.threads} threads; "
            f"step {curve.step}{graphs}; prefix {curve.prefix} tokens; median of {curve.repeats}",
            f"copy bandwidth {curve.copy_bytes_s / 1e9:,.1f} GB/s (measured: {curve.copy_bytes / 2**20:,.0f} MiB "
            f"copied, read + write bytes); matmul peak {curve.matmul_flops_s / 1e12:,.3f} TFLOP/s (measured matmul "
            f"peak, {curve.matmul_size}^3 {curve.dtype})",
            f"bounds: weight streaming {curve.weight_stream_ms:.3f} ms per forward (weight bytes / copy bandwidth); "
            f"FLOPs 2 x {curve.model.matmul_params / 1e6:,.1f}M params x tokens / matmul peak; bound = the larger"]


def curve_table(curve: CostCurve):
    """Rows: node counts; per batch size: T(n) ms, the bound, T / bound, tokens fed per second."""
    table = Table(title="T(n nodes, batch): one tree forward (MEASURED)")
    table.add_column("n", justify="right")
    for batch in curve.curves:
        for col in ("T ms", "bound ms", "T/bound", "tok/s"):
            table.add_column(f"{col} b={batch}", justify="right")
    for n in sorted({n for c in curve.curves.values() for n in c}):
        cells = [str(n)]
        for batch, points in curve.curves.items():
            ms = points[n]
            bound = curve.bound_ms(batch, n)
            cells += [f"{ms:.2f}", f"{bound:.3f}", f"{ms / bound:.1f}", f"{1e3 * batch * n / ms:,.0f}"]
        table.add_row(*cells)
    return table
