"""`treeserve memory-estimate`: weights + KV cache + activations per process and per GPU of deploy layouts,
FITS or not (services/memory_estimate.py computes it from the models' config.json facts)."""

from __future__ import annotations

import argparse
from pathlib import Path

from treeserve.services.memory_estimate import default_layouts, report, report_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("layouts", nargs="*", type=Path,
                        help="Serve config YAMLs (default: every deploy/*.yaml)")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0,
                        help="memory per GPU in GiB (default 80: A100 80GB)")
    parser.add_argument("--overhead-gib", type=float, default=2.0,
                        help="fixed margin per process: CUDA context, NCCL buffers, allocator slack")
    parser.add_argument("--write", action="store_true",
                        help="also write <layout>.memory.txt next to each layout")


def run(args: argparse.Namespace) -> int:
    if args.gpu_memory_gib <= 0 or args.overhead_gib < 0:
        raise ValueError("--gpu-memory-gib must be > 0 and --overhead-gib >= 0")
    layouts = list(args.layouts) or default_layouts()
    if not layouts:
        raise ValueError("no layouts given and no deploy/*.yaml found")
    fits = True
    for path in layouts:
        text, ok = report(path, args.gpu_memory_gib, args.overhead_gib)
        fits &= ok
        print(text)
        if args.write:
            report_path(path).write_text(text)
    return 0 if fits else 1
