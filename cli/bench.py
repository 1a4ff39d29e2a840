"""`treeserve bench`: the methods in-process (engine.bench: every tree method, the peers, pictures, the
projection) or, with `--service`, the gRPC service under concurrent streams (services.bench_service)."""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  treeserve bench --num-prompts 40 --repeats 2 --check-greedy --peers hf --plot bench-plots \\
      --answers-dir answers --json-out bench.json --methods autoregressive c2t:auto dyspec:auto
  treeserve bench --methods autoregressive c2t:auto --sweep   # + MAL vs candidates, builders at budgets 8..64
  treeserve bench --service --concurrency 1 8 16 32     # the gRPC service: tokens/s, TTFT, ITL
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from treeserve.engine import bench
    from treeserve.services.bench_service import add_service_arguments

    parser.description = (bench.__doc__ or "").split("\n\n")[0]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    bench.add_arguments(parser)
    add_service_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.service:
        from treeserve.services.bench_service import run_service

        return run_service(args)
    from treeserve.engine import bench

    return bench.run(args)
