"""`treeserve loadtest`: a bounded soak test of the public gRPC API on this machine.

    treeserve loadtest --streams 32 --duration 600                  # the full soak (starts the service itself)
    treeserve loadtest --streams 8 --duration 90 --kill Drafter     # a short one
    treeserve loadtest --address 127.0.0.1:9000 --kill none          # against a running service (loopback only)

It starts the service from `--config` (deploy/local-cpu.yaml), computes the target's own greedy answer to every
prompt in-process, then keeps `--streams` concurrent clients busy for `--duration` seconds with a mix of
requests (services/loadtest.py): every method of `--methods`, greedy and sampled, streamed and unary;
`--malformed` of them malformed (garbage bytes, empty prompt, bad sampling, unknown method, token ids outside the
vocabulary, too many new tokens) and `--cancel` of them cancelled by the client after a message or two. Halfway
through (`--kill-at`) it kills one replica of `--kill` (Target by default) through Ray and measures how long the
streams in flight stalled.

Report: requests by final status (client side), lost outputs (a valid request that did not finish), corrupted
outputs (greedy output different from the in-process greedy answer, or a sampled one that is inconsistent:
wrong token count, ids outside the vocabulary, a finish reason that does not match), TTFT and inter-token
latency p50/p95/p99, and the kill's stall. Greedy outputs that differ only where the target's top two logits lie
within `--tie-epsilon` (batched and single-sequence fp32 forwards round differently) are reported apart as
near-tie divergences. A request refused with RESOURCE_EXHAUSTED because the router was full is retried after a
short pause (what a client should do); those refusals are counted, not lost.

Bounded in every way: requests start only until the duration ends (and at most `--max-requests`), every call has
a deadline, the drain after the end is capped, and traffic goes to a loopback address only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

from treeserve.engine.methods import SERVED_METHODS, Method  # torch-free
from treeserve.services.launch import DEFAULT_CONFIG, start_service, stop_service, load_config
from treeserve.services.loadtest import LoadTestOptions, LoadTest, Reference, is_loopback, load_prompts
from treeserve.services.loadtest_report import format_report, report as summarize
from .connection import add_credential_arguments, credentials
from .main import CliError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="Serve config of the service it starts "
                        "(default: deploy/local-cpu.yaml)")
    parser.add_argument("--address", default=None, help="test a service already running at this loopback address "
                        "instead of starting one")
    parser.add_argument("--target", default=None, help="with --address: the served target model, for the "
                        "in-process greedy answers (default: 'default', the embedded one)")
    parser.add_argument("--ray-address", default=None, help="with --address: the Ray cluster to kill a replica in "
                        "(e.g. 'auto'); without it --kill must be none")
    parser.add_argument("--streams", type=int, default=32, help="concurrent clients (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default: %(default)s)")
    parser.add_argument("--max-requests", type=int, default=100_000, help="requests at most (default: %(default)s)")
    parser.add_argument("--methods", nargs="+", default=[m for m in SERVED_METHODS if not Method.parse(m).copies],
                        choices=SERVED_METHODS, metavar="METHOD",
                        help="served methods to mix: %s (default: every one without lookup)" % ", ".join(SERVED_METHODS))
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts, balanced over Spec-Bench "
                        "categories (default: %(default)s)")
    parser.add_argument("--max-new-tokens", default="16:64", help="lo:hi range of max_new_tokens (default: "
                        "%(default)s); each prompt's greedy requests use one fixed value from it")
    parser.add_argument("--sampled", type=float, default=0.5, help="fraction of valid requests that sample "
                        "(temperature > 0) (default: %(default)s)")
    parser.add_argument("--unary", type=float, default=0.2, help="fraction of valid requests sent as unary "
                        "Generate (default: %(default)s)")
    parser.add_argument("--malformed", type=float, default=0.05, help="fraction of malformed requests "
                        "(default: %(default)s)")
    parser.add_argument("--cancel", type=float, default=0.05, help="fraction of streams the client cancels "
                        "(default: %(default)s)")
    parser.add_argument("--kill", choices=("Target", "Drafter", "Router", "none"), default="Target",
                        help="deployment one replica of which is killed once (default: %(default)s)")
    parser.add_argument("--kill-at", type=float, default=0.5, help="when, as a fraction of --duration "
                        "(default: %(default)s)")
    parser.add_argument("--max-concurrent-requests", type=int, default=None, help="override the started "
                        "service's limits.max_concurrent_requests")
    parser.add_argument("--max-batch-size", type=int, default=None, help="override the started service's "
                        "limits.max_batch_size")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="deadline of every call, seconds "
                        "(default: %(default)s)")
    parser.add_argument("--tie-epsilon", type=float, default=LoadTestOptions.tie_epsilon, help="top-2 logit gap "
                        "under which a greedy divergence counts as a near tie (default: %(default)s)")
    add_credential_arguments(parser.add_argument_group("with --address: reaching the running service"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the report as JSON here")
    parser.add_argument("--ready-timeout", type=float, default=900.0)


def run(args: argparse.Namespace) -> int:
    from treeserve.services.transport.replica_server import quiet_poller_noise

    quiet_poller_noise()  # grpc.aio here and in Ray's driver threads: harmless BlockingIOErrors otherwise

    for name in ("malformed", "cancel", "sampled", "unary", "kill_at"):
        if not 0 <= getattr(args, name) <= 1:
            raise CliError(f"--{name.replace('_', '-')} must lie in [0, 1]")
    if args.streams < 1 or args.duration <= 0 or args.max_requests < 1:
        raise CliError("--streams, --duration and --max-requests must be positive")
    try:
        lo, hi = (int(x) for x in args.max_new_tokens.split(":"))
        assert 1 <= lo <= hi
    except (ValueError, AssertionError):
        raise CliError(f"--max-new-tokens: expected lo:hi with 1 <= lo <= hi, got {args.max_new_tokens!r}") from None
    service = None
    tls, token = credentials(args)
    if args.address is not None:
        if not is_loopback(args.address):
            raise CliError(f"--address {args.address}: the load test only sends traffic to a loopback address")
        if args.kill != "none" and args.ray_address is None:
            raise CliError("--kill needs --ray-address with --address (or use --kill none)")
        address = args.address
        config = None
    else:
        config = _load(args)
        address = None
        tls = {}  # the service started here is plaintext on loopback
    # The reference answers first, before the service competes for the cores.
    target_path = config.app.args.target.path if config is not None else (args.target or "default")
    dtype = config.app.args.target.dtype if config is not None else "float32"
    print("computing the target's greedy answers in-process ...", file=sys.stderr)
    reference = Reference(target_path, dtype)
    rng = random.Random(args.seed)
    texts = load_prompts(args.prompts)
    prompts = [reference.prompt_ids(t) for t in texts]
    budget = [rng.randint(lo, hi) for _ in prompts]
    expected = [reference.greedy(p, n) for p, n in zip(prompts, budget)]
    limit_new = config.app.args.limits.max_new_tokens if config is not None else 512
    if config is not None:
        print(f"starting the service from {args.config} ...", file=sys.stderr)
        service = start_service(config, quiet=True, ready_timeout_s=args.ready_timeout)
        address = service.address
    elif args.kill != "none":
        import ray

        ray.init(address=args.ray_address, log_to_driver=False)
    try:
        test = LoadTest(options(args, (lo, hi)), address, reference, prompts, budget, expected, limit_new, tls, token)
        print(f"load: {args.streams} streams for {args.duration:.0f} s on {address}", file=sys.stderr)
        wall = asyncio.run(test.run())
        test.judge()
        report = summarize(test, wall)
    finally:
        if service is not None:
            stop_service(service)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["lost"] == report["corrupted"] == report["unexpected_status"] == 0 else 1


def options(args: argparse.Namespace, new_tokens: tuple[int, int]) -> LoadTestOptions:
    return LoadTestOptions(
        streams=args.streams, duration=args.duration, max_requests=args.max_requests, methods=tuple(args.methods),
        new_tokens=new_tokens, sampled=args.sampled, unary=args.unary, malformed=args.malformed, cancel=args.cancel,
        kill=args.kill, kill_at=args.kill_at, request_timeout=args.request_timeout, tie_epsilon=args.tie_epsilon,
        seed=args.seed)


def _load(args: argparse.Namespace):
    from treeserve.services.app import config_to_args
    from treeserve.services.config import AppConfig

    config = load_config(args.config)
    if not config.app.args.api.loopback_only:
        raw = config_to_args(config.app.args)
        raw["api"]["host"] = "127.0.0.1"  # the load test's service listens on loopback only
        config.app.args = AppConfig.from_args(raw)
    raw = config_to_args(config.app.args)
    if args.max_concurrent_requests is not None:
        raw["limits"]["max_concurrent_requests"] = args.max_concurrent_requests
    if args.max_batch_size is not None:
        raw["limits"]["max_batch_size"] = args.max_batch_size
    if config.app.args.security.tls or config.app.args.security.auth_token_file:
        raise ValueError(f"{args.config}: the load test starts a plaintext loopback service; use a config without "
                         "security files, or --address with --tls-ca / --token-file")
    config.app.args = AppConfig.from_args(raw)
    return config

