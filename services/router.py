"""The Router: request admission, continuous batching and streaming over the speculative engine.

One background step loop per router awaits `SpeculativeEngine.step` on the active sequences, one step in flight
per lane (the sessions placed on one Target replica, `engine.target.lane_of`; in-process, one lane): requests join
and leave only at their lane's step boundaries, so each lane's batch changes continuously, and no replica's step
waits for another's. At batch size 1 the drafter builds the configured dynamic tree, above 1 C2T chains
(docs/design.md section 6; the decision is the drafter's, per call). The engine is injected and the router treats
every engine alike: in the Serve deployment (services/router_replica.py) it is services/remote_engine.py's, whose
Target and Drafter are grpc.aio clients of the replicas awaited on this loop; in unit tests its parts are
in-process runners behind their adapters (engine/parts.py), which keep each runner on a thread of its own.
Verification, emission and stop conditions are the engine's own (`start`, `step`, `result`); the router only turns
what each step emitted into stream messages.

The public gRPC API in front of it (TLS, tokens, payload decoding, status codes, one log line per rejected
request) is services/api_server.py; what a valid request is, services/validation.py (shared with any other
front end). Errors: bad input -> INVALID_ARGUMENT; over the configured limits -> RESOURCE_EXHAUSTED, and
with limits.max_concurrent_requests requests in flight the next one gets RESOURCE_EXHAUSTED at once (nothing
queues in front of this check: the API server is the Router's own, not Serve's proxy); the per-request deadline
(limits.request_timeout_s) -> DEADLINE_EXCEEDED. A client that cancels (or whose own deadline expires) leaves
the batch at the next step boundary and its session is released on every replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable

import grpc

from treeserve.engine.requests import FinishReason, GenerationRequest, GenerationResult, TokenLogprob
from treeserve.engine.runners.kv_pool import KVPoolExhausted
from treeserve.engine.speculative_engine import Sequence, SpeculativeEngine
from treeserve.v1 import generation_pb2 as gen
from .config import LimitsConfig
from .metrics import RouterMetrics
from .transport.pool import NoReplicaError, ReplicasFullError
from .validation import RequestError, RequestValidator, SamplingDefaults, method_enum


log = logging.getLogger("treeserve.router")

FINISH = {FinishReason.LENGTH: gen.FINISH_REASON_LENGTH, FinishReason.EOS: gen.FINISH_REASON_EOS,
          FinishReason.STOP_STRING: gen.FINISH_REASON_STOP_STRING}


@dataclass
class _Job:
    request: GenerationRequest
    method: str
    deadline: float  # time.monotonic()
    arrival: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None
    sent_tokens: int = 0
    sent_text: str = ""
    last_emit: float | None = None  # when the last message with tokens was queued
    cancelled: bool = False
    done: bool = False
    result: GenerationResult | None = None
    status: str | None = None  # final status code name once the job left
    # choices 1..n-1 of a request wait for choice 0's prefill (its first step): their own prefills then find the
    # prompt's KV in the Target's prefix cache instead of computing it n times
    after: "_Job | None" = None

    @property
    def ready(self) -> bool:
        """Whether the job may join the batch (see `after`)."""
        first = self.after
        return first is None or first.done or (first.seq is not None and bool(first.seq.steps))


@dataclass
class _Group:
    """A request's n > 1 completions: one job each, in index order, stepping in the batch like any requests."""

    jobs: list[_Job]

    @property
    def method(self) -> str:
        return self.jobs[0].method


def logprobs_message(logprobs: list[TokenLogprob]) -> list[gen.TokenLogprob]:
    return [gen.TokenLogprob(token_id=lp.token, logprob=lp.logprob,
                             top_logprobs=[gen.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
            for lp in logprobs]


class Router:
    """Plain class: inject the engine (`RouterReplica` receives one over gRPC clients from `build_remote_engine`)."""

    def __init__(self, engine: SpeculativeEngine, limits: LimitsConfig | None = None,
                 metrics: RouterMetrics | None = None, router_id: str | None = None, model_name: str = "treeserve",
                 sampling_defaults: SamplingDefaults = SamplingDefaults()):
        self.engine = engine
        self.limits = limits or LimitsConfig()
        # sampling_defaults: what a request's unset sampling fields take (services/validation.py SamplingDefaults)
        self.validator = RequestValidator(engine, self.limits, sampling_defaults)
        self.metrics = metrics or RouterMetrics(enabled=False)
        self.router_id = router_id or uuid.uuid4().hex[:8]
        self.model_name = model_name  # the model clients name and /v1/models lists (services/openai_api.py)
        self._waiting: list[_Job] = []
        self._active: list[_Job] = []
        # Preempted (a step its Target replica had no KV pages for): they resume, before any new admission, once
        # fewer than `_preempted_room` jobs are active, i.e. once a job that held pages left.
        self._preempted: list[_Job] = []
        self._preempted_room = 0
        self.preemptions = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._run_ahead_seen = (0, 0)  # the drafter's run-ahead (hits, misses) counted so far
        self.steps = 0

    async def check_health(self) -> None:
        if self._task is not None and self._task.done():
            raise RuntimeError(f"router step loop stopped: {self._task.exception()!r}")

    # ------------------------------------------------------------------ API
    async def generate(self, request: gen.GenerateRequest) -> gen.GenerateResponse:
        return await self.collect(await self.submit(request))

    async def stream(self, request: gen.GenerateRequest) -> AsyncIterator[gen.GenerateStreamResponse]:
        job = await self.submit(request)
        async for message in self.drain(job):
            yield message

    async def collect(self, job: _Job | _Group) -> gen.GenerateResponse:
        """Drain a submitted job into one unary reply (a group: choice 0's fields and every choice)."""
        if isinstance(job, _Group):
            try:
                replies = [await self.collect(one) for one in job.jobs]
            finally:
                self._cancel(job.jobs)
            reply = gen.GenerateResponse()
            reply.CopyFrom(replies[0])
            reply.choices.extend(gen.Completion(index=i, text=r.text, token_ids=r.token_ids,
                                                finish_reason=r.finish_reason, stats=r.stats, logprobs=r.logprobs)
                                 for i, r in enumerate(replies))
            return reply
        tokens: list[int] = []
        logprobs: list[gen.TokenLogprob] = []
        last = None
        async for message in self.drain(job):
            tokens.extend(message.token_ids)
            logprobs.extend(message.logprobs)
            last = message
        return gen.GenerateResponse(text=job.result.text, token_ids=tokens, finish_reason=last.finish_reason,
                                    stats=last.stats, logprobs=logprobs)

    async def drain(self, job: _Job | _Group) -> AsyncIterator[gen.GenerateStreamResponse]:
        """The job's stream messages until the final one; raises its RequestError if it fails. A group's
        messages interleave as its jobs' steps produce them, each naming its choice (`index`)."""
        if isinstance(job, _Group):
            async for message in self._drain_group(job.jobs):
                yield message
            return
        try:
            while True:
                kind, payload = await job.queue.get()
                if kind == "error":
                    raise payload
                yield payload
                if payload.finish_reason != gen.FINISH_REASON_UNSPECIFIED:
                    return
        finally:
            if not job.done:  # client went away (cancel or its own deadline): leave at the next step boundary
                job.cancelled = True
                if self._wake is not None:
                    self._wake.set()

    async def _drain_group(self, jobs: list[_Job]) -> AsyncIterator[gen.GenerateStreamResponse]:
        """The jobs' messages in the order they arrive until every job sent its final one; the first failure
        raises, and whatever is unfinished when this ends (failure, cancel) leaves at the next step boundary."""
        pending = {asyncio.ensure_future(job.queue.get()): i for i, job in enumerate(jobs)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in sorted(done, key=pending.__getitem__):
                    index = pending.pop(future)
                    kind, payload = future.result()
                    if kind == "error":
                        raise payload
                    payload.index = index
                    yield payload
                    if payload.finish_reason == gen.FINISH_REASON_UNSPECIFIED:
                        pending[asyncio.ensure_future(jobs[index].queue.get())] = index
        finally:
            for future in pending:
                future.cancel()
            self._cancel(jobs)

    def _cancel(self, jobs: list[_Job]) -> None:
        """Jobs whose client went away leave at their next step boundary."""
        for job in jobs:
            if not job.done:
                job.cancelled = True
        if self._wake is not None:
            self._wake.set()

    async def start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._loop(), name="treeserve-step-loop")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except BaseException:
                pass
        for job in self._active + self._waiting:
            self._fail(job, RequestError(grpc.StatusCode.UNAVAILABLE, "router shutting down"))

    # ------------------------------------------------------------------ validation
    def parse(self, message: gen.GenerateRequest, tenant: str = "") -> tuple[GenerationRequest, str]:
        """GenerateRequest -> (engine request, method name); RequestError for bad or oversized input
        (services/validation.py). `tenant`: the caller's bearer token (its prefix-cache scope)."""
        return self.validator.from_proto(message, tenant)

    # ------------------------------------------------------------------ admission
    @property
    def in_flight(self) -> int:
        return len(self._active) + len(self._waiting) + len(self._preempted)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metric (services/app.py router_autoscaling_policy): requests reach this replica's
        own API servers, not Serve's proxies, so Serve counts none of them; load is the requests in flight."""
        return {"in_flight_requests": float(self.in_flight)}

    async def submit(self, message: Any, parse: Any = None, n: int | None = None, tenant: str = "",
                     check: Callable[[], None] | None = None) -> _Job | _Group:
        """Admit a request or refuse it at once: RESOURCE_EXHAUSTED when limits.max_concurrent_requests requests
        are already in flight (checked before any tokenising, so an overloaded router spends nothing on the
        requests it refuses), else the validator's verdict. `parse(message) -> (GenerationRequest, method)`
        replaces `self.parse` for another front end's request form (the OpenAI HTTP API, services/openai_api.py),
        which validates with the same RequestValidator.

        Malformed requests are refused before the limit (INVALID_ARGUMENT even when the router is full): `check()`
        runs another front end's checks that need no tokenizer, a GenerateRequest gets `precheck_proto`'s.

        `n` completions (None: the GenerateRequest's own `n`): n > 1 admits n jobs, each counted against the limit,
        completion i seeded seed + i when the request has a seed (completion 0 seeded as the n = 1 request), and
        returns them as one _Group, which `collect` and `drain` take like a job. `tenant`: the caller's bearer token,
        which scopes the prefix cache of a GenerateRequest (another front end's `parse` scopes its own)."""
        if n is None:
            n = (message.n or 1) if isinstance(message, gen.GenerateRequest) else 1
        if check is not None:
            check()
        elif parse is None:  # the gRPC form: what can be refused without tokenising is, before the limit
            self.validator.precheck_proto(message)
        n = self.validator.choices(n)
        await self.start()
        limit = self.limits.max_concurrent_requests
        if self.in_flight + n > limit:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"too many concurrent requests: {self.in_flight} in flight, the limit is {limit}"
                               f"{f' ({n} completions asked)' if n > 1 else ''}; retry later")
        # synchronous: nothing else is admitted meanwhile
        request, method = parse(message) if parse is not None else self.parse(message, tenant)
        jobs = []
        for i in range(n):
            one = request if i == 0 or request.seed is None else replace(request, seed=request.seed + i)
            jobs.append(_Job(one, method, deadline=time.monotonic() + self.limits.request_timeout_s,
                             after=jobs[0] if jobs else None))
        self._waiting.extend(jobs)
        self.metrics.queue_depth.set(len(self._waiting))
        self._wake.set()
        return jobs[0] if n == 1 else _Group(jobs)

    # Back-compatible name.
    _submit = submit

    def _admit_and_prune(self, busy: set[int] = frozenset()) -> None:
        """Admit waiting jobs up to limits.max_batch_size; drop cancelled and expired ones, except those of a step
        in flight (`busy`: their ids), which leave when it is over."""
        now = time.monotonic()
        for job in list(self._active):
            if id(job) in busy:
                continue
            if job.cancelled:
                self._leave(job, "CANCELLED")
            elif now > job.deadline:
                self._fail(job, RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                             f"request exceeded its deadline of {self.limits.request_timeout_s:g} s"))
        for job in self._waiting + self._preempted:
            if job.cancelled:
                self._leave(job, "CANCELLED")
            elif now > job.deadline:
                self._fail(job, RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                             f"request waited past its deadline of {self.limits.request_timeout_s:g} s"))
        while self._preempted and len(self._active) < min(self._preempted_room, self.limits.max_batch_size):
            self._active.append(self._preempted.pop(0))  # resumes from its context: nothing it emitted is lost
        while not self._preempted and len(self._active) < self.limits.max_batch_size:
            job = next((j for j in self._waiting if j.ready), None)
            if job is None:
                break
            self._waiting.remove(job)
            job.seq = self.engine.start(job.request)
            # Unique across routers: the session id keys KV caches on shared replicas.
            job.seq.session_id = f"{self.router_id}-{uuid.uuid4().hex[:12]}"
            self._active.append(job)
        self.metrics.queue_depth.set(len(self._waiting))
        self.metrics.active.set(len(self._active))

    # ------------------------------------------------------------------ the step loop
    async def _loop(self) -> None:
        """Step every lane that has sequences and no step in flight; admit and prune between steps.

        A lane is the sessions of one Target replica (`engine.target.lane_of`): lanes step independently, so one
        replica's step never waits for another's, and one lane's drafting and verification overlap the others'
        scoring.
        A sequence joins a step only at its lane's step boundary, and leaves (cancelled, past its deadline) only
        when no step of its lane is in flight."""
        stepping: dict[str, tuple[asyncio.Task, list[_Job]]] = {}  # lane -> its step in flight and its jobs
        try:
            while True:
                busy = {id(job) for _, jobs in stepping.values() for job in jobs}
                self._admit_and_prune(busy)
                for lane, jobs in self._lanes(busy).items():
                    if lane not in stepping:
                        stepping[lane] = (asyncio.create_task(self._step(jobs, lane)), jobs)
                self._wake.clear()
                wake = asyncio.ensure_future(self._wake.wait())
                done, _ = await asyncio.wait([wake, *(task for task, _ in stepping.values())],
                                             return_when=asyncio.FIRST_COMPLETED)
                wake.cancel()
                for lane in [lane for lane, (task, _) in stepping.items() if task in done]:
                    stepping.pop(lane)[0].result()  # a step's own failures fail its jobs; anything else ends the loop
        finally:
            for task, _ in stepping.values():
                task.cancel()

    def _lanes(self, busy: set[int]) -> dict[str, list[_Job]]:
        """The active jobs not in a step, by lane (in arrival order)."""
        lanes: dict[str, list[_Job]] = {}
        for job in self._active:
            if id(job) not in busy:
                prefix = (job.request.cache_scope, job.seq.context)
                lanes.setdefault(self.engine.target.lane_of(job.seq.session_id, prefix), []).append(job)
        return lanes

    async def _step(self, jobs: list[_Job], lane: str) -> None:
        """One engine step for a lane's jobs, then their stream messages; a failed step fails its jobs."""
        batch = [j.seq for j in jobs]
        prefill = any(not s.steps for s in batch)
        started = time.monotonic()
        try:
            await self.engine.step(batch, lane)
        except (Exception, asyncio.CancelledError) as exc:  # retried on other replicas already: fail the batch
            if isinstance(exc, asyncio.CancelledError) and asyncio.current_task().cancelling():
                raise  # the router is closing
            full = isinstance(exc, (ReplicasFullError, KVPoolExhausted))  # replicas' or an in-process target's
            if full and len(jobs) > 1:  # no KV pages for this batch: preempt
                self._preempt(max(jobs, key=lambda j: j.arrival), exc)
                return
            if full:  # healthy replicas without room even for one sequence
                log.warning("step refused for %d sequences: %s", len(batch), exc)
                code = grpc.StatusCode.RESOURCE_EXHAUSTED
            elif isinstance(exc, NoReplicaError):  # an outage, not a bug: one line, no traceback
                log.error("step failed for %d sequences: %s", len(batch), exc)
                code = grpc.StatusCode.UNAVAILABLE
            else:
                log.exception("step failed for %d sequences", len(batch))
                code = grpc.StatusCode.INTERNAL
            for job in jobs:
                self._fail(job, RequestError(code, f"generation step failed: {exc}"))
            return
        self.steps += 1
        self.metrics.record_step([(j.method, j.seq.steps[-1]) for j in jobs if j.seq.steps], len(batch))
        if prefill:
            self.metrics.record_prefill_step((time.monotonic() - started) * 1e3)
        self._count_run_ahead()
        for job in jobs:
            if job in self._active:
                self._publish(job)

    def _count_run_ahead(self) -> None:
        """The drafter's run-ahead hits and misses since the last count (lanes step at once: a delta taken around
        one step would count another lane's too)."""
        drafter = self.engine.drafter
        if drafter is None:
            return
        seen_hits, seen_misses = self._run_ahead_seen
        self._run_ahead_seen = (drafter.run_ahead_hits, drafter.run_ahead_misses)
        self.metrics.record_run_ahead(self._run_ahead_seen[0] - seen_hits, self._run_ahead_seen[1] - seen_misses)

    def _emitted(self, job: _Job, count: int) -> None:
        """Latency metrics of a stream message carrying `count` tokens."""
        if count <= 0:
            return
        now = time.monotonic()
        if job.last_emit is None:
            self.metrics.record_first_token(job.method, (now - job.arrival) * 1e3)
            self.metrics.record_tokens(job.method, count, None)
        else:
            self.metrics.record_tokens(job.method, count, (now - job.last_emit) * 1e3)
        job.last_emit = now

    def _publish(self, job: _Job) -> None:
        s = job.seq
        tokens = s.emitted[job.sent_tokens:]
        logprobs = logprobs_message(s.logprobs[job.sent_tokens:]) if s.logprobs is not None else []
        job.sent_tokens = len(s.emitted)
        self._emitted(job, len(tokens))
        if s.finish is None:
            visible = self._visible_text(s)
            delta = visible[len(job.sent_text):] if visible.startswith(job.sent_text) else ""
            job.sent_text += delta
            if tokens or delta:
                job.queue.put_nowait(("message", gen.GenerateStreamResponse(text_delta=delta, token_ids=tokens,
                                                                            logprobs=logprobs)))
            return
        job.result = self.engine.result(s)
        text = job.result.text
        delta = text[len(job.sent_text):] if text.startswith(job.sent_text) else ""
        final = gen.GenerateStreamResponse(text_delta=delta, token_ids=tokens,
                                           finish_reason=FINISH[job.result.finish_reason],
                                           stats=self._stats(job), logprobs=logprobs)
        job.queue.put_nowait(("message", final))
        self.metrics.mal.observe(job.result.mean_accepted_length, tags={"method": job.method})
        self._leave(job, "OK")

    def _visible_text(self, s: Sequence) -> str:
        """Text safe to stream mid-generation: no incomplete UTF-8 tail, and nothing that could still turn
        out to be the start of a stop string (the final message carries the rest)."""
        text = self.engine.tokenizer.decode(self.engine.text_ids(s), skip_special_tokens=True)
        if s.request.stop_strings:
            hold = max(len(x) for x in s.request.stop_strings) - 1
            text = text[:len(text) - hold] if hold else text
        return text.rstrip("\ufffd")

    def _stats(self, job: _Job) -> gen.GenerationStats:
        r = job.result
        draft_ms, score_ms, verify_ms = r.mean_step_ms()
        method, lookup = method_enum(job.method)  # "c2t+lookup": C2T with copy-from-context candidates
        by_source = r.accepted_by_source()
        rises, switching = r.load_switches()
        return gen.GenerationStats(prompt_tokens=r.prompt_tokens, completion_tokens=len(r.token_ids),
                                   steps=len(r.steps), mean_accepted_length=r.mean_accepted_length,
                                   mean_tree_size_tokens=r.mean_tree_size, wall_time_ms=r.wall_time_s * 1e3,
                                   method=method, mean_draft_ms=draft_ms, mean_score_ms=score_ms,
                                   mean_verify_ms=verify_ms, lookup=lookup,
                                   accepted_tokens_model=by_source["model"], accepted_tokens_lookup=by_source["lookup"],
                                   accepted_tokens_both=by_source["both"],
                                   mean_tree_size_lookup_tokens=r.mean_tree_size_lookup,
                                   run_ahead_hits=sum(s.run_ahead_hit for s in r.steps),
                                   drafted_steps=sum(s.tree_size > 0 for s in r.steps),
                                   catch_up_steps=sum(s.catch_up for s in r.steps),
                                   catch_up_ms=sum(s.catch_up_ms for s in r.steps),
                                   parked_steps=sum(s.parked for s in r.steps),
                                   load_rises=rises, steps_to_switch=switching,
                                   cached_tokens=r.cached_tokens,
                                   accepted_prediction_tokens=r.accepted_prediction_tokens,
                                   rejected_prediction_tokens=r.rejected_prediction_tokens)

    def _preempt(self, job: _Job, reason: Exception) -> None:
        """Take the newest job of a lane whose step found no KV pages out of the batch (vLLM's recompute
        preemption): it waits, keeping what it emitted, and resumes once a job that held pages has left; its
        replicas rebuild it from its context (docs/design.md section 10)."""
        self._active.remove(job)
        self._preempted.append(job)
        self._preempted_room = len(self._active)
        self.preemptions += 1
        log.warning("session %s preempted until pages are freed (%d active): %s", job.seq.session_id,
                    len(self._active), reason)

    # ------------------------------------------------------------------ leaving
    def _fail(self, job: _Job, error: RequestError) -> None:
        job.queue.put_nowait(("error", error))
        self._leave(job, error.code.name)

    def _leave(self, job: _Job, code: str) -> None:
        """The job is over (`code`: its final status); the API layer counts it (services/api_server.py)."""
        job.done = True
        job.status = code
        if job in self._active:
            self._active.remove(job)
        if job in self._waiting:
            self._waiting.remove(job)
        if job in self._preempted:
            self._preempted.remove(job)
        if job.seq is not None:
            task = asyncio.ensure_future(self._release(job.seq))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _release(self, seq: Sequence) -> None:
        """Free the session's caches in the engine's target and drafter (on every replica, for replica clients:
        what the session leaves cached guides the next turn's placement)."""
        try:
            await self.engine.release(seq)
        except Exception as exc:  # a replica cache left behind is evicted later; never fail a request for it
            log.warning("release of %s failed: %s", seq.session_id, exc)
