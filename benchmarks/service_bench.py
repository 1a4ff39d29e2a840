"""Tokens/s through gRPC + Ray Serve vs the in-process engine, same models, same machine, same run.

    python benchmarks/service_bench.py                         # default target + default drafter (dyspec)
    python benchmarks/service_bench.py --method autoregressive # when the default drafter is not trained yet
    python benchmarks/service_bench.py --target DIR --drafter DIR --budget 8

For 1 and for N (default 8) concurrent requests it measures
- in-process: `SpeculativeEngine.generate` on the same requests (N at once = one batched generate call);
- service: GenerateStream calls over plain grpcio through Serve's gRPC proxy, N client threads at once.
tokens/s = generated tokens / wall time of `--rounds` rounds (greedy, fixed max_new_tokens). In-process and
service rounds alternate (in-process round 1, service round 1, in-process round 2, ...) with the service up,
so both sides see the same drifts of a shared VM (one 64-token request alone varies by +-20% from minute
to minute here); the idle replicas and the re-niced control plane take ~10% of one core meanwhile. Each
side gets an untimed warm-up round at each concurrency first (prompts from the end of the list), so the
hardware-aware budget choosers (batch-1 and per batch size) have finished exploring.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = ["Explain speculative decoding in simple terms.", "Write a short poem about the sea.",
           "What are the three primary colors?", "Give me a recipe for pancakes.",
           "Why do cats purr?", "Summarise the plot of Hamlet.", "How does a bicycle stay upright?",
           "List five uses for a paperclip.", "What is the capital of Australia and why?",
           "Describe a sunrise to someone who has never seen one.", "How do vaccines work?",
           "What is recursion? Give an example."]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step_breakdown(requests: list[tuple[int, float, tuple[float, float, float]]]) -> dict[str, float]:
    """Mean ms per step over requests given as (steps, wall ms, (draft, score, verify) ms per step): where a
    step's time goes, "other" being the loop's own time between steps (a batched step is counted once per
    request in it, as its records are)."""
    steps = sum(n for n, _, _ in requests) or 1
    draft, score, verify = (sum(n * ms[i] for n, _, ms in requests) / steps for i in range(3))
    wall = sum(w for _, w, _ in requests) / steps
    return {"wall": wall, "draft": draft, "score": score, "verify": verify, "other": wall - draft - score - verify}


class InProcess:
    """The in-process engine, one round at a time."""

    def __init__(self, args):
        from treeserve.engine.pipeline import build_engine

        budget = args.budget if args.budget == "auto" else int(args.budget)
        self.engine = build_engine(args.target, args.drafter, args.method, budget)
        self.prompts = [self.engine.encode_chat(p) for p in PROMPTS]
        self.max_new_tokens = args.max_new_tokens

    def round(self, first: int, n: int) -> tuple[list[tuple[int, int, float, tuple]], float]:
        """n requests at once (one batched generate call) -> per request (tokens, steps, wall ms, mean
        (draft, score, verify) ms per step), and the round's wall seconds."""
        from treeserve.engine.requests import GenerationRequest

        requests = [GenerationRequest(self.prompts[(first + i) % len(self.prompts)], max_new_tokens=self.max_new_tokens)
                    for i in range(n)]
        started = time.perf_counter()
        results = self.engine.generate(requests)
        wall = time.perf_counter() - started
        return [(len(r.token_ids), len(r.steps), r.wall_time_s * 1e3, r.mean_step_ms()) for r in results], wall


class ThroughService:
    """GenerateStream calls over plain grpcio through Serve's gRPC proxy, one client thread per stream."""

    def __init__(self, args, max_concurrency: int):
        from treeserve.services.grpc_clients import channel_options
        from treeserve.services.serve_command import load_config, start_service

        config = load_config(args.config, method=args.method, budget=str(args.budget), target=args.target,
                             drafter=args.drafter, grpc_port=_free_port())
        limits = config.app.args.limits
        limits.max_batch_size = max(limits.max_batch_size, max_concurrency)
        limits.max_concurrent_requests = max(limits.max_concurrent_requests, max_concurrency)
        self.service = start_service(config, quiet=True, control_plane_nice=args.control_plane_nice)
        self.options = channel_options()
        self.max_new_tokens = args.max_new_tokens

    def _call(self, i: int, results: dict) -> None:
        import grpc

        from treeserve.v1 import generation_pb2 as gen
        from treeserve.v1 import generation_pb2_grpc as gen_grpc

        request = gen.GenerateRequest(text=PROMPTS[i % len(PROMPTS)], max_new_tokens=self.max_new_tokens)
        with grpc.insecure_channel(self.service.address, options=self.options) as channel:
            messages = list(gen_grpc.TreeServeStub(channel).GenerateStream(
                request, metadata=[("application", self.service.app_name)], timeout=600))
        results[i] = messages[-1].stats

    def round(self, first: int, n: int) -> tuple[list[tuple[int, int, float, tuple]], float]:
        results: dict = {}
        threads = [threading.Thread(target=self._call, args=(first + i, results)) for i in range(n)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
        return [(s.completion_tokens, s.steps, s.wall_time_ms, (s.mean_draft_ms, s.mean_score_ms, s.mean_verify_ms))
                for s in results.values()], wall

    def close(self) -> None:
        from treeserve.services.serve_command import stop_service

        stop_service(self.service)


def _summary(requests: list[tuple[int, int, float, tuple]], wall: float) -> dict:
    tokens = sum(r[0] for r in requests)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "mal": tokens / max(1, sum(r[1] for r in requests)),
            "step_ms": _step_breakdown([(steps, ms, per_step) for _, steps, ms, per_step in requests])}


def measure(args) -> tuple[dict[int, dict], dict[int, dict]]:
    """Alternating rounds of both sides at every concurrency level -> (in-process, service) summaries."""
    local = InProcess(args)
    served = ThroughService(args, max(args.concurrency))
    out: tuple[dict[int, dict], dict[int, dict]] = ({}, {})
    try:
        for n in args.concurrency:
            for side in (local, served):
                side.round(len(PROMPTS) - n, n)  # untimed warm-up at this concurrency (prompts from the end)
            runs: tuple[list, list] = ([], [])
            walls = [0.0, 0.0]
            for r in range(args.rounds):
                for k, side in enumerate((local, served)):
                    requests, wall = side.round(r * n, n)
                    runs[k].extend(requests)
                    walls[k] += wall
            for k in range(2):
                out[k][n] = _summary(runs[k], walls[k])
    finally:
        served.close()
    return out


def main(argv: list[str] | None = None) -> int:
    from treeserve.services.serve_command import DEFAULT_CONFIG

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--target", default="default")
    parser.add_argument("--drafter", default="default")
    parser.add_argument("--method", default="dyspec")
    parser.add_argument("--budget", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=4,
                        help="timed rounds per concurrency (different prompts), summed: one 64-token request alone "
                             "varies by +-20%% on a shared VM")
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    parser.add_argument("--control-plane-nice", type=int, default=10,
                        help="niceness of Ray's control plane (as `treeserve serve`; 0 = unchanged)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the in-process engine (replicas use 1; DESIGN.md section 4)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.max_new_tokens < 1 or min(args.concurrency) < 1:
        parser.error("--rounds, --max-new-tokens and --concurrency must be >= 1")
    import torch

    torch.set_num_threads(args.threads)
    local, served = measure(args)
    print(f"\nservice_bench: target={args.target} drafter={args.drafter} method={args.method} budget={args.budget} "
          f"max_new_tokens={args.max_new_tokens}")
    print(f"{'streams':>8} {'in-process tok/s':>17} {'service tok/s':>14} {'service/in-process':>19} "
          f"{'service N/1':>12} {'MAL in-proc':>11} {'MAL service':>11}")
    one = served[min(args.concurrency)]["tokens_per_s"]
    for n in args.concurrency:
        a, b = local[n], served[n]
        print(f"{n:>8} {a['tokens_per_s']:>17.1f} {b['tokens_per_s']:>14.1f} {b['tokens_per_s'] / a['tokens_per_s']:>19.2f} "
              f"{b['tokens_per_s'] / one:>11.2f}x {a['mal']:>11.2f} {b['mal']:>11.2f}")
    print(f"\n{'streams':>8} {'ms per step (wall / draft / score / verify / other)':>52}")
    for n in args.concurrency:
        for name, side in (("in-process", local[n]), ("service", served[n])):
            ms = side["step_ms"]
            print(f"{n:>8} {name:>11} {ms['wall']:8.1f} {ms['draft']:7.1f} {ms['score']:7.1f} {ms['verify']:7.1f} "
                  f"{ms['other']:7.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "in_process": local, "service": served}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
