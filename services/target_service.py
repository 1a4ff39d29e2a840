"""The Target: a gRPC servicer over a `TargetRunner` (or the tensor-parallel target), and its Serve class.

Score returns compact distributions (argmax at temperature 0, sparse rows under top-k/top-p, dense float32
otherwise; services/wire.py), and, when an item asks (`want_features`, for an EAGLE drafter), the target's
features of the rows it fed (services/features.py). Every item carries the full context, so a replica that never
saw the session (scaled out, restarted) rebuilds it.
"""

from __future__ import annotations

import time
from typing import Protocol

import grpc

from treeserve.engine.drafters.models.loading import target_feature_layers
from treeserve.engine.factory import parse_dtype
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.runners.cached_lm import CachedLM
from treeserve.engine.runners.kv_pool import KVPoolExhausted, limit_gpu_memory
from treeserve.engine.runners.step_settings import default_static_step
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.parts import LocalTarget
from treeserve.v1 import internal_pb2 as pb, internal_pb2_grpc as pb_grpc
from . import wire
from .features import FeaturesUnavailable, check_target_provides
from .metrics import KVMetrics
from .transport.replica import GrpcReplica, SessionClock
from .transport.replica_server import Worker, limit_threads



class ServedTarget(LocalTarget, Protocol):
    """What a Target replica serves: an in-process target (engine/parts.py `LocalTarget`: a `TargetRunner` or the
    tensor-parallel target), and the KV cache of its sessions where this process holds it (health reports, idle
    sweeps)."""

    lm: CachedLM | None  # None where the tensor-parallel ranks hold the cache


class TargetServicer(pb_grpc.TargetServicer):
    def __init__(self, runner: ServedTarget, replica_id: str = "local", dense_dtype: str = "float32"):
        self.runner = runner
        self.vocab_size = int(runner.vocab_size)
        self.replica_id = replica_id
        self.address = ""
        self.dense_dtype = dense_dtype
        self.worker = Worker()
        self.clock = SessionClock()  # replicas set clock.idle_s: orphaned sessions are freed
        self._seen: set[str] = set()  # for runners that do not expose their sessions (TP)
        self.kv_metrics = KVMetrics("Target", replica_id)

    def _score(self, message: pb.ScoreRequest) -> pb.ScoreResponse:
        started = time.perf_counter()
        self.clock.touch(item.session_id for item in message.items)
        if self.clock.due():
            self.sweep()
        requests = []
        for item in message.items:
            check_target_provides(item, type(self.runner).__name__, self.runner.provides_features)
            requests.append(wire.decode_score_item(item))
        dists = self.runner.score(requests)
        self._seen.update(r.session_id for r in requests)
        self.kv_metrics.record(self.runner.lm)
        return pb.ScoreResponse(dists=[wire.encode_dists(d, self.dense_dtype) for d in dists],
                                score_ms=(time.perf_counter() - started) * 1e3)

    async def Score(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        try:
            return await self.worker.run(self._score, request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KVPoolExhausted as exc:  # the bounded KV pool (max_sessions x max_context_tokens) is full
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except FeaturesUnavailable as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    def _release(self, ids: list[str]) -> int:
        released = 0
        for session_id in ids:
            released += bool(self.runner.release(session_id))
            self._seen.discard(session_id)
        self.clock.forget(ids)
        return released

    def sweep(self) -> int:
        """Free sessions idle past clock.idle_s (their router is gone). Runs on the model thread."""
        return self.clock.sweep(self._release)

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=await self.worker.run(self._release, list(request.session_ids)))

    def session_ids(self) -> list[str]:
        # A TargetRunner's KV pool knows its sessions (evictions included); a tensor-parallel target's ranks hold
        # them (its `lm` is None), so the servicer counts the ones it scored and did not release.
        return list(self.runner.lm.sessions) if self.runner.lm is not None else sorted(self._seen)

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        sessions = self.session_ids()
        return pb.HealthResponse(replica_id=self.replica_id, address=self.address, active_sessions=len(sessions),
                                 session_ids=sessions, vocab_size=self.vocab_size, calls=self.worker.calls)


class TargetReplica(GrpcReplica):
    """Serve deployment class (wrapped by services/app.py): loads the target from the app `args`."""

    def __init__(self, args: dict | None = None, runner: ServedTarget | None = None,
                 internal_secret: str | None = None):
        limit_threads()
        from .config import AppConfig

        config = AppConfig.from_args(args)
        self.runner = runner if runner is not None else load_target_from_config(config)
        # A tensor-parallel target's rank actors can die while this replica lives: its health() raises then.
        self.tensor_parallel = config.target.tensor_parallel_size > 1
        self.servicer = TargetServicer(self.runner)
        # No request outlives limits.request_timeout_s; a session unused for twice that has no router.
        self.servicer.clock.idle_s = 2 * config.limits.request_timeout_s
        self._start_server(pb_grpc.add_TargetServicer_to_server, config.grpc.max_message_bytes, internal_secret)

    async def check_health(self) -> None:
        await super().check_health()
        if self.tensor_parallel:  # TensorParallelTarget.health raises if a rank died
            self.runner.health()


def load_target_from_config(config) -> ServedTarget:
    """TargetRunner for tensor_parallel_size 1; the tensor-parallel target (services/tp_target.py) above."""
    target = config.target
    # The KV pool is preallocated at start: kv_cache_tokens in pages (treeserve memory-estimate).
    sessions = config.kv_sessions("target")

    # An EAGLE-3 drafter fuses several target layers: the Target returns exactly those with its scores (read
    # from the drafter's config.json alone; EAGLE-1/2 and other drafters: None, the final state).
    facts = config.target.facts()
    feature_layers = target_feature_layers(config.drafter.path, facts.num_hidden_layers if facts else None)
    static = default_static_step(target.device, target.cuda_graphs, target.graph_memory_mib, max_rows=sessions,
                                 fused_ops=target.fused_ops)
    if target.tensor_parallel_size > 1:
        from .tp_target import TensorParallelTarget  # lazy: needs Ray and torch.distributed

        return TensorParallelTarget(target.path, target.tensor_parallel_size, target.device, target.dtype,
                                    max_sessions=sessions, max_context_tokens=target.max_context_tokens,
                                    static=static, kv=target.kv(),
                                    gpu_memory_fraction=target.gpu_memory_fraction, feature_layers=feature_layers)

    dtype = parse_dtype(target.dtype)
    limit_gpu_memory(target.device, target.gpu_memory_fraction)
    loaded = load_causal_lm(target.path, target.device, dtype)
    runner = TargetRunner(loaded.model, target.device, dtype, max_sessions=sessions, feature_layers=feature_layers,
                          static=static, tokenizer=loaded.tokenizer)
    runner.lm.bound(sessions, target.max_context_tokens, target.kv())
    runner.lm.warm_up()
    return runner
