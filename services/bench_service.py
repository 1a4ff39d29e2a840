"""`treeserve bench --service`: the gRPC service under 1/8/16/32 concurrent streams, one table, one JSON.

The bench starts the service from a Serve config (default deploy/local-cpu.yaml; Ray Serve, the Router's
public gRPC API, Drafter and Target replicas) on a free port, then for every `--concurrency` level N opens N
GenerateStream calls at once (one client thread and channel each, released together), each on its own dev
prompt (the vendored Spec-Bench questions, first turn, chat template, sent as token ids so both sides decode
exactly the same prompt), greedy, `--max-new-tokens` tokens. Per level it reports:

- aggregate tokens/s: tokens of all streams / wall time from the first send to the last stream's end
  (summed over `--service-rounds` rounds);
- time to first token (TTFT), p50 / p95: send -> first message carrying tokens;
- inter-token latency (ITL), p50 / p95, over tokens: a message carrying k tokens that arrives g seconds after
  the previous one gives each of its k tokens an ITL of g / k (a speculative step emits several tokens at
  once; a plain step one);
- errors: streams that ended in a gRPC error (status code counted);
- MAL from the service's own statistics;
- equality with in-process greedy: every stream's tokens against the target's own greedy `generate` on the
  same prompt (engine.bench.GreedyCheck: divergence allowed only at near-tied top-2 logits).

A warm-up round (untimed, when `--warmup-prompts` > 0) runs at each level first, so the hardware-aware
budget choosers (batch 1 and per batch size) have finished exploring. `--max-concurrent-requests` and the
batch size are raised to the largest level so no stream is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONCURRENCY = [1, 8, 16, 32]


def add_service_arguments(parser: argparse.ArgumentParser) -> None:
    from treeserve.services.launch import DEFAULT_CONFIG, DEFAULT_CONTROL_PLANE_NICE

    group = parser.add_argument_group("service (--service: through gRPC instead of in-process)")
    group.add_argument("--service", action="store_true",
                       help="measure the gRPC service (Ray Serve) under concurrent streams instead of the "
                            "in-process methods: aggregate tokens/s, TTFT and ITL p50/p95, errors, equality with "
                            "in-process greedy (uses --prompts, --max-new-tokens, --target, --drafter, "
                            "--warmup-prompts, --json-out)")
    group.add_argument("--config", default=str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None,
                       help="Serve config YAML of the service (default: deploy/local-cpu.yaml)")
    group.add_argument("--concurrency", type=int, nargs="+", default=CONCURRENCY,
                       help="concurrent streams per level, one prompt each (default: %(default)s)")
    group.add_argument("--service-rounds", type=int, default=1,
                       help="timed rounds per level (same prompts), summed (default: %(default)s)")
    group.add_argument("--service-method", default=None,
                       help="tree method of the service (default: the config's speculation.method)")
    group.add_argument("--service-budget", default=None,
                       help="budget of the service, 'auto' or an integer (default: the config's)")
    group.add_argument("--service-max-batch-size", type=int, default=None,
                       help="limits.max_batch_size of the service (default: the config's, raised to the "
                            "largest --concurrency)")
    group.add_argument("--control-plane-nice", type=int, default=DEFAULT_CONTROL_PLANE_NICE,
                       help="niceness of Ray's control plane (as `treeserve serve`; 0 = unchanged; default: %(default)s)")


@dataclass
class StreamRecord:
    """One GenerateStream call as the client saw it."""

    index: int  # prompt index
    sent: float = 0.0  # perf_counter at the call
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, tokens) per message with tokens
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # gRPC status code name
    mal: float = 0.0  # the service's own statistics
    ended: float = 0.0

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0][0] - self.sent if self.arrivals else None


def inter_token_latencies(arrivals: list[tuple[float, int]]) -> list[float]:
    """Per token after the first message: the gap since the previous message over the tokens it carries."""
    out: list[float] = []
    for (t0, _), (t1, n) in zip(arrivals, arrivals[1:]):
        out += [(t1 - t0) / n] * n
    return out


def percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


def summarize_level(streams: int, records: list[StreamRecord], wall_s: float, check) -> dict:
    """One table row from the records of every timed round at one concurrency level (`check`: a GreedyCheck
    already fed with this level's streams)."""
    ok = [r for r in records if r.error is None]
    tokens = sum(len(r.token_ids) for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in inter_token_latencies(r.arrivals)]
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    per_stream = [len(r.token_ids) / (r.ended - r.sent) for r in ok if r.ended > r.sent]
    return {"streams": streams, "requests": len(records), "errors": sum(errors.values()), "error_codes": errors,
            "tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s if wall_s else 0.0,
            "stream_tokens_per_s": sum(per_stream) / len(per_stream) if per_stream else float("nan"),
            "ttft_ms_p50": 1e3 * percentile(ttft, 50), "ttft_ms_p95": 1e3 * percentile(ttft, 95),
            "itl_ms_p50": 1e3 * percentile(itl, 50), "itl_ms_p95": 1e3 * percentile(itl, 95),
            "mal": sum(r.mal for r in ok) / len(ok) if ok else float("nan"),
            "greedy_compared": check.compared, "greedy_mismatches": check.mismatches,
            "greedy_tie_divergences": check.tie_divergences}


def open_api_channel(address: str):
    """A channel to the public API (plaintext; the bench's own local service)."""
    try:
        from treeserve.services.client import open_channel
    except ImportError:  # older trees: no client module
        import grpc

        from treeserve.services.transport.replica_server import channel_options

        return grpc.insecure_channel(address, options=channel_options())
    return open_channel(address)


def api_metadata(application: str | None) -> list[tuple[str, str]]:
    """The bearer token ($TREESERVE_TOKEN, if the API wants one) and the Serve application name."""
    metadata: list[tuple[str, str]] = []
    try:
        from treeserve.services.client import auth_metadata, read_token

        metadata += auth_metadata(read_token(None))
    except ImportError:
        pass
    return metadata + ([("application", application)] if application else [])


def stream_round(address: str, prompts: list[list[int]], max_new_tokens: int, application: str | None = None,
                 timeout_s: float = 600.0) -> tuple[list[StreamRecord], float]:
    """len(prompts) GenerateStream calls at once (a barrier releases them together) -> records, round wall s."""
    import grpc

    from treeserve.v1 import generation_pb2 as gen
    from treeserve.v1 import generation_pb2_grpc as gen_grpc

    records = [StreamRecord(i) for i in range(len(prompts))]
    metadata = api_metadata(application)
    barrier = threading.Barrier(len(prompts) + 1)

    def call(record: StreamRecord, prompt: list[int]) -> None:
        request = gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), max_new_tokens=max_new_tokens)
        with open_api_channel(address) as channel:
            stub = gen_grpc.TreeServeStub(channel)
            barrier.wait()
            record.sent = time.perf_counter()
            try:
                for message in stub.GenerateStream(request, metadata=metadata, timeout=timeout_s):
                    if message.token_ids:
                        record.arrivals.append((time.perf_counter(), len(message.token_ids)))
                        record.token_ids += list(message.token_ids)
                    if message.HasField("stats"):
                        record.mal = message.stats.mean_accepted_length
            except grpc.RpcError as exc:
                record.error = exc.code().name
            record.ended = time.perf_counter()

    threads = [threading.Thread(target=call, args=(r, p), daemon=True) for r, p in zip(records, prompts)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    return records, max((r.ended for r in records), default=started) - started


def measure(address: str, prompts: list[list[int]], references: list[tuple[list[int], list[float]]],
            concurrency: list[int], max_new_tokens: int, rounds: int = 1, warmup: bool = True,
            application: str | None = None, progress: bool = True) -> list[dict]:
    """Every level: an untimed warm-up round (if `warmup`), then `rounds` timed rounds -> one summary each.
    Level N streams prompts[0:N]; `references` are the target's greedy answers to `prompts`."""
    from tqdm import tqdm

    from treeserve.engine.bench import GreedyCheck

    if max(concurrency) > len(prompts):
        raise ValueError(f"{max(concurrency)} streams need as many prompts, got {len(prompts)}")
    levels = []
    with tqdm(total=sum(n * (rounds + int(warmup)) for n in concurrency), desc="service streams",
              disable=not progress) as bar:
        for n in concurrency:
            if warmup:
                stream_round(address, prompts[:n], max_new_tokens, application)
                bar.update(n)
            records, wall = [], 0.0
            check = GreedyCheck()
            for _ in range(rounds):
                got, seconds = stream_round(address, prompts[:n], max_new_tokens, application)
                records += got
                wall += seconds
                for r in got:
                    if r.error is None:
                        check.compare(*references[r.index], r.token_ids)
                bar.update(n)
            levels.append(summarize_level(n, records, wall, check))
    return levels


def service_table(levels: list[dict], title: str):
    from rich.table import Table

    table = Table(title=title)
    for col in ("streams", "requests", "errors", "tokens", "agg tok/s", "tok/s per stream", "TTFT p50 ms",
                "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms", "MAL", "= in-process greedy"):
        table.add_column(col, justify="right")
    for lv in levels:
        equal = lv["greedy_compared"] - lv["greedy_mismatches"] - lv["greedy_tie_divergences"]
        ties = f" ({lv['greedy_tie_divergences']} at near-ties)" if lv["greedy_tie_divergences"] else ""
        table.add_row(str(lv["streams"]), str(lv["requests"]), str(lv["errors"]), str(lv["tokens"]),
                      f"{lv['tokens_per_s']:.1f}", f"{lv['stream_tokens_per_s']:.1f}", f"{lv['ttft_ms_p50']:.0f}",
                      f"{lv['ttft_ms_p95']:.0f}", f"{lv['itl_ms_p50']:.0f}", f"{lv['itl_ms_p95']:.0f}",
                      f"{lv['mal']:.2f}", f"{equal}/{lv['greedy_compared']}{ties}")
    return table


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_service(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from tqdm import tqdm

    from treeserve.engine.bench import greedy_reference
    from treeserve.engine.models.loading import chat_ids, load_causal_lm
    from treeserve.engine.dev_prompts import load_prompts
    from treeserve.services.launch import load_config, start_service, stop_service

    if args.service_rounds < 1 or args.max_new_tokens < 1 or min(args.concurrency) < 1:
        raise ValueError("--service-rounds, --max-new-tokens and --concurrency must be >= 1")
    if args.temperature != 0:
        raise ValueError("--service measures greedy streams: --temperature must be 0")
    torch.set_num_threads(args.threads)
    most = max(args.concurrency)
    rows = load_prompts(args.prompts, most)
    if len(rows) < most:
        raise ValueError(f"--concurrency {most} needs {most} prompts; {args.prompts} holds {len(rows)}")
    target = load_causal_lm(args.target)
    prompts = [chat_ids(target.tokenizer, r["turns"][0]) for r in rows]
    references = [greedy_reference(target.model, p, args.max_new_tokens)
                  for p in tqdm(prompts, desc="in-process greedy references")]
    del target
    config = load_config(args.config, method=args.service_method, budget=args.service_budget, target=args.target,
                         drafter=args.drafter, grpc_port=_free_port())
    limits = config.app.args.limits
    limits.max_concurrent_requests = max(limits.max_concurrent_requests, most)
    limits.max_batch_size = args.service_max_batch_size or max(limits.max_batch_size, most)
    limits.max_new_tokens = max(limits.max_new_tokens, args.max_new_tokens)
    spec = config.app.args.speculation
    print(f"starting the service ({args.config or 'built-in defaults'}: method {spec.method}, budget {spec.budget}, "
          f"drafter {config.app.args.drafter.path}, max batch {limits.max_batch_size})")
    service = start_service(config, quiet=True, control_plane_nice=args.control_plane_nice)
    try:
        levels = measure(service.address, prompts, references, args.concurrency, args.max_new_tokens,
                         args.service_rounds, args.warmup_prompts > 0, service.app_name)
    finally:
        stop_service(service)
    title = (f"service: {len(args.concurrency)} levels x {args.service_rounds} round(s), {args.max_new_tokens} "
             f"tokens per stream, method {spec.method}:{spec.budget}, drafter {config.app.args.drafter.path} (MEASURED)")
    Console(width=200).print(service_table(levels, title))
    if args.json_out:
        args.json_out.write_text(json.dumps({
            "config": {"serve_config": args.config, "method": spec.method, "budget": str(spec.budget),
                       "target": str(args.target), "drafter": str(config.app.args.drafter.path),
                       "max_new_tokens": args.max_new_tokens, "rounds": args.service_rounds,
                       "max_batch_size": limits.max_batch_size},
            "levels": levels}, indent=1))
    return 1 if any(lv["greedy_mismatches"] or lv["errors"] for lv in levels) else 0
