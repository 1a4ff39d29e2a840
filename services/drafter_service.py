"""The Drafter: a gRPC servicer over `LocalDrafter`, and the Serve deployment class that hosts it.

`DrafterServicer` is plain (inject any `LocalDrafter`; tests run it in-process). `DrafterReplica` is what
services/app.py deploys: it loads the drafter from the app config, starts the servicer on its own grpc.aio
server on a free port, publishes the address in the registry, and answers Serve's health checks. The router
sends each step's Draft over that direct channel; the Serve handle only serves `address()` for discovery.

An EAGLE drafter reads the target's features of the whole context, which the router sends in deltas (the
rows since the last Draft this replica answered for the session). `FeatureStore` keeps each session's rows
like a cache: freed on Release and when the drafter evicts the session's KV cache. A delta that starts past
the rows held (restart, scale-out, retry on another replica, eviction) is never guessed at: the reply lists
the session in `features_missing` and the router resends its rows from position 0.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import grpc
import torch

from treeserve.engine.builders import DEFAULT_METHOD, TreeConfig
from treeserve.engine.drafting import DraftRequest, LocalDrafter
from treeserve.engine.speculative_engine import CommittedFeatures
from treeserve.engine.runners.cached_lm import KVPoolExhausted
from treeserve.services import wire
from treeserve.services.grpc_clients import Heartbeat, Registry, ReplicaServer, SessionClock, Worker, replica_identity
from treeserve.v1 import internal_pb2 as pb
from treeserve.v1 import internal_pb2_grpc as pb_grpc

log = logging.getLogger("treeserve.drafter")


def limit_threads() -> None:
    """One torch thread per replica: two under contention stalled forwards to ~400 ms (DESIGN.md 4)."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    from treeserve.services.grpc_clients import quiet_poller_noise

    quiet_poller_noise()


def session_ids_of(obj: Any) -> list[str]:
    """Session ids with a cache in a LocalDrafter / TargetRunner (through its CachedLM), else []."""
    for path in (("runner", "lm"), ("lm",)):
        cur = obj
        for name in path:
            cur = getattr(cur, name, None)
        if cur is not None and hasattr(cur, "sessions"):
            return list(cur.sessions)
    sessions = getattr(obj, "session_ids", None)
    return list(sessions()) if callable(sessions) else []


class FeatureStore:
    """Each session's target features of context[:-1] on a Drafter replica, built from the router's deltas:
    one `CommittedFeatures` buffer per session (a step writes only its new rows and hands the drafter a view
    of all of them, no copy of the whole context per step)."""

    def __init__(self, width: int):
        self.width = width  # the target's hidden size
        self._sessions: dict[str, CommittedFeatures] = {}

    @property
    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def length(self, session_id: str) -> int:
        """Rows held for the session: those of context positions [0, length)."""
        held = self._sessions.get(session_id)
        return len(held) if held is not None else 0

    def write(self, session_id: str, start: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows of positions [start, start + len(rows)) replace those held from `start` on; returns a view of
        all the session's rows. `start` must not exceed `length(session_id)`."""
        held = self._sessions.setdefault(session_id, CommittedFeatures())
        try:
            held.write(start, rows)
        except ValueError as exc:
            raise ValueError(f"session {session_id}: {exc}") from None
        return held.rows

    def release(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    def retain(self, session_ids: set[str]) -> None:
        """Free every session not in `session_ids` (those whose drafter KV cache was evicted)."""
        for session_id in [s for s in self._sessions if s not in session_ids]:
            self.release(session_id)


class DrafterServicer(pb_grpc.DrafterServicer):
    def __init__(self, drafter: LocalDrafter, vocab_size: int, replica_id: str = "local",
                 default_method: str = DEFAULT_METHOD):
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.replica_id = replica_id
        self.address = ""
        self.default_method = default_method
        self.worker = Worker()
        self.clock = SessionClock()  # replicas set clock.idle_s: orphaned sessions are freed
        # Only an EAGLE drafter reads the target's features (the hidden size, or 3x it for EAGLE-3's fused layers).
        self.features = (FeatureStore(drafter.runner.target_feature_size)
                         if getattr(drafter, "reads_target_features", False) else None)

    def _requests(self, message: pb.DraftRequest) -> list[tuple[DraftRequest, tuple[torch.Tensor, int] | None]]:
        """Each item as a DraftRequest (without its features) and its feature delta (rows, start), if any."""
        from treeserve.engine.factory import tree_config

        out = []
        for item in message.items:
            if not item.context:
                raise ValueError(f"session {item.session_id}: empty context")
            method = item.tree.method or self.default_method
            base = tree_config(method, "auto") if method != "autoregressive" else TreeConfig(method=method)
            config = wire.decode_tree_config(item.tree, base)
            request = DraftRequest(item.session_id, list(item.context), wire.decode_sampling(item.sampling),
                                   config, int(item.seed), wire.hint(item))
            out.append((request, self._delta(item) if item.HasField("features") else None))
        return out

    def _delta(self, item: pb.DraftItem) -> tuple[torch.Tensor, int]:
        """An item's feature rows and start, checked against the context and the target's hidden size."""
        if self.features is None:
            raise ValueError(f"session {item.session_id}: features sent to a drafter that does not read them "
                             "(not an EAGLE drafter)")
        try:
            rows, start = wire.decode_features(item.features)
        except ValueError as exc:
            raise ValueError(f"session {item.session_id}: {exc}") from None
        if rows.shape[1] != self.features.width:
            raise ValueError(f"session {item.session_id}: features are {rows.shape[1]} wide, the target's hidden "
                             f"size is {self.features.width}")
        if start + rows.shape[0] != len(item.context) - 1:
            raise ValueError(f"session {item.session_id}: features cover positions [{start}, "
                             f"{start + rows.shape[0]}), expected up to len(context) - 1 = {len(item.context) - 1}")
        return rows, start

    def _draft(self, message: pb.DraftRequest) -> pb.DraftResponse:
        started = time.perf_counter()
        self.clock.touch(item.session_id for item in message.items)
        if self.clock.due():
            self.sweep()
        items = self._requests(message)
        missing = [r.session_id for r, delta in items
                   if delta is not None and delta[1] > self.features.length(r.session_id)]
        if missing:  # nothing drafted or observed: the router sends this call again with those rows in full
            return pb.DraftResponse(features_missing=missing)
        for observation in message.observations:
            self.drafter.observe(wire.decode_observation(observation))
        requests = []
        for request, delta in items:
            if delta is not None:
                rows, start = delta
                request.features = self.features.write(request.session_id, start, rows)
            requests.append(request)
        try:
            # The router's whole batch shares one target forward, however many of its sequences hash here.
            trees = self.drafter.draft(requests, max(message.router_batch_size, len(message.items)))
        finally:
            if self.features is not None:  # rows of sessions whose KV cache the drafter evicted go with it
                self.features.retain(set(self.session_ids()))
        return pb.DraftResponse(trees=[wire.encode_tree(t) for t in trees],
                                draft_ms=(time.perf_counter() - started) * 1e3,
                                draft_model_ms=getattr(self.drafter, "last_model_ms", 0.0),
                                draft_forward_ms=getattr(self.drafter, "last_forward_ms", 0.0),
                                plain_steps_held=int(getattr(self.drafter, "hold_steps", 0)))

    async def Draft(self, request: pb.DraftRequest, context) -> pb.DraftResponse:
        try:
            return await self.worker.run(self._draft, request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KVPoolExhausted as exc:  # the bounded KV pool (max_sessions x max_context_tokens) is full
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))

    def _release(self, ids: list[str]) -> int:
        released = 0
        for session_id in ids:
            held = bool(self.drafter.release(session_id))
            if self.features is not None:
                held = self.features.release(session_id) or held
            released += held
        self.clock.forget(ids)
        return released

    def sweep(self) -> int:
        """Free sessions idle past clock.idle_s (their router is gone). Runs on the model thread."""
        return self.clock.sweep(self._release)

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=await self.worker.run(self._release, list(request.session_ids)))

    def session_ids(self) -> list[str]:
        return session_ids_of(self.drafter)

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        sessions = self.session_ids()
        return pb.HealthResponse(replica_id=self.replica_id, address=self.address, active_sessions=len(sessions),
                                 session_ids=sessions, vocab_size=self.vocab_size, calls=self.worker.calls)


class GrpcReplica:
    """Shared replica plumbing: server start, registry heartbeat, health, shutdown."""

    servicer: Any
    server: ReplicaServer
    heartbeat: Heartbeat | None = None

    def _start_server(self, add_servicer, max_message_bytes: int, internal_secret: str | None) -> None:
        """Start the replica's gRPC server on this node's own address. Inside Serve the application secret is
        required: every internal rpc is authenticated with it (services/internal_auth.py)."""
        from treeserve.services.internal_auth import registry_scope

        app, deployment, replica_id = replica_identity()
        if not internal_secret and Registry.available():
            raise ValueError(f"{deployment} replica started without the application's internal secret; build the "
                             "application with treeserve.services.app (build_app / build_app_from_config)")
        self.replica_id = replica_id
        self.servicer.replica_id = replica_id
        self.server = ReplicaServer(add_servicer, self.servicer, max_message_bytes,
                                    internal_secret=internal_secret).start()
        self.servicer.address = self.server.address
        if Registry.available():
            self.heartbeat = Heartbeat(Registry(app, deployment, registry_scope(internal_secret)), replica_id,
                                       self.server.address)
        log.info("%s replica %s serving gRPC on %s (internal rpcs %s)", deployment, replica_id, self.server.address,
                 "authenticated" if internal_secret else "NOT authenticated")

    async def address(self) -> tuple[str, str]:
        """(replica id, host:port of this replica's gRPC server): discovery through the Serve handle."""
        return self.replica_id, self.server.address

    async def check_health(self) -> None:
        if not self.server.alive():
            raise RuntimeError("the replica's gRPC server is not running")

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metric (services/app.py session_autoscaling_policy): the per-step calls bypass
        Serve, so load is the number of sessions this replica is serving. Also where idle sessions get swept
        while no call arrives (the sweep runs on the model thread)."""
        if self.servicer.clock.due():
            self.servicer.worker.submit(self.servicer.sweep)
        return {"active_sessions": float(len(self.servicer.session_ids()))}

    def __del__(self) -> None:
        try:
            if self.heartbeat is not None:
                self.heartbeat.stop()
            self.server.stop(0.5)
        except Exception:
            pass


class DrafterReplica(GrpcReplica):
    """Serve deployment class (wrapped by services/app.py): loads the drafter from the app `args`."""

    def __init__(self, args: dict | None = None, drafter: LocalDrafter | None = None, vocab_size: int | None = None,
                 internal_secret: str | None = None):
        limit_threads()
        from treeserve.services.config import AppConfig

        config = AppConfig.from_args(args)
        if drafter is None:
            drafter, vocab_size = load_drafter_from_config(config)
        self.servicer = DrafterServicer(drafter, int(vocab_size), default_method=config.speculation.method)
        # No request outlives limits.request_timeout_s; a session unused for twice that has no router.
        self.servicer.clock.idle_s = 2 * config.limits.request_timeout_s
        self._start_server(pb_grpc.add_DrafterServicer_to_server, config.grpc.max_message_bytes, internal_secret)


def load_drafter_from_config(config) -> tuple[LocalDrafter, int]:
    """LocalDrafter as the config says. Budget "auto" times the target's forward once (cached per machine), so
    the whole target is loaded then; with a fixed budget only the parts a drafter borrows are (its config,
    embeddings, final norm and LM head: engine/models/target_parts.py), which is what lets a drafter replica
    sit beside a 70B tensor-parallel target on a share of one GPU."""
    from treeserve.engine.models.loading import load_causal_lm
    from treeserve.engine.factory import build_local_drafter, parse_dtype
    from treeserve.engine.runners.kv_pool import limit_gpu_memory

    dtype = parse_dtype(config.drafter.dtype)
    limit_gpu_memory(config.drafter.device, config.drafter.gpu_memory_fraction)
    if config.speculation.budget == "auto":
        target = load_causal_lm(config.target.path, config.drafter.device, dtype).model
    else:
        from treeserve.engine.models.target_parts import load_target_parts

        target = load_target_parts(config.target.path, config.drafter.device, dtype)
    drafter = build_local_drafter(config.drafter.path, target, config.drafter.device, dtype,
                                  config.speculation.budget)
    # The KV pool is preallocated now: max_sessions x max_context_tokens (treeserve memory-estimate).
    lm = drafter.runner.lm if hasattr(drafter, "runner") else drafter.lm
    lm.bound(config.kv_sessions("drafter"), config.drafter.max_context_tokens)
    lm.warm_up()
    return drafter, int(target.config.vocab_size)
