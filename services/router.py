"""The Router: public gRPC API (Generate / GenerateStream), validation, continuous batching, streaming.

One background step loop per router drives `SpeculativeEngine.step` on the batch of active sequences:
requests join and leave only at step boundaries, so the batch changes continuously; at batch size 1 the
drafter builds the configured dynamic tree, above 1 C2T chains (DESIGN.md section 6; the decision is the
drafter's, per call). The engine is injected: in the Serve deployment (`RouterReplica`) its Target and
Drafter are gRPC clients of the replicas (services/grpc_clients.py); in unit tests they are in-process
runners. Verification, emission and stop conditions are the engine's own (`start`, `step`, `result`);
the router only turns what each step emitted into stream messages.

Errors: bad input -> INVALID_ARGUMENT; over the configured limits or too many requests in flight ->
RESOURCE_EXHAUSTED; the per-request deadline (limits.request_timeout_s) -> DEADLINE_EXCEEDED. A client
that cancels (or whose own deadline expires) leaves the batch at the next step boundary and its session is
released on every replica.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import grpc

from treeserve.engine.drafting import AUTOREGRESSIVE
from treeserve.engine.generate import Sequence, SpeculativeEngine
from treeserve.engine.requests import FinishReason, GenerationRequest, GenerationResult
from treeserve.engine.sampling import SamplingParams
from treeserve.services.config import LimitsConfig
from treeserve.services.metrics import RouterMetrics
from treeserve.v1 import generation_pb2 as gen
from treeserve.v1 import generation_pb2_grpc as gen_grpc

log = logging.getLogger("treeserve.router")

METHOD_NAMES = {
    gen.TREE_METHOD_AUTOREGRESSIVE: "autoregressive", gen.TREE_METHOD_CHAIN: "chain",
    gen.TREE_METHOD_STATIC: "static", gen.TREE_METHOD_EAGLE2: "eagle2", gen.TREE_METHOD_DYSPEC: "dyspec",
    gen.TREE_METHOD_DYSPEC_THRESHOLD: "dyspec_threshold", gen.TREE_METHOD_OPT_TREE: "opt_tree",
    gen.TREE_METHOD_C2T: "c2t",
}
METHOD_ENUMS = {name: value for value, name in METHOD_NAMES.items()}
FINISH = {FinishReason.LENGTH: gen.FINISH_REASON_LENGTH, FinishReason.EOS: gen.FINISH_REASON_EOS,
          FinishReason.STOP_STRING: gen.FINISH_REASON_STOP_STRING}
MAX_BUDGET_TOKENS = 1024
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
ROLES = ("system", "user", "assistant")


class RequestError(Exception):
    """A request-level failure with its gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __reduce__(self):  # Serve pickles exceptions raised in a replica across processes
        return RequestError, (self.code, self.message)


@dataclass
class _Job:
    request: GenerationRequest
    method: str
    deadline: float  # time.monotonic()
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None
    sent_tokens: int = 0
    sent_text: str = ""
    cancelled: bool = False
    done: bool = False
    result: GenerationResult | None = None


class Router:
    """Plain class: inject the engine. `RouterReplica` builds one over gRPC clients for Serve."""

    def __init__(self, engine: SpeculativeEngine, limits: LimitsConfig | None = None,
                 metrics: RouterMetrics | None = None, clients: list[Any] = (), router_id: str | None = None):
        self.engine = engine
        self.limits = limits or LimitsConfig()
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

    # ------------------------------------------------------------------ Serve gRPC ingress
    async def Generate(self, request: gen.GenerateRequest, grpc_context=None) -> gen.GenerateResponse:
        try:
            return await self.generate(request)
        except RequestError as exc:
            _set_status(grpc_context, exc)
            raise

    async def GenerateStream(self, request: gen.GenerateRequest, grpc_context=None) -> AsyncIterator[gen.GenerateStreamResponse]:
        try:
            async for message in self.stream(request):
                yield message
        except RequestError as exc:
            _set_status(grpc_context, exc)
            raise

    async def check_health(self) -> None:
        if self._task is not None and self._task.done():
            raise RuntimeError(f"router step loop stopped: {self._task.exception()!r}")

    # ------------------------------------------------------------------ API
    async def generate(self, request: gen.GenerateRequest) -> gen.GenerateResponse:
        job = await self._submit(request)
        tokens: list[int] = []
        last = None
        async for message in self._drain(job):
            tokens.extend(message.token_ids)
            last = message
        return gen.GenerateResponse(text=job.result.text, token_ids=tokens, finish_reason=last.finish_reason,
                                    stats=last.stats)

    async def stream(self, request: gen.GenerateRequest) -> AsyncIterator[gen.GenerateStreamResponse]:
        job = await self._submit(request)
        async for message in self._drain(job):
            yield message

    async def _drain(self, job: _Job) -> AsyncIterator[gen.GenerateStreamResponse]:
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
        """GenerateRequest -> (engine request, method name); RequestError for bad or oversized input."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        too_big = grpc.StatusCode.RESOURCE_EXHAUSTED
        limits = self.limits
        which = message.WhichOneof("prompt")
        if which is None:
            raise RequestError(invalid, "prompt: set one of text, chat or token_ids")
        if which == "text":
            if not message.text.strip():
                raise RequestError(invalid, "prompt: text must not be empty")
            if len(message.text) > limits.max_prompt_tokens * 64:  # cheap guard before tokenising
                raise RequestError(too_big, f"prompt: text longer than the limit of {limits.max_prompt_tokens} tokens")
            prompt = self.engine.encode_chat(message.text)
        elif which == "chat":
            turns = list(message.chat.messages)
            if not turns or not any(t.content.strip() for t in turns):
                raise RequestError(invalid, "prompt: chat must hold at least one non-empty message")
            for i, turn in enumerate(turns):
                if turn.role not in ROLES:
                    raise RequestError(invalid, f"prompt: chat.messages[{i}].role must be one of {', '.join(ROLES)}, "
                                                f"got {turn.role!r}")
            prompt = self.engine.encode_chat([{"role": t.role, "content": t.content} for t in turns])
        else:
            prompt = list(message.token_ids.ids)
            if not prompt:
                raise RequestError(invalid, "prompt: token_ids must not be empty")
            vocab = self.engine.target.vocab_size
            if any(t < 0 or t >= vocab for t in prompt):
                raise RequestError(invalid, f"prompt: token ids must lie in [0, {vocab})")
        if len(prompt) > limits.max_prompt_tokens:
            raise RequestError(too_big, f"prompt: {len(prompt)} tokens exceed the limit of {limits.max_prompt_tokens}")
        if message.max_new_tokens <= 0:
            raise RequestError(invalid, f"max_new_tokens: must be > 0, got {message.max_new_tokens}")
        if message.max_new_tokens > limits.max_new_tokens:
            raise RequestError(too_big, f"max_new_tokens: {message.max_new_tokens} exceeds the limit of "
                                        f"{limits.max_new_tokens}")
        if len(prompt) + message.max_new_tokens > self.engine.max_context_tokens:
            raise RequestError(too_big, f"prompt ({len(prompt)} tokens) + max_new_tokens ({message.max_new_tokens}) "
                                        f"exceeds the context window of {self.engine.max_context_tokens}")
        sampling = self._sampling(message.sampling)
        stops = list(message.stop_strings)
        if len(stops) > MAX_STOP_STRINGS:
            raise RequestError(invalid, f"stop_strings: at most {MAX_STOP_STRINGS}, got {len(stops)}")
        if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise RequestError(invalid, f"stop_strings: each must hold 1..{MAX_STOP_STRING_CHARS} characters")
        tree, method = self._tree(message.speculation)
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=message.max_new_tokens, sampling=sampling,
                                    stop_strings=tuple(stops), seed=message.sampling.seed or None, tree=tree)
        try:
            self.engine.validate(request)
        except ValueError as exc:
            raise RequestError(invalid, str(exc)) from None
        return request, method

    @staticmethod
    def _sampling(message: gen.SamplingParams) -> SamplingParams:
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if not math.isfinite(message.temperature) or message.temperature < 0:
            raise RequestError(invalid, f"sampling.temperature: must be >= 0, got {message.temperature}")
        if not math.isfinite(message.top_p) or not 0 <= message.top_p <= 1:
            raise RequestError(invalid, f"sampling.top_p: must lie in (0, 1] (0 = unset), got {message.top_p}")
        if message.top_k < 0:
            raise RequestError(invalid, f"sampling.top_k: must be >= 0 (0 = unset), got {message.top_k}")
        return SamplingParams(temperature=float(message.temperature), top_k=int(message.top_k),
                              top_p=float(message.top_p) or 1.0)

    def _tree(self, message: gen.SpeculationParams):
        from treeserve.engine.builders import TreeConfig
        from treeserve.engine.pipeline import tree_config

        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if message.method != gen.TREE_METHOD_UNSPECIFIED and message.method not in METHOD_NAMES:
            raise RequestError(invalid, f"speculation.method: unknown tree method {message.method}")
        if not 0 <= message.budget_tokens <= MAX_BUDGET_TOKENS:
            raise RequestError(invalid, f"speculation.budget_tokens: must lie in 1..{MAX_BUDGET_TOKENS} "
                                        f"(0 = server choice), got {message.budget_tokens}")
        if message.method == gen.TREE_METHOD_UNSPECIFIED and not message.budget_tokens:
            return None, self.engine.tree.method
        name = METHOD_NAMES.get(message.method, self.engine.tree.method)
        if name == AUTOREGRESSIVE:
            return TreeConfig(method=AUTOREGRESSIVE), name
        if message.budget_tokens:
            return tree_config(name, int(message.budget_tokens)), name
        if name == self.engine.tree.method:
            return self.engine.tree, name
        return tree_config(name, "auto"), name

    # ------------------------------------------------------------------ admission
    async def _submit(self, message: gen.GenerateRequest) -> _Job:
        await self.start()
        request, method = self.parse(message)
        if len(self._active) + len(self._waiting) >= self.limits.max_concurrent_requests:
            self.metrics.requests.inc(tags={"code": "RESOURCE_EXHAUSTED", "method": method})
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"too many concurrent requests (limit {self.limits.max_concurrent_requests})")
        job = _Job(request, method, deadline=time.monotonic() + self.limits.request_timeout_s)
        self._waiting.append(job)
        self.metrics.queue_depth.set(len(self._waiting))
        self._wake.set()
        return job

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
                from treeserve.services.grpc_clients import NoReplicaError

                log.exception("step failed for %d sequences", len(batch))
                code = grpc.StatusCode.UNAVAILABLE if isinstance(exc, NoReplicaError) else grpc.StatusCode.INTERNAL
                for job in jobs:
                    self._fail(job, RequestError(code, f"generation step failed: {exc}"))
                continue
            self.steps += 1
            self.metrics.record_step([s.steps[-1] for s in batch if s.steps], len(batch))
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

    def _publish(self, job: _Job) -> None:
        s = job.seq
        tokens = s.emitted[job.sent_tokens:]
        job.sent_tokens = len(s.emitted)
        self.metrics.tokens.inc(len(tokens))
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
        self.metrics.mal.observe(job.result.mean_accepted_length)
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
        return gen.GenerationStats(prompt_tokens=r.prompt_tokens, completion_tokens=len(r.token_ids),
                                   steps=len(r.steps), mean_accepted_length=r.mean_accepted_length,
                                   mean_tree_size_tokens=r.mean_tree_size, wall_time_ms=r.wall_time_s * 1e3,
                                   method=METHOD_ENUMS.get(job.method, gen.TREE_METHOD_UNSPECIFIED),
                                   mean_draft_ms=draft_ms, mean_score_ms=score_ms, mean_verify_ms=verify_ms)

    # ------------------------------------------------------------------ leaving
    def _fail(self, job: _Job, error: RequestError) -> None:
        job.queue.put_nowait(("error", error))
        self._leave(job, error.code.name)

    def _leave(self, job: _Job, code: str) -> None:
        job.done = True
        if job in self._active:
            self._active.remove(job)
        if job in self._waiting:
            self._waiting.remove(job)
        self.metrics.requests.inc(tags={"code": code, "method": job.method})
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


def _set_status(grpc_context, exc: RequestError) -> None:
    """Serve's gRPC context: a code set before raising is what the client receives."""
    if grpc_context is not None:
        grpc_context.set_code(exc.code)
        grpc_context.set_details(exc.message)


class RouterServicer(gen_grpc.TreeServeServicer):
    """The public API on a plain grpc.aio server (tests, in-process serving): same Router, `abort` for errors."""

    def __init__(self, router: Router):
        self.router = router

    async def Generate(self, request, context):
        try:
            return await self.router.generate(request)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)

    async def GenerateStream(self, request, context):
        try:
            async for message in self.router.stream(request):
                yield message
        except RequestError as exc:
            await context.abort(exc.code, exc.message)


class RouterReplica(Router):
    """Serve deployment class (wrapped by services/app.py): the engine's Target and Drafter are gRPC clients
    of the Target / Drafter replicas, found through the registry and the Serve handles. With an EAGLE drafter
    the target clients ask for features and the drafter client passes them on (services/grpc_clients.py)."""

    def __init__(self, args: dict | None, drafter_handle: Any = None, target_handle: Any = None):
        from treeserve.engine.pipeline import tree_config
        from treeserve.services.config import AppConfig
        from treeserve.services.drafter_service import limit_threads
        from treeserve.services.grpc_clients import (RemoteDrafter, RemoteTarget, ReplicaPool, replica_identity,
                                                     serve_discovery)
        from treeserve.v1 import internal_pb2_grpc as pb_grpc

        limit_threads()
        config = AppConfig.from_args(args)
        tokenizer, vocab_size = load_tokenizer(config.target.path)
        app, _, replica_id = replica_identity()
        max_bytes = config.grpc.max_message_bytes
        timeout = config.limits.request_timeout_s
        target_pool = ReplicaPool("Target", pb_grpc.TargetStub, serve_discovery(app, "Target", target_handle),
                                  max_bytes, refresh_period_s=1.0)
        target = RemoteTarget(target_pool, vocab_size, call_timeout_s=timeout, retry_timeout_s=timeout)
        drafter = None
        if drafter_handle is not None and config.speculation.method != AUTOREGRESSIVE:
            drafter_pool = ReplicaPool("Drafter", pb_grpc.DrafterStub,
                                       serve_discovery(app, "Drafter", drafter_handle), max_bytes,
                                       refresh_period_s=1.0)
            drafter = RemoteDrafter(drafter_pool, call_timeout_s=timeout,
                                    reads_target_features=config.drafter.reads_target_features())
            # Rows the target recomputes (a replica rebuilt the session) must reach the drafter replicas too.
            target.features_listener = drafter.features_rewritten
        engine = SpeculativeEngine(target, drafter, tokenizer,
                                   tree_config(config.speculation.method, config.speculation.budget),
                                   config.target.max_context_tokens)
        super().__init__(engine, config.limits, RouterMetrics(), clients=[target, drafter], router_id=replica_id)


def load_tokenizer(path: str) -> tuple[Any, int]:
    """The target's tokenizer and vocabulary size, without loading its weights."""
    from transformers import AutoConfig, AutoTokenizer

    from treeserve.engine.models.loading import resolve_model_dir

    model_dir = resolve_model_dir(path)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True), int(config.vocab_size)
