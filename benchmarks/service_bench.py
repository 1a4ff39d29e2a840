"""Moved into the command line: `treeserve bench --service` (services/bench_service.py).

    python benchmarks/service_bench.py --concurrency 1 8     # = treeserve bench --service --concurrency 1 8

measures the gRPC service under 1/8/16/32 concurrent streams (aggregate tokens/s, TTFT and ITL p50/p95,
errors, equality with in-process greedy) in one table and one JSON (`--json-out`); this script forwards its
arguments there (see `treeserve bench --help`, group "service").
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from treeserve.cli.main import main

    sys.exit(main(["bench", "--service", *sys.argv[1:]]))
