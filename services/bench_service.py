"""The gRPC service under concurrent streams, measured from the client side (`treeserve bench --service`,
cli/bench.py, which starts the service or points at a running one with `--address`).

For every concurrency level N, `measure` sends every prompt once through N concurrent GenerateStream clients
(one thread and channel each, released together; a client sends its next prompt when its last one ends, as
serving benchmarks' max-concurrency mode does), as token ids so both sides decode exactly the same prompt,
greedy, `max_new_tokens` tokens. Per level it reports:

- aggregate tokens/s: tokens of all streams / wall time from the first send to the last stream's end
  (summed over the timed rounds);
- time to first token (TTFT), p50 / p95: send -> first message carrying tokens;
- inter-token latency (ITL), p50 / p95, over tokens: a message carrying k tokens that arrives g seconds after
  the previous one gives each of its k tokens an ITL of g / k (a speculative step emits several tokens at
  once; a plain step one);
- errors: streams that ended in a gRPC error (status code counted);
- MAL from the service's own statistics;
- equality with in-process greedy: every stream's tokens against the target's own greedy `generate` on the
  same prompt (engine/bench/greedy.py GreedyCheck: divergence allowed only at near-tied top-2 logits).

A warm-up round (untimed) may run at each level first, so the hardware-aware budget choosers (batch 1 and per
batch size) have finished exploring.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONCURRENCY = [1, 8, 16, 32]


@dataclass
class StreamRecord:
    """One GenerateStream call as the client saw it."""

    index: int  # prompt index
    sent: float = 0.0  # perf_counter at the call
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, tokens) per message with tokens
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # gRPC status code name
    mal: float = 0.0  # the service's own statistics
    tree_size: float = 0.0  # draft tokens per step the service chose for this request (its stats)
    steps: int = 0  # target forwards (stats)
    drafted_steps: int = 0  # of which steps with a tree (stats)
    run_ahead_hits: int = 0  # of which trees drafted ahead (stats)
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
            "tree_size": sum(r.tree_size * r.steps for r in ok) / max(1, sum(r.steps for r in ok)),
            "plain_step_share": 1 - sum(r.drafted_steps for r in ok) / max(1, sum(r.steps for r in ok)),
            "run_ahead_hit_rate": sum(r.run_ahead_hits for r in ok) / max(1, sum(r.drafted_steps for r in ok)),
            "greedy_compared": check.compared, "greedy_mismatches": check.mismatches,
            "greedy_tie_divergences": check.tie_divergences}


def stream_round(address: str, prompts: list[list[int]], max_new_tokens: int, application: str | None = None,
                 timeout_s: float = 600.0, tls: dict | None = None, token: str | None = None,
                 streams: int | None = None) -> tuple[list[StreamRecord], float]:
    """Every prompt once, through `streams` concurrent GenerateStream clients (default: one per prompt), each
    sending its next prompt as soon as its last one ended (a closed loop; a barrier starts them together)
    -> one record per prompt, round wall s. `tls`: keyword arguments of services.client.open_channel (none:
    plaintext); `token`: the bearer token; `application`: sent as 'application' metadata."""
    import grpc

    from treeserve.services.client import auth_metadata, open_channel
    from treeserve.v1 import generation_pb2 as gen
    from treeserve.v1 import generation_pb2_grpc as gen_grpc

    records = [StreamRecord(i) for i in range(len(prompts))]
    metadata = auth_metadata(token) + ([("application", application)] if application else [])
    streams = min(streams or len(prompts), len(prompts))
    barrier = threading.Barrier(streams + 1)
    queue = iter(records)
    queue_lock = threading.Lock()

    def call(stub, record: StreamRecord) -> None:
        request = gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompts[record.index]), max_new_tokens=max_new_tokens)
        record.sent = time.perf_counter()
        try:
            for message in stub.GenerateStream(request, metadata=metadata, timeout=timeout_s):
                if message.token_ids:
                    record.arrivals.append((time.perf_counter(), len(message.token_ids)))
                    record.token_ids += list(message.token_ids)
                if message.HasField("stats"):
                    stats = message.stats
                    record.mal, record.tree_size, record.steps = (stats.mean_accepted_length,
                                                                  stats.mean_tree_size_tokens, stats.steps)
                    record.drafted_steps, record.run_ahead_hits = stats.drafted_steps, stats.run_ahead_hits
        except grpc.RpcError as exc:
            record.error = exc.code().name
        record.ended = time.perf_counter()

    def client() -> None:
        with open_channel(address, **(tls or {})) as channel:
            stub = gen_grpc.TreeServeStub(channel)
            barrier.wait()
            while True:
                with queue_lock:
                    record = next(queue, None)
                if record is None:
                    return
                call(stub, record)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    return records, max((r.ended for r in records), default=started) - started


def measure(address: str, prompts: list[list[int]], references: list[tuple[list[int], list[float]]],
            concurrency: list[int], max_new_tokens: int, rounds: int = 1, warmup: bool = True,
            application: str | None = None, progress: bool = True, tls: dict | None = None,
            token: str | None = None) -> list[dict]:
    """Every level N: an untimed warm-up (if `warmup`: prompts[0:N] at once), then `rounds` timed rounds of
    every prompt through N concurrent streams (`stream_round`) -> one summary each. Every level sees the same
    prompts, so levels and methods compare on the same mix (one prompt at one stream would measure one
    category). `references` are the target's greedy answers to `prompts`; `tls` and `token` reach the API as
    in `stream_round`."""
    from tqdm import tqdm

    from treeserve.engine.bench.greedy import GreedyCheck

    if max(concurrency) > len(prompts):
        raise ValueError(f"{max(concurrency)} streams need as many prompts, got {len(prompts)}")
    levels = []
    with tqdm(total=sum(n * int(warmup) + len(prompts) * rounds for n in concurrency), desc="service streams",
              disable=not progress) as bar:
        for n in concurrency:
            if warmup:
                stream_round(address, prompts[:n], max_new_tokens, application, tls=tls, token=token)
                bar.update(n)
            records, wall = [], 0.0
            check = GreedyCheck()
            for _ in range(rounds):
                got, seconds = stream_round(address, prompts, max_new_tokens, application, tls=tls, token=token,
                                            streams=n)
                records += got
                wall += seconds
                for r in got:
                    if r.error is None:
                        check.compare(*references[r.index], r.token_ids)
                bar.update(len(prompts))
            levels.append(summarize_level(n, records, wall, check))
    return levels


def service_table(levels: list[dict], title: str):
    from rich.table import Table

    table = Table(title=title)
    for col in ("streams", "requests", "errors", "tokens", "agg tok/s", "tok/s per stream", "TTFT p50 ms",
                "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms", "MAL", "draft tok/step", "plain steps",
                "run-ahead hits", "= in-process greedy"):
        table.add_column(col, justify="right")
    for lv in levels:
        equal = lv["greedy_compared"] - lv["greedy_mismatches"] - lv["greedy_tie_divergences"]
        ties = f" ({lv['greedy_tie_divergences']} at near-ties)" if lv["greedy_tie_divergences"] else ""
        table.add_row(str(lv["streams"]), str(lv["requests"]), str(lv["errors"]), str(lv["tokens"]),
                      f"{lv['tokens_per_s']:.1f}", f"{lv['stream_tokens_per_s']:.1f}", f"{lv['ttft_ms_p50']:.0f}",
                      f"{lv['ttft_ms_p95']:.0f}", f"{lv['itl_ms_p50']:.0f}", f"{lv['itl_ms_p95']:.0f}",
                      f"{lv['mal']:.2f}", f"{lv.get('tree_size', 0.0):.2f}", f"{lv.get('plain_step_share', 0.0):.0%}",
                      f"{lv.get('run_ahead_hit_rate', 0.0):.0%}", f"{equal}/{lv['greedy_compared']}{ties}")
    return table
