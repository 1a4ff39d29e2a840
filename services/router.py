"""The Router: request admission, continuous batching and streaming over the speculative engine.

One background step loop per router drives `SpeculativeEngine.step` on the batch of active sequences:
requests join and leave only at step boundaries, so the batch changes continuously; at batch size 1 the
drafter builds the configured dynamic tree, above 1 C2T chains (DESIGN.md section 6; the decision is the
drafter's, per call). The engine is injected: in the Serve deployment (`RouterReplica`) its Target and
Drafter are gRPC clients of the replicas (services/transport/clients.py); in unit tests they are in-process
runners. Verification, emission and stop conditions are the engine's own (`start`, `step`, `result`);
the router only turns what each step emitted into stream messages.

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
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import grpc

from treeserve.engine.drafters.base import AUTOREGRESSIVE
from treeserve.engine.speculative_engine import Sequence, SpeculativeEngine
from treeserve.engine.requests import FinishReason, GenerationRequest, GenerationResult
from treeserve.services.config import LimitsConfig
from treeserve.services.metrics import RouterMetrics
from treeserve.services.validation import (MAX_BUDGET_TOKENS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,  # noqa: F401
                                           METHOD_ENUMS, METHOD_NAMES, ROLES, RequestError, RequestValidator,
                                           method_enum)
from treeserve.v1 import generation_pb2 as gen

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


class Router:
    """Plain class: inject the engine. `RouterReplica` builds one over gRPC clients for Serve."""

    def __init__(self, engine: SpeculativeEngine, limits: LimitsConfig | None = None,
                 metrics: RouterMetrics | None = None, clients: list[Any] = (), router_id: str | None = None):
        self.engine = engine
        self.limits = limits or LimitsConfig()
        self.validator = RequestValidator(engine, self.limits)
        self.metrics = metrics or RouterMetrics(enabled=False)
        self.clients = [c for c in clients if c is not None]
        self.router_id = router_id or uuid.uuid4().hex[:8]
        self._waiting: list[_Job] = []
        self._active: list[_Job] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._retries_seen: dict[int, int] = {}
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

    async def collect(self, job: _Job) -> gen.GenerateResponse:
        """Drain a submitted job into one unary reply."""
        tokens: list[int] = []
        last = None
        async for message in self.drain(job):
            tokens.extend(message.token_ids)
            last = message
        return gen.GenerateResponse(text=job.result.text, token_ids=tokens, finish_reason=last.finish_reason,
                                    stats=last.stats)

    async def drain(self, job: _Job) -> AsyncIterator[gen.GenerateStreamResponse]:
        """The job's stream messages until the final one; raises its RequestError if it fails."""
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

    async def start(self) -> None:
        if self._task is None:
            for client in self.clients:
                client.bind_loop()
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
    def parse(self, message: gen.GenerateRequest) -> tuple[GenerationRequest, str]:
        """GenerateRequest -> (engine request, method name); RequestError for bad or oversized input
        (services/validation.py)."""
        return self.validator.from_proto(message)

    # ------------------------------------------------------------------ admission
    @property
    def in_flight(self) -> int:
        return len(self._active) + len(self._waiting)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metric (services/app.py router_autoscaling_policy): requests reach this replica's
        own API servers, not Serve's proxies, so Serve counts none of them; load is the requests in flight."""
        return {"in_flight_requests": float(self.in_flight)}

    async def submit(self, message: Any, parse: Any = None) -> _Job:
        """Admit a request or refuse it at once: RESOURCE_EXHAUSTED when limits.max_concurrent_requests requests
        are already in flight (checked before any tokenising, so an overloaded router spends nothing on the
        requests it refuses), else the validator's verdict. `parse(message) -> (GenerationRequest, method)`
        replaces `self.parse` for another front end's request form (the OpenAI HTTP API, services/openai_api.py),
        which validates with the same RequestValidator."""
        await self.start()
        limit = self.limits.max_concurrent_requests
        if self.in_flight >= limit:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"too many concurrent requests: {self.in_flight} in flight, the limit is {limit}; "
                               "retry later")
        request, method = (parse or self.parse)(message)  # synchronous: nothing else is admitted meanwhile
        job = _Job(request, method, deadline=time.monotonic() + self.limits.request_timeout_s)
        self._waiting.append(job)
        self.metrics.queue_depth.set(len(self._waiting))
        self._wake.set()
        return job

    # Back-compatible name.
    _submit = submit

    def _admit_and_prune(self) -> None:
        now = time.monotonic()
        for job in list(self._active):
            if job.cancelled:
                self._leave(job, "CANCELLED")
            elif now > job.deadline:
                self._fail(job, RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                             f"request exceeded its deadline of {self.limits.request_timeout_s:g} s"))
        for job in list(self._waiting):
            if job.cancelled:
                self._leave(job, "CANCELLED")
            elif now > job.deadline:
                self._fail(job, RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                             f"request waited past its deadline of {self.limits.request_timeout_s:g} s"))
        while self._waiting and len(self._active) < self.limits.max_batch_size:
            job = self._waiting.pop(0)
            job.seq = self.engine.start(job.request)
            # Unique across routers: the session id keys KV caches on shared replicas.
            job.seq.session_id = f"{self.router_id}-{uuid.uuid4().hex[:12]}"
            self._active.append(job)
        self.metrics.queue_depth.set(len(self._waiting))
        self.metrics.active.set(len(self._active))

    # ------------------------------------------------------------------ the step loop
    async def _loop(self) -> None:
        while True:
            self._admit_and_prune()
            if not self._active:
                self._wake.clear()
                await self._wake.wait()
                continue
            jobs = list(self._active)
            batch = [j.seq for j in jobs]
            try:
                await asyncio.to_thread(self.engine.step, batch)
            except Exception as exc:  # the engine already retried on other replicas: fail this batch
                from treeserve.services.transport.pool import NoReplicaError, ReplicasFullError

                if isinstance(exc, ReplicasFullError):  # healthy replicas without room: over capacity
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
                continue
            self.steps += 1
            self.metrics.record_step([(j.method, j.seq.steps[-1]) for j in jobs if j.seq.steps], len(batch))
            self._count_retries()
            for job in jobs:
                if job in self._active:
                    self._publish(job)

    def _count_retries(self) -> None:
        for client in self.clients:
            retries = getattr(client, "retries", 0)
            seen = self._retries_seen.get(id(client), 0)
            if retries > seen:
                self.metrics.retries.inc(retries - seen, tags={"deployment": client.pool.name})
                self._retries_seen[id(client)] = retries

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
        job.sent_tokens = len(s.emitted)
        self._emitted(job, len(tokens))
        if s.finish is None:
            visible = self._visible_text(s)
            delta = visible[len(job.sent_text):] if visible.startswith(job.sent_text) else ""
            job.sent_text += delta
            if tokens or delta:
                job.queue.put_nowait(("message", gen.GenerateStreamResponse(text_delta=delta, token_ids=tokens)))
            return
        job.result = self.engine.result(s)
        text = job.result.text
        delta = text[len(job.sent_text):] if text.startswith(job.sent_text) else ""
        final = gen.GenerateStreamResponse(text_delta=delta, token_ids=tokens,
                                           finish_reason=FINISH[job.result.finish_reason],
                                           stats=self._stats(job))
        job.queue.put_nowait(("message", final))
        self.metrics.mal.observe(job.result.mean_accepted_length, tags={"method": job.method})
        self._leave(job, "OK")

    def _visible_text(self, s: Sequence) -> str:
        """Text safe to stream mid-generation: no incomplete UTF-8 tail, and nothing that could still turn
        out to be the start of a stop string (the final message carries the rest)."""
        ids = [t for t in s.emitted if t not in self.engine.eos_ids]
        text = self.engine.tokenizer.decode(ids, skip_special_tokens=True)
        if s.request.stop_strings:
            hold = max(len(x) for x in s.request.stop_strings) - 1
            text = text[:len(text) - hold] if hold else text
        return text.rstrip("\ufffd")

    def _stats(self, job: _Job) -> gen.GenerationStats:
        r = job.result
        draft_ms, score_ms, verify_ms = r.mean_step_ms()
        method, lookup = method_enum(job.method)  # "c2t+lookup": C2T with copy-from-context candidates
        by_source = r.accepted_by_source()
        return gen.GenerationStats(prompt_tokens=r.prompt_tokens, completion_tokens=len(r.token_ids),
                                   steps=len(r.steps), mean_accepted_length=r.mean_accepted_length,
                                   mean_tree_size_tokens=r.mean_tree_size, wall_time_ms=r.wall_time_s * 1e3,
                                   method=method, mean_draft_ms=draft_ms, mean_score_ms=score_ms,
                                   mean_verify_ms=verify_ms, lookup=lookup,
                                   accepted_tokens_model=by_source["model"], accepted_tokens_lookup=by_source["lookup"],
                                   accepted_tokens_both=by_source["both"],
                                   mean_tree_size_lookup_tokens=r.mean_tree_size_lookup)

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
        if job.seq is not None:
            task = asyncio.ensure_future(self._release(job.seq))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _release(self, seq: Sequence) -> None:
        """Free the session's caches on every replica (async clients) or in-process runners."""
        try:
            parts = [self.engine.target] + ([self.engine.drafter] if self.engine.drafter is not None else [])
            for part in parts:
                if hasattr(part, "release_async"):
                    await part.release_async(seq.session_id)
                else:
                    await asyncio.to_thread(part.release, seq.session_id)
        except Exception as exc:  # a replica cache left behind is evicted later; never fail a request for it
            log.warning("release of %s failed: %s", seq.session_id, exc)


# The public API's servicer lives with its server; re-exported here for existing imports.
from treeserve.services.api_server import RouterServicer  # noqa: E402,F401


class RouterReplica(Router):
    """Serve deployment class (wrapped by services/app.py). It serves the public API on its own grpc.aio server
    (services/api_server.py: TLS, bearer tokens, request-size cap, status codes), whose event loop also runs
    the step loop and the replica clients. The engine's Target and Drafter are gRPC clients of the Target /
    Drafter replicas, found through the registry (scoped to this application build) and authenticated with the
    application's internal secret. With an EAGLE drafter the target clients ask for features and the drafter
    client passes them on (services/features.py).

    Losing this replica ends its streams with UNAVAILABLE (their connections close with the process); Serve
    starts a new one, which listens on the same port, and new requests succeed once it is up."""

    def __init__(self, args: dict | None, drafter_handle: Any = None, target_handle: Any = None,
                 internal_secret: str | None = None, serve_api: bool = True):
        from treeserve.engine.factory import tree_config
        from treeserve.services.config import AppConfig
        from treeserve.services.transport.clients import RemoteDrafter, RemoteTarget
        from treeserve.services.transport.discovery import Registry, replica_identity, serve_discovery
        from treeserve.services.transport.pool import ReplicaPool
        from treeserve.services.transport.replica_server import limit_threads
        from treeserve.services.internal_auth import registry_scope
        from treeserve.v1 import internal_pb2_grpc as pb_grpc

        limit_threads()
        config = AppConfig.from_args(args)
        if not internal_secret and Registry.available():
            raise ValueError("Router replica started without the application's internal secret; build the "
                             "application with treeserve.services.app (build_app / build_app_from_config)")
        tokenizer, vocab_size = load_tokenizer(config.target.path, config.target.chat_template)
        app, _, replica_id = replica_identity()
        scope = registry_scope(internal_secret)
        max_bytes = config.grpc.max_message_bytes
        timeout = config.limits.request_timeout_s
        target_pool = ReplicaPool("Target", pb_grpc.TargetStub, serve_discovery(app, "Target", target_handle, scope),
                                  max_bytes, refresh_period_s=1.0, internal_secret=internal_secret)
        target = RemoteTarget(target_pool, vocab_size, call_timeout_s=timeout, retry_timeout_s=timeout)
        drafter = None
        if drafter_handle is not None and config.speculation.method != AUTOREGRESSIVE:
            drafter_pool = ReplicaPool("Drafter", pb_grpc.DrafterStub,
                                       serve_discovery(app, "Drafter", drafter_handle, scope), max_bytes,
                                       refresh_period_s=1.0, internal_secret=internal_secret)
            drafter = RemoteDrafter(drafter_pool, call_timeout_s=timeout,
                                    reads_target_features=config.drafter.reads_target_features())
            # Rows the target recomputes (a replica rebuilt the session) must reach the drafter replicas too.
            target.features_listener = drafter.features_rewritten
        engine = SpeculativeEngine(target, drafter, tokenizer,
                                   tree_config(config.speculation.method, config.speculation.budget),
                                   config.target.max_context_tokens)
        super().__init__(engine, config.limits, RouterMetrics(enabled=Registry.available()),
                         clients=[target, drafter], router_id=replica_id)
        self.config = config
        self.api_server = None
        if serve_api:
            from treeserve.services.api_server import start_api_server

            self.api_server = start_api_server(self, config.api, config.security)
            # The step loop and the replica clients live on the API server's loop, where requests arrive.
            asyncio.run_coroutine_threadsafe(self.start(), self.api_server.loop).result(30)
            log.info("Router %s serving the public API on %s", replica_id, self.api_server.describe())

    async def __call__(self, request: Any) -> Any:
        """What Serve's HTTP proxy (the application's route_prefix) answers: the APIs are this replica's own servers
        (services/openai_api.py says why), so a 404 in OpenAI's error shape that names them, not a 500."""
        from starlette.responses import JSONResponse

        api = self.config.api
        where = f"gRPC on port {api.port}"
        if api.http_port is not None:
            where = f"the OpenAI-compatible HTTP API on port {api.http_port} (/v1/chat/completions, /v1/completions, " \
                    f"/v1/models, /health) and {where}"
        else:
            where += "; set args.api.http_port for the OpenAI-compatible HTTP API"
        message = f"this is Ray Serve's HTTP proxy; TreeServe serves {where}"
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": "not_found"}}, status_code=404)

    async def check_health(self) -> None:
        if self.api_server is not None and not self.api_server.alive():
            raise RuntimeError("the public API server is not running")
        await super().check_health()

    async def ready(self) -> int:
        """Readiness through the real pipeline: a one-token generation on the API server's loop (drafter, target
        and verification all answer). Returns the tokens generated. `treeserve serve` waits on it."""
        message = gen.GenerateRequest(token_ids=gen.TokenIds(ids=[1]), max_new_tokens=1)
        loop = self.api_server.loop if self.api_server is not None else asyncio.get_running_loop()
        future = asyncio.run_coroutine_threadsafe(self.generate(message), loop)
        reply = await asyncio.wrap_future(future)
        return len(reply.token_ids)

    def __del__(self) -> None:
        server = getattr(self, "api_server", None)
        if server is not None:
            try:
                server.stop(0.5)
            except Exception:
                pass


def load_tokenizer(path: str, chat_template: str | None = None) -> tuple[Any, int]:
    """The target's tokenizer (with `target.chat_template` when set: engine/chat_templates.py) and vocabulary
    size, without loading its weights."""
    from transformers import AutoConfig, AutoTokenizer

    from treeserve.engine import chat_templates
    from treeserve.engine.models.loading import resolve_model_dir

    model_dir = resolve_model_dir(path)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    tokenizer = chat_templates.apply(AutoTokenizer.from_pretrained(model_dir, local_files_only=True), chat_template)
    return tokenizer, int(config.vocab_size)
