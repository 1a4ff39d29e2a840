"""`treeserve demo` (what `make run` does): start the service from deploy/local-cpu.yaml, wait until it answers,
stream one completion over gRPC with its statistics, and shut everything down again.

If the configured shipped drafter is not installed, the demo serves the embedded target with method
autoregressive (and says so) instead of failing.
"""

from __future__ import annotations

import argparse
import sys
import time

from treeserve.engine.drafters.registry import SHIPPED_NAMES, drafter_dir
from treeserve.engine.methods import SERVED_METHODS  # torch-free
from treeserve.services.launch import DEFAULT_CONFIG, load_config, start_service, stop_service
from .generate import format_stats, stream_completion
from .serve import (add_console_arguments, dashboard_config, print_dashboard, quiet_console, start_progress,
                    state_ray_auth_mode)

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None,
                        help="Serve config YAML (default: deploy/local-cpu.yaml)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--method", default=None, choices=SERVED_METHODS, metavar="METHOD",
                        help="override the config's tree method: %s" % ", ".join(SERVED_METHODS))
    parser.add_argument("--grpc-port", type=int, default=None, help="override the config's gRPC port")
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    add_console_arguments(parser)


def run(args: argparse.Namespace) -> int:
    state_ray_auth_mode(None)
    quiet_console(args.verbose)
    from treeserve.v1 import generation_pb2 as gen

    method = args.method
    if method is None:
        probe = load_config(args.config, method="autoregressive")
        drafter = probe.app.args.drafter.path
        if drafter in SHIPPED_NAMES and not (drafter_dir(drafter) / "config.json").is_file():
            method = "autoregressive"
            print(f"note: the shipped {drafter!r} drafter is not installed (train it with `treeserve train-drafter`); "
                  "serving the target autoregressively", file=sys.stderr)
    config = load_config(args.config, method=method, grpc_port=args.grpc_port)
    print(f"starting TreeServe from {args.config or 'built-in defaults'} "
          f"(method {config.app.args.speculation.method}) ...", file=sys.stderr)
    started = time.perf_counter()
    service = start_service(config, quiet=not args.verbose, ready_timeout_s=args.ready_timeout,
                            dashboard=dashboard_config(args), progress=start_progress())
    try:
        print(f"ready on {service.address} after {time.perf_counter() - started:.0f} s", file=sys.stderr)
        print_dashboard(service)
        print(file=sys.stderr)
        print(f">>> {args.prompt}")
        request = gen.GenerateRequest(text=args.prompt, max_new_tokens=args.max_new_tokens)
        final = stream_completion(service.address, request, service.app_name)
        print()
        if final is not None:
            print(format_stats(final.stats, gen.FinishReason.Name(final.finish_reason)), file=sys.stderr)
    finally:
        stop_service(service)
        print("stopped", file=sys.stderr)
    return 0
