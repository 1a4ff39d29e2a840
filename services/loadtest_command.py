"""`treeserve loadtest`: a bounded soak test of the public gRPC API on this machine.

    treeserve loadtest --streams 32 --duration 600                  # the full soak (starts the service itself)
    treeserve loadtest --streams 8 --duration 90 --kill Drafter     # a short one
    treeserve loadtest --address 127.0.0.1:9000 --kill none          # against a running service (loopback only)

It starts the service from `--config` (deploy/local-cpu.yaml), computes the target's own greedy answer to every
prompt in-process, then keeps `--streams` concurrent clients busy for `--duration` seconds with a mix of
requests: every tree method, greedy and sampled, streamed and unary; `--malformed` of them malformed (garbage
bytes, empty prompt, bad sampling, unknown method, token ids outside the vocabulary, too many new tokens) and
`--cancel` of them cancelled by the client after a message or two. Halfway through (`--kill-at`) it kills one
replica of `--kill` (Target by default) through Ray and measures how long the streams in flight stalled.

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
import math
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from treeserve.services.serve_command import DEFAULT_CONFIG, REPO_ROOT

METHOD_NAMES = ("autoregressive", "chain", "static", "eagle2", "dyspec", "dyspec_threshold", "opt_tree", "c2t")
PROMPTS_FILE = REPO_ROOT / "benchmarks" / "data" / "spec_bench_dev.jsonl"
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
MALFORMED_KINDS = ("garbage", "empty_prompt", "negative_temperature", "unknown_method", "token_out_of_vocab",
                   "too_many_new_tokens", "bad_top_p")


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
    parser.add_argument("--methods", nargs="+", default=list(METHOD_NAMES), choices=METHOD_NAMES,
                        help="tree methods to mix (default: all)")
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
    parser.add_argument("--tie-epsilon", type=float, default=1e-3, help="top-2 logit gap under which a greedy "
                        "divergence counts as a near tie (default: %(default)s)")
    parser.add_argument("--tls-ca", default=None, help="with --address: PEM CA to trust (TLS)")
    parser.add_argument("--tls-server-name", default=None, help="with --address: the certificate's host name")
    parser.add_argument("--token-file", default=None, help="bearer token file (default: $TREESERVE_TOKEN)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the report as JSON here")
    parser.add_argument("--ready-timeout", type=float, default=900.0)


# ================================================================================================ records
@dataclass
class Outcome:
    kind: str  # "greedy", "sampled", "cancel", "malformed:<kind>"
    method: str = ""
    prompt: int = -1
    max_new_tokens: int = 0
    streamed: bool = True
    started: float = 0.0
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (monotonic, tokens) per message with tokens
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: int = 0
    stats_tokens: int = -1
    code: str = "OK"
    details: str = ""
    expected_code: str = "OK"
    refusals: int = 0  # RESOURCE_EXHAUSTED (router full) before it was admitted
    unavailable_retries: int = 0  # UNAVAILABLE before any token (no router listening): sent again
    ended: float = 0.0
    verdict: str = ""  # for valid requests: ok / lost / corrupted / near_tie


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


# ================================================================================================ prompts
def load_prompts(count: int) -> list[str]:
    """First turns of Spec-Bench dev questions, taking categories in turn."""
    by_category: dict[str, list[str]] = {}
    for line in PROMPTS_FILE.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_category.setdefault(row["category"], []).append(row["turns"][0])
    out: list[str] = []
    while len(out) < count and any(by_category.values()):
        for texts in by_category.values():
            if texts and len(out) < count:
                out.append(texts.pop(0))
    return out


class Reference:
    """The target's own greedy answers (in-process, one sequence at a time) and the near-tie check."""

    def __init__(self, target_path: str, dtype: str):
        import torch

        from treeserve.engine.factory import build_engine

        torch.set_num_threads(1)
        self.engine = build_engine(target_path, method="autoregressive", dtype=dtype)
        self.tokenizer = self.engine.tokenizer
        self.vocab = int(self.engine.target.vocab_size)
        self.eos = set(self.engine.eos_ids)

    def prompt_ids(self, text: str) -> list[int]:
        return self.engine.encode_chat(text)

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        from treeserve.engine.requests import GenerationRequest

        return self.engine.generate([GenerationRequest(prompt, max_new_tokens=max_new_tokens)])[0].token_ids

    def top2_gap(self, ids: list[int]) -> float:
        """logit(top1) - logit(top2) of the token after `ids`."""
        import torch

        model = self.engine.target.lm.model if hasattr(self.engine.target, "lm") else self.engine.target.model
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        return float(top[0] - top[1])


# ================================================================================================ the run
class LoadTest:
    def __init__(self, args: argparse.Namespace, address: str, reference: Reference, prompts: list[list[int]],
                 greedy_budget: list[int], expected: list[list[int]], limit_new: int, tls: dict, token: str | None):
        self.args = args
        self.address = address
        self.ref = reference
        self.prompts = prompts
        self.greedy_budget = greedy_budget
        self.expected = expected
        self.limit_new = limit_new
        self.tls = tls
        self.token = token
        self.rng = random.Random(args.seed)
        lo, hi = (int(x) for x in args.max_new_tokens.split(":"))
        self.new_range = (lo, hi)
        self.outcomes: list[Outcome] = []
        self.started = 0
        self.kill_time: float | None = None
        self.kill_note = ""

    # -------------------------------------------------------------- one request
    def _metadata(self) -> list[tuple[str, str]]:
        from treeserve.services.client import auth_metadata

        return auth_metadata(self.token)

    def _valid_request(self, out: Outcome):
        from treeserve.services.validation import METHOD_ENUMS
        from treeserve.v1 import generation_pb2 as gen

        sampling = gen.SamplingParams()
        if out.kind == "sampled" or (out.kind == "cancel" and self.rng.random() < 0.5):
            sampling = gen.SamplingParams(temperature=self.rng.choice([0.7, 1.0]), top_p=self.rng.choice([0.0, 0.9]),
                                          top_k=self.rng.choice([0, 40]), seed=self.rng.randrange(1, 2 ** 31))
        return gen.GenerateRequest(token_ids=gen.TokenIds(ids=self.prompts[out.prompt]),
                                   max_new_tokens=out.max_new_tokens, sampling=sampling,
                                   speculation=gen.SpeculationParams(method=METHOD_ENUMS[out.method]))

    def _malformed(self, kind: str):
        """(request message or raw bytes, expected status code name)."""
        from treeserve.v1 import generation_pb2 as gen

        prompt = gen.TokenIds(ids=self.prompts[0])
        if kind == "garbage":
            return bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(1, 64))) + b"\xff", \
                "INVALID_ARGUMENT"
        return {
            "empty_prompt": (gen.GenerateRequest(text="   ", max_new_tokens=4), "INVALID_ARGUMENT"),
            "negative_temperature": (gen.GenerateRequest(token_ids=prompt, max_new_tokens=4,
                                                         sampling=gen.SamplingParams(temperature=-1)),
                                     "INVALID_ARGUMENT"),
            "unknown_method": (gen.GenerateRequest(token_ids=prompt, max_new_tokens=4,
                                                   speculation=gen.SpeculationParams(method=99)), "INVALID_ARGUMENT"),
            "token_out_of_vocab": (gen.GenerateRequest(token_ids=gen.TokenIds(ids=[self.ref.vocab + 7]),
                                                       max_new_tokens=4), "INVALID_ARGUMENT"),
            "too_many_new_tokens": (gen.GenerateRequest(token_ids=prompt, max_new_tokens=self.limit_new + 1),
                                    "RESOURCE_EXHAUSTED"),
            "bad_top_p": (gen.GenerateRequest(token_ids=prompt, max_new_tokens=4,
                                              sampling=gen.SamplingParams(temperature=1.0, top_p=1.5)),
                          "INVALID_ARGUMENT"),
        }[kind]

    async def _call(self, stub, channel, out: Outcome, message) -> None:
        """Send one request (retrying while the router is full), filling `out`."""
        import grpc

        from treeserve.v1 import generation_pb2 as gen

        deadline = time.monotonic() + self.args.request_timeout
        while True:
            out.started = time.monotonic()
            out.arrivals.clear()
            out.tokens.clear()
            out.text = ""
            try:
                if isinstance(message, bytes):
                    raw = channel.unary_unary("/treeserve.v1.TreeServe/Generate", request_serializer=None,
                                              response_deserializer=None)
                    await raw(message, metadata=self._metadata(), timeout=30)
                elif not out.streamed:
                    reply = await stub.Generate(message, metadata=self._metadata(),
                                                timeout=max(1.0, deadline - time.monotonic()))
                    out.arrivals.append((time.monotonic(), len(reply.token_ids)))
                    out.tokens = list(reply.token_ids)
                    out.text, out.finish, out.stats_tokens = reply.text, reply.finish_reason, reply.stats.completion_tokens
                else:
                    call = stub.GenerateStream(message, metadata=self._metadata(),
                                               timeout=max(1.0, deadline - time.monotonic()))
                    cancel_after = self.rng.randint(1, 3) if out.kind == "cancel" else None
                    seen = 0
                    async for reply in call:
                        if reply.token_ids:
                            out.arrivals.append((time.monotonic(), len(reply.token_ids)))
                        out.tokens.extend(reply.token_ids)
                        out.text += reply.text_delta
                        seen += 1
                        if reply.finish_reason != gen.FINISH_REASON_UNSPECIFIED:
                            out.finish, out.stats_tokens = reply.finish_reason, reply.stats.completion_tokens
                        if cancel_after is not None and seen >= cancel_after:
                            call.cancel()
                            out.code = "CANCELLED"
                            return
                out.code = "OK"
                return
            except grpc.aio.AioRpcError as exc:
                out.code, out.details = exc.code().name, exc.details() or ""
                if out.code == "RESOURCE_EXHAUSTED" and out.expected_code == "OK" and \
                        "too many concurrent requests" in out.details and time.monotonic() < deadline - 1:
                    out.refusals += 1
                    await asyncio.sleep(0.2 + 0.3 * self.rng.random())
                    continue
                if out.code == "UNAVAILABLE" and not out.arrivals and not isinstance(message, bytes) and \
                        time.monotonic() < deadline - 1:
                    # Nothing received yet (no router listening, e.g. while Serve restarts it): safe to resend.
                    out.unavailable_retries += 1
                    await asyncio.sleep(0.5)
                    continue
                if out.code == "CANCELLED" and out.kind == "cancel":
                    return
                return

    def _next(self) -> tuple[Outcome, object]:
        a = self.args
        r = self.rng.random()
        if r < a.malformed:
            kind = self.rng.choice(MALFORMED_KINDS)
            message, code = self._malformed(kind)
            return Outcome(kind=f"malformed:{kind}", expected_code=code, method="none"), message
        kind = "cancel" if r < a.malformed + a.cancel else ("sampled" if self.rng.random() < a.sampled else "greedy")
        prompt = self.rng.randrange(len(self.prompts))
        new = self.greedy_budget[prompt] if kind == "greedy" else self.rng.randint(*self.new_range)
        out = Outcome(kind=kind, method=self.rng.choice(a.methods), prompt=prompt, max_new_tokens=new,
                      streamed=kind == "cancel" or self.rng.random() >= a.unary,
                      expected_code="CANCELLED" if kind == "cancel" else "OK")
        return out, self._valid_request(out)

    async def _worker(self, end: float) -> None:
        from treeserve.services.client import open_channel
        from treeserve.v1 import generation_pb2_grpc as gen_grpc

        async with open_channel(self.address, aio=True, **self.tls) as channel:
            stub = gen_grpc.TreeServeStub(channel)
            while time.monotonic() < end and self.started < self.args.max_requests:
                self.started += 1
                out, message = self._next()
                await self._call(stub, channel, out, message)
                out.ended = time.monotonic()
                self.outcomes.append(out)

    async def _killer(self, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        deployment = self.args.kill
        try:
            name = await asyncio.to_thread(kill_replica, deployment)
            self.kill_time = time.monotonic()
            self.kill_note = f"killed {name}"
        except Exception as exc:  # reported, the run goes on
            self.kill_note = f"kill failed: {exc}"
        print(f"[{time.strftime('%H:%M:%S')}] {self.kill_note}", file=sys.stderr)

    async def run(self) -> float:
        a = self.args
        t0 = time.monotonic()
        end = t0 + a.duration
        tasks = [asyncio.create_task(self._worker(end)) for _ in range(a.streams)]
        if a.kill != "none":
            tasks.append(asyncio.create_task(self._killer(t0 + a.kill_at * a.duration)))
        progress = asyncio.create_task(self._progress(t0, end))
        # Bounded drain: in-flight calls have their own deadlines; past this everything is cancelled.
        done, pending = await asyncio.wait(tasks, timeout=a.duration + a.request_timeout + 30)
        for task in pending:
            task.cancel()
        progress.cancel()
        return time.monotonic() - t0

    async def _progress(self, t0: float, end: float) -> None:
        while time.monotonic() < end:
            await asyncio.sleep(30)
            codes = Counter(o.code for o in self.outcomes)
            print(f"[{time.monotonic() - t0:5.0f} s] {len(self.outcomes)} requests done "
                  f"({', '.join(f'{k} {v}' for k, v in codes.most_common())})", file=sys.stderr)

    # -------------------------------------------------------------- verdicts
    def judge(self) -> None:
        from treeserve.v1 import generation_pb2 as gen

        eos = self.ref.eos
        for out in self.outcomes:
            if out.kind.startswith("malformed") or out.kind == "cancel":
                out.verdict = "ok" if out.code == out.expected_code or (
                    out.kind == "cancel" and out.code == "OK") else "unexpected_status"
                continue
            if out.code != "OK" or out.finish == gen.FINISH_REASON_UNSPECIFIED:
                cut = (self.args.kill == "Router" and out.code == "UNAVAILABLE" and self.kill_time is not None
                       and out.started <= self.kill_time <= out.ended)
                # A Router's death ends the streams it carried (their connections die with it): by design. A
                # deadline (the service's limits.request_timeout_s or this client's) is a verdict on the box's
                # speed, not a lost output: reported apart.
                out.verdict = ("cut_by_router_kill" if cut else
                               "timed_out" if out.code == "DEADLINE_EXCEEDED" else "lost")
                continue
            consistent = (out.stats_tokens == len(out.tokens) <= out.max_new_tokens
                          and all(0 <= t < self.ref.vocab for t in out.tokens)
                          and (out.finish != gen.FINISH_REASON_LENGTH or len(out.tokens) == out.max_new_tokens)
                          and (out.finish != gen.FINISH_REASON_EOS or (out.tokens and out.tokens[-1] in eos)))
            if not consistent:
                out.verdict = "corrupted"
            elif out.kind == "greedy":
                out.verdict = self._greedy_verdict(out)
            else:
                out.verdict = "ok"

    def _greedy_verdict(self, out: Outcome) -> str:
        expected = self.expected[out.prompt]
        if out.tokens == expected:
            return "ok"
        k = next((i for i, (x, y) in enumerate(zip(out.tokens, expected)) if x != y), min(len(out.tokens),
                                                                                          len(expected)))
        if k < min(len(out.tokens), len(expected)):
            gap = self.ref.top2_gap(self.prompts[out.prompt] + expected[:k])
            if gap < self.args.tie_epsilon:
                return "near_tie"
        return "corrupted"

    # -------------------------------------------------------------- report
    def report(self, wall_s: float) -> dict:
        valid = [o for o in self.outcomes if o.kind in ("greedy", "sampled")]
        by_status: Counter = Counter()
        for o in self.outcomes:
            label = o.code
            if o.kind.startswith("malformed"):
                label += " (malformed, expected)" if o.code == o.expected_code else " (malformed, UNEXPECTED)"
            elif o.kind == "cancel":
                label += " (client cancel)"
            by_status[label] += 1
        refusals = sum(o.refusals for o in self.outcomes)
        if refusals:
            by_status["RESOURCE_EXHAUSTED (router full, retried)"] = refusals
        unavailable = sum(o.unavailable_retries for o in self.outcomes)
        if unavailable:
            by_status["UNAVAILABLE before any token (retried)"] = unavailable
        verdicts = Counter(o.verdict for o in self.outcomes)
        ttft = [(o.arrivals[0][0] - o.started) * 1e3 for o in valid if o.code == "OK" and o.arrivals]
        itl: list[float] = []
        for o in valid:
            if o.streamed and o.code == "OK":
                for (t0, _), (t1, n) in zip(o.arrivals, o.arrivals[1:]):
                    itl += [(t1 - t0) * 1e3 / n] * n
        stalls, resumes = [], []  # per stream in flight across the kill: gap spanning it; kill -> next message
        first_after = None
        if self.kill_time is not None:
            for o in self.outcomes:
                before = [t for t, _ in o.arrivals if t <= self.kill_time]
                after = [t for t, _ in o.arrivals if t > self.kill_time]
                if before and after:
                    stalls.append((after[0] - before[-1]) * 1e3)
                    resumes.append((after[0] - self.kill_time) * 1e3)
                if after:
                    first_after = min(first_after or after[0], after[0])
        tokens = sum(len(o.tokens) for o in valid if o.code == "OK")
        return {
            "streams": self.args.streams, "duration_s": self.args.duration, "wall_s": wall_s,
            "methods": self.args.methods, "requests": len(self.outcomes), "tokens": tokens,
            "tokens_per_s": tokens / wall_s if wall_s else 0.0,
            "by_status": dict(by_status.most_common()),
            "valid": {"greedy": sum(o.kind == "greedy" for o in valid), "sampled": sum(o.kind == "sampled" for o in valid)},
            "lost": verdicts.get("lost", 0), "corrupted": verdicts.get("corrupted", 0),
            "near_tie": verdicts.get("near_tie", 0), "unexpected_status": verdicts.get("unexpected_status", 0),
            "cut_by_router_kill": verdicts.get("cut_by_router_kill", 0), "timed_out": verdicts.get("timed_out", 0),
            "lost_examples": [f"{o.kind} {o.method}: {o.code} {o.details[:120]}" for o in self.outcomes
                              if o.verdict == "lost"][:5],
            "corrupted_examples": [f"{o.kind} {o.method} prompt {o.prompt}" for o in self.outcomes
                                   if o.verdict == "corrupted"][:5],
            "ttft_ms": {q: percentile(ttft, q) for q in (50, 95, 99)},
            "itl_ms": {q: percentile(itl, q) for q in (50, 95, 99)},
            "kill": {"deployment": self.args.kill, "note": self.kill_note, "streams_in_flight": len(stalls),
                     "stall_ms_p50": percentile(stalls, 50), "stall_ms_max": max(stalls) if stalls else float("nan"),
                     "resume_ms_p50": percentile(resumes, 50),
                     "resume_ms_max": max(resumes) if resumes else float("nan"),
                     "first_token_after_kill_ms": (first_after - self.kill_time) * 1e3
                     if first_after is not None and self.kill_time is not None else float("nan")},
        }


def format_report(r: dict) -> str:
    lines = [f"TreeServe loadtest: {r['streams']} streams, {r['duration_s']:.0f} s of load ({r['wall_s']:.0f} s with "
             f"the drain), methods {', '.join(r['methods'])}",
             f"{r['requests']} requests, {r['tokens']} tokens generated ({r['tokens_per_s']:.1f} tokens/s)", "",
             "requests by final status (client side)"]
    lines += [f"  {label:<48} {count:>7}" for label, count in r["by_status"].items()]
    lines += ["", f"outputs: {r['valid']['greedy']} greedy (compared with in-process greedy), {r['valid']['sampled']} "
                  f"sampled (checked for consistency)",
              f"  lost {r['lost']}, corrupted {r['corrupted']}, near-tie divergences {r['near_tie']}, unexpected "
              f"statuses {r['unexpected_status']}"
              + (f", ended by the Router's death (UNAVAILABLE) {r['cut_by_router_kill']}"
                 if r["cut_by_router_kill"] else "")
              + (f", timed out (DEADLINE_EXCEEDED: admitted but not finished within the deadline; the box is "
                 f"slower than the load) {r['timed_out']}" if r["timed_out"] else "")]
    for key in ("lost_examples", "corrupted_examples"):
        lines += [f"    {key[:-9]}: {e}" for e in r[key]]
    lines += ["", f"  {'latency (ms)':<24} {'p50':>8} {'p95':>8} {'p99':>8}"]
    for name, key in (("time to first token", "ttft_ms"), ("inter-token latency", "itl_ms")):
        q = r[key]
        lines.append(f"  {name:<24} {q[50]:>8.1f} {q[95]:>8.1f} {q[99]:>8.1f}")
    k = r["kill"]
    if k["deployment"] != "none":
        lines += ["", f"kill: {k['note'] or 'not done'}",
                  f"  {k['streams_in_flight']} streams in flight across it: next message {k['resume_ms_p50']:.0f} ms "
                  f"after the kill (p50), {k['resume_ms_max']:.0f} ms (max); gap spanning the kill p50 "
                  f"{k['stall_ms_p50']:.0f} ms, max {k['stall_ms_max']:.0f} ms (normal gaps included); first token "
                  f"of any stream {k['first_token_after_kill_ms']:.0f} ms after the kill"]
    return "\n".join(lines)


def kill_replica(deployment: str) -> str:
    """Kill one replica actor of `deployment` (Serve starts a new one); returns its actor name."""
    import ray

    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["namespace"] == "serve" and f"#{deployment}#" in a["name"])
    if not names:
        raise RuntimeError(f"no {deployment} replica found")
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0]


def _loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host in LOOPBACK or host.startswith("127.")


def run(args: argparse.Namespace) -> int:
    from treeserve.services.cli import CliError
    from treeserve.services.client import read_token
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
    token = read_token(args.token_file)
    tls = {}
    if args.address is not None:
        if not _loopback(args.address):
            raise CliError(f"--address {args.address}: the load test only sends traffic to a loopback address")
        if args.kill != "none" and args.ray_address is None:
            raise CliError("--kill needs --ray-address with --address (or use --kill none)")
        address = args.address
        tls = dict(tls_ca_file=args.tls_ca, server_name=args.tls_server_name)
        config = None
    else:
        config = _load(args)
        address = None
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
        from treeserve.services.serve_command import start_service

        print(f"starting the service from {args.config} ...", file=sys.stderr)
        service = start_service(config, quiet=True, ready_timeout_s=args.ready_timeout)
        address = service.address
    elif args.kill != "none":
        import ray

        ray.init(address=args.ray_address, log_to_driver=False)
    try:
        test = LoadTest(args, address, reference, prompts, budget, expected, limit_new, tls, token)
        print(f"load: {args.streams} streams for {args.duration:.0f} s on {address}", file=sys.stderr)
        wall = asyncio.run(test.run())
        test.judge()
        report = test.report(wall)
    finally:
        if service is not None:
            from treeserve.services.serve_command import stop_service

            stop_service(service)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["lost"] == report["corrupted"] == report["unexpected_status"] == 0 else 1


def _load(args: argparse.Namespace):
    from treeserve.services.app import config_to_args
    from treeserve.services.config import AppConfig
    from treeserve.services.serve_command import load_config

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


if __name__ == "__main__":  # pragma: no cover
    from treeserve.services.cli import main

    sys.exit(main(["loadtest", *sys.argv[1:]]))
