"""Tokens/s through gRPC + Ray Serve vs the in-process engine, same models, same machine, same run.

    python benchmarks/service_bench.py                         # default target + default drafter (dyspec)
    python benchmarks/service_bench.py --method autoregressive # when the default drafter is not trained yet
    python benchmarks/service_bench.py --target DIR --drafter DIR --budget 8

For 1 and for N (default 8) concurrent requests it measures
- in-process: `SpeculativeEngine.generate` on the same requests (N at once = one batched generate call);
- service: GenerateStream calls over plain grpcio through Serve's gRPC proxy, N client threads at once.
tokens/s = generated tokens / wall time of `--rounds` rounds (greedy, fixed max_new_tokens). The in-process
rounds run first, before Ray starts, so they do not compete with idle replicas for the CPU. Each timed
round follows an untimed warm-up round at the same concurrency (prompts from the end of the list), on both
sides, so the hardware-aware budget choosers (batch-1 and per batch size) have finished exploring.
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


def in_process(args, concurrency_levels) -> dict[int, dict]:
    from treeserve.engine.pipeline import build_engine
    from treeserve.engine.requests import GenerationRequest

    budget = args.budget if args.budget == "auto" else int(args.budget)
    engine = build_engine(args.target, args.drafter, args.method, budget)
    prompts = [engine.encode_chat(p) for p in PROMPTS]
    out = {}
    for n in concurrency_levels:
        engine.generate([GenerationRequest(prompts[-1 - i], max_new_tokens=args.max_new_tokens) for i in range(n)])
        results, wall = [], 0.0
        for r in range(args.rounds):
            requests = [GenerationRequest(prompts[(r * n + i) % len(prompts)], max_new_tokens=args.max_new_tokens)
                        for i in range(n)]
            started = time.perf_counter()
            results += engine.generate(requests)
            wall += time.perf_counter() - started
        tokens = sum(len(r.token_ids) for r in results)
        steps = sum(len(r.steps) for r in results)
        out[n] = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                  "mal": sum(s.emitted for r in results for s in r.steps) / max(1, steps),
                  "step_ms": _step_breakdown([(len(r.steps), r.wall_time_s * 1e3, r.mean_step_ms()) for r in results])}
    return out


def through_service(args, concurrency_levels) -> dict[int, dict]:
    import grpc

    from treeserve.services.grpc_clients import channel_options
    from treeserve.services.serve_command import load_config, start_service, stop_service
    from treeserve.v1 import generation_pb2 as gen
    from treeserve.v1 import generation_pb2_grpc as gen_grpc

    config = load_config(args.config, method=args.method, budget=str(args.budget), target=args.target,
                         drafter=args.drafter, grpc_port=_free_port())
    config.app.args.limits.max_batch_size = max(config.app.args.limits.max_batch_size, max(concurrency_levels))
    config.app.args.limits.max_concurrent_requests = max(config.app.args.limits.max_concurrent_requests,
                                                         max(concurrency_levels))
    service = start_service(config, quiet=True, control_plane_nice=args.control_plane_nice)
    out = {}
    try:
        metadata = [("application", service.app_name)]

        def call(i, results):
            request = gen.GenerateRequest(text=PROMPTS[i % len(PROMPTS)], max_new_tokens=args.max_new_tokens)
            with grpc.insecure_channel(service.address, options=channel_options()) as channel:
                messages = list(gen_grpc.TreeServeStub(channel).GenerateStream(request, metadata=metadata,
                                                                              timeout=600))
            results[i] = messages[-1].stats

        def round_of(first: int, n: int) -> tuple[dict, float]:
            results: dict = {}
            threads = [threading.Thread(target=call, args=(first + i, results)) for i in range(n)]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return results, time.perf_counter() - started

        for n in concurrency_levels:
            round_of(len(PROMPTS) - n, n)  # untimed warm-up round at this concurrency (prompts from the end)
            results, wall = {}, 0.0
            for r in range(args.rounds):
                got, seconds = round_of(r * n, n)
                results.update(got)
                wall += seconds
            tokens = sum(s.completion_tokens for s in results.values())
            steps = sum(s.steps for s in results.values())
            out[n] = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                      "mal": sum(s.mean_accepted_length * s.steps for s in results.values()) / max(1, steps),
                      "step_ms": _step_breakdown([(s.steps, s.wall_time_ms, (s.mean_draft_ms, s.mean_score_ms,
                                                                             s.mean_verify_ms))
                                                  for s in results.values()])}
    finally:
        stop_service(service)
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
    parser.add_argument("--rounds", type=int, default=3,
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
    local = in_process(args, args.concurrency)
    served = through_service(args, args.concurrency)
    print(f"\nservice_bench: target={args.target} drafter={args.drafter} method={args.method} budget={args.budget} "
          f"max_new_tokens={args.max_new_tokens}")
    print(f"{'streams':>8} {'in-process tok/s':>17} {'service tok/s':>14} {'service/in-process':>19} "
          f"{'MAL in-proc':>11} {'MAL service':>11}")
    for n in args.concurrency:
        a, b = local[n], served[n]
        print(f"{n:>8} {a['tokens_per_s']:>17.1f} {b['tokens_per_s']:>14.1f} {b['tokens_per_s'] / a['tokens_per_s']:>19.2f} "
              f"{a['mal']:>11.2f} {b['mal']:>11.2f}")
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
