"""A bounded soak test of the public gRPC API (`treeserve loadtest`, cli/loadtest.py, starts the service or
points it at one): concurrent clients with a mix of requests, a replica killed midway, and the verdicts.

`LoadTest` keeps `LoadTestOptions.streams` concurrent clients busy for `duration` seconds with a mix of
requests: every method of `methods`, greedy and sampled, streamed and unary; `malformed` of them malformed
(garbage bytes, empty prompt, bad sampling, unknown method, token ids outside the vocabulary, too many new
tokens) and `cancel` of them cancelled by the client after a message or two. At `kill_at` it kills one replica
of `kill` through Ray. `judge` gives every valid request a verdict against the target's own greedy answer
computed in-process (`Reference`): ok, lost, corrupted, or a near-tie divergence (engine/greedy_rule.py's rule:
the top two logits within `tie_epsilon`). A request refused with RESOURCE_EXHAUSTED because the router was full
is retried after a short pause (what a client should do); those refusals are counted, not lost. Each request is a
services/client_harness.py `Stream`; services/loadtest_report.py turns the outcomes into the report.

Bounded in every way: requests start only until the duration ends (and at most `max_requests`), every call
has a deadline, and the drain after the end is capped.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass

from treeserve.engine.dev_prompts import DEV_PROMPTS
from treeserve.engine.greedy_rule import TIE_GAP, greedy_verdict
from treeserve.engine.requests import GenerationRequest
from .client_harness import Stream, clock

MALFORMED_KINDS = ("garbage", "empty_prompt", "negative_temperature", "unknown_method", "token_out_of_vocab",
                   "too_many_new_tokens", "bad_top_p")
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host in LOOPBACK or host.startswith("127.")


# ================================================================================================ records
@dataclass
class Outcome(Stream):
    """One request as the client saw it (a unary reply counts as one arrival) and its verdict."""

    kind: str  # "greedy", "sampled", "cancel", "malformed:<kind>"
    method: str = ""
    prompt: int = -1
    max_new_tokens: int = 0
    streamed: bool = True
    text: str = ""
    finish: int = 0
    stats_tokens: int = -1
    code: str = "OK"
    details: str = ""
    expected_code: str = "OK"
    refusals: int = 0  # RESOURCE_EXHAUSTED (router full) before it was admitted
    unavailable_retries: int = 0  # UNAVAILABLE before any token (no router listening): sent again
    verdict: str = ""  # for valid requests: ok / lost / corrupted / near_tie


# ================================================================================================ prompts
def load_prompts(count: int) -> list[str]:
    """First turns of Spec-Bench dev questions, taking categories in turn."""
    by_category: dict[str, list[str]] = {}
    for line in DEV_PROMPTS.read_text().splitlines():
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
        return self.engine.generate([GenerationRequest(prompt, max_new_tokens=max_new_tokens)])[0].token_ids

    def top2_gap(self, ids: list[int]) -> float:
        """logit(top1) - logit(top2) of the token after `ids`."""
        import torch

        model = self.engine.target.runner.lm.model  # build_engine's in-process TargetRunner
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        return float(top[0] - top[1])


# ================================================================================================ the run
@dataclass
class LoadTestOptions:
    """The load's shape (`treeserve loadtest` fills it from its options)."""

    streams: int = 32  # concurrent clients
    duration: float = 600.0  # seconds during which requests start
    max_requests: int = 100_000  # requests at most
    methods: tuple[str, ...] = ()  # served methods (engine/methods.py) the valid requests pick from
    new_tokens: tuple[int, int] = (16, 64)  # inclusive range of max_new_tokens; each prompt's greedy requests use one
    sampled: float = 0.5  # fraction of valid requests that sample (temperature > 0)
    unary: float = 0.2  # fraction of valid requests sent as unary Generate
    malformed: float = 0.05  # fraction of malformed requests
    cancel: float = 0.05  # fraction of streams the client cancels
    kill: str = "none"  # deployment ("Target", "Drafter", "Router") one replica of which is killed once, or "none"
    kill_at: float = 0.5  # when, as a fraction of `duration`
    request_timeout: float = 300.0  # deadline of every call, seconds
    tie_epsilon: float = TIE_GAP  # top-2 logit gap under which a greedy divergence counts as a near tie
    seed: int = 0  # seeds the request mix


class LoadTest:
    def __init__(self, options: LoadTestOptions, address: str, reference: Reference, prompts: list[list[int]],
                 greedy_budget: list[int], expected: list[list[int]], limit_new: int, tls: dict, token: str | None):
        self.options = options
        self.address = address
        self.ref = reference
        self.prompts = prompts
        self.greedy_budget = greedy_budget
        self.expected = expected
        self.limit_new = limit_new
        self.tls = tls
        self.token = token
        self.rng = random.Random(options.seed)
        self.new_range = options.new_tokens
        self.outcomes: list[Outcome] = []
        self.started = 0
        self.kill_time: float | None = None
        self.kill_note = ""

    # -------------------------------------------------------------- one request
    def _metadata(self) -> list[tuple[str, str]]:
        from .client import auth_metadata

        return auth_metadata(self.token)

    def _valid_request(self, out: Outcome):
        from .validation import speculation_params
        from treeserve.v1 import generation_pb2 as gen

        sampling = gen.SamplingParams()
        if out.kind == "sampled" or (out.kind == "cancel" and self.rng.random() < 0.5):
            sampling = gen.SamplingParams(temperature=self.rng.choice([0.7, 1.0]), top_p=self.rng.choice([0.0, 0.9]),
                                          top_k=self.rng.choice([0, 40]), seed=self.rng.randrange(1, 2 ** 31))
        return gen.GenerateRequest(token_ids=gen.TokenIds(ids=self.prompts[out.prompt]),
                                   max_new_tokens=out.max_new_tokens, sampling=sampling,
                                   speculation=speculation_params(out.method))

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

        deadline = time.monotonic() + self.options.request_timeout
        while True:
            out.sent = clock()
            out.arrivals.clear()
            out.token_ids.clear()
            out.text = ""
            try:
                if isinstance(message, bytes):
                    raw = channel.unary_unary("/treeserve.v1.TreeServe/Generate", request_serializer=None,
                                              response_deserializer=None)
                    await raw(message, metadata=self._metadata(), timeout=30)
                elif not out.streamed:
                    reply = await stub.Generate(message, metadata=self._metadata(),
                                                timeout=max(1.0, deadline - time.monotonic()))
                    out.arrivals.append((clock(), len(reply.token_ids)))
                    out.token_ids = list(reply.token_ids)
                    out.text, out.finish, out.stats_tokens = reply.text, reply.finish_reason, reply.stats.completion_tokens
                else:
                    call = stub.GenerateStream(message, metadata=self._metadata(),
                                               timeout=max(1.0, deadline - time.monotonic()))
                    cancel_after = self.rng.randint(1, 3) if out.kind == "cancel" else None
                    seen = 0
                    async for reply in call:
                        out.receive(list(reply.token_ids))
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
                # A valid request (one the client means to cancel too) refused because the router is full is
                # retried; a malformed one's RESOURCE_EXHAUSTED is its expected answer.
                if out.code == "RESOURCE_EXHAUSTED" and not out.kind.startswith("malformed") and \
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
        a = self.options
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
        from .client import open_channel
        from treeserve.v1 import generation_pb2_grpc as gen_grpc

        async with open_channel(self.address, aio=True, **self.tls) as channel:
            stub = gen_grpc.TreeServeStub(channel)
            while time.monotonic() < end and self.started < self.options.max_requests:
                self.started += 1
                out, message = self._next()
                await self._call(stub, channel, out, message)
                out.ended = clock()
                self.outcomes.append(out)

    async def _killer(self, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        deployment = self.options.kill
        try:
            name = await asyncio.to_thread(kill_replica, deployment)
            self.kill_time = clock()
            self.kill_note = f"killed {name}"
        except Exception as exc:  # reported, the run goes on
            self.kill_note = f"kill failed: {exc}"
        print(f"[{time.strftime('%H:%M:%S')}] {self.kill_note}", file=sys.stderr)

    async def run(self) -> float:
        a = self.options
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
                cut = (self.options.kill == "Router" and out.code == "UNAVAILABLE" and self.kill_time is not None
                       and out.sent <= self.kill_time <= out.ended)
                # A Router's death ends the streams it carried (their connections die with it): by design. A
                # deadline (the service's limits.request_timeout_s or this client's) is a verdict on the box's
                # speed, not a lost output: reported apart.
                out.verdict = ("cut_by_router_kill" if cut else
                               "timed_out" if out.code == "DEADLINE_EXCEEDED" else "lost")
                continue
            consistent = (out.stats_tokens == len(out.token_ids) <= out.max_new_tokens
                          and all(0 <= t < self.ref.vocab for t in out.token_ids)
                          and (out.finish != gen.FINISH_REASON_LENGTH or len(out.token_ids) == out.max_new_tokens)
                          and (out.finish != gen.FINISH_REASON_EOS or (out.token_ids and out.token_ids[-1] in eos)))
            if not consistent:
                out.verdict = "corrupted"
            elif out.kind == "greedy":
                out.verdict = self._greedy_verdict(out)
            else:
                out.verdict = "ok"

    def _greedy_verdict(self, out: Outcome) -> str:
        expected = self.expected[out.prompt]
        verdict = greedy_verdict(expected, out.token_ids,
                                 lambda k: self.ref.top2_gap(self.prompts[out.prompt] + expected[:k]),
                                 self.options.tie_epsilon)
        return {"equal": "ok", "near_tie": "near_tie", "mismatch": "corrupted"}[verdict]


def kill_replica(deployment: str) -> str:
    """Kill one replica actor of `deployment` (Serve starts a new one); returns its actor name."""
    import ray

    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["namespace"] == "serve" and f"#{deployment}#" in a["name"])
    if not names:
        raise RuntimeError(f"no {deployment} replica found")
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0]
