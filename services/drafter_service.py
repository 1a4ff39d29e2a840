"""The Drafter: a gRPC servicer over `LocalDrafter`, and the Serve deployment class that hosts it.

`DrafterServicer` is plain (inject any `LocalDrafter`; tests run it in-process). `DrafterReplica` is what
services/app.py deploys: it loads the drafter from the app config, starts the servicer on its own grpc.aio
server on a free port, publishes the address in the registry, and answers Serve's health checks. The router
sends each step's Draft over that direct channel; the Serve handle only serves `address()` for discovery.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import grpc

from treeserve.engine.builders import TreeConfig
from treeserve.engine.drafting import DraftRequest, LocalDrafter
from treeserve.services import wire
from treeserve.services.grpc_clients import Heartbeat, Registry, ReplicaServer, Worker, replica_identity
from treeserve.v1 import internal_pb2 as pb
from treeserve.v1 import internal_pb2_grpc as pb_grpc

log = logging.getLogger("treeserve.drafter")


def limit_threads() -> None:
    """One torch thread per replica: two under contention stalled forwards to ~400 ms (DESIGN.md 4)."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)


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


class DrafterServicer(pb_grpc.DrafterServicer):
    def __init__(self, drafter: LocalDrafter, vocab_size: int, replica_id: str = "local",
                 default_method: str = "dyspec"):
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.replica_id = replica_id
        self.address = ""
        self.default_method = default_method
        self.worker = Worker()

    def _requests(self, message: pb.DraftRequest) -> list[DraftRequest]:
        from treeserve.engine.pipeline import tree_config

        out = []
        for item in message.items:
            if not item.context:
                raise ValueError(f"session {item.session_id}: empty context")
            method = item.tree.method or self.default_method
            base = tree_config(method, "auto") if method != "autoregressive" else TreeConfig(method=method)
            config = wire.decode_tree_config(item.tree, base)
            out.append(DraftRequest(item.session_id, list(item.context), wire.decode_sampling(item.sampling),
                                    config, int(item.seed), wire.hint(item)))
        return out

    def _draft(self, message: pb.DraftRequest) -> pb.DraftResponse:
        started = time.perf_counter()
        for observation in message.observations:
            self.drafter.observe(wire.decode_observation(observation))
        # The router's whole batch shares one target forward, however many of its sequences hash here.
        trees = self.drafter.draft(self._requests(message), max(message.router_batch_size, len(message.items)))
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

    def _release(self, ids: list[str]) -> int:
        return sum(bool(self.drafter.release(s)) for s in ids)

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

    def _start_server(self, add_servicer, max_message_bytes: int) -> None:
        app, deployment, replica_id = replica_identity()
        self.replica_id = replica_id
        self.servicer.replica_id = replica_id
        self.server = ReplicaServer(add_servicer, self.servicer, max_message_bytes).start()
        self.servicer.address = self.server.address
        if Registry.available():
            self.heartbeat = Heartbeat(Registry(app, deployment), replica_id, self.server.address)
        log.info("%s replica %s serving gRPC on %s", deployment, replica_id, self.server.address)

    async def address(self) -> tuple[str, str]:
        """(replica id, host:port of this replica's gRPC server): discovery through the Serve handle."""
        return self.replica_id, self.server.address

    async def check_health(self) -> None:
        if not self.server.alive():
            raise RuntimeError("the replica's gRPC server is not running")

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metric (services/app.py session_autoscaling_policy): the per-step calls bypass
        Serve, so load is the number of sessions this replica is serving."""
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

    def __init__(self, args: dict | None = None, drafter: LocalDrafter | None = None, vocab_size: int | None = None):
        limit_threads()
        from treeserve.services.config import AppConfig

        config = AppConfig.from_args(args)
        if drafter is None:
            drafter, vocab_size = load_drafter_from_config(config)
        self.servicer = DrafterServicer(drafter, int(vocab_size), default_method=config.speculation.method)
        self._start_server(pb_grpc.add_DrafterServicer_to_server, config.grpc.max_message_bytes)


def load_drafter_from_config(config) -> tuple[LocalDrafter, int]:
    """LocalDrafter as the config says. The target model is loaded too: a restricted-vocabulary drafter
    shares its embeddings, and budget "auto" times the target's forward once (cached per machine)."""
    from treeserve.engine.models.loading import load_causal_lm
    from treeserve.engine.pipeline import build_local_drafter, parse_dtype

    dtype = parse_dtype(config.drafter.dtype)
    target = load_causal_lm(config.target.path, config.drafter.device, dtype)
    drafter = build_local_drafter(config.drafter.path, target.model, config.drafter.device, dtype,
                                  config.speculation.budget)
    if getattr(drafter, "reads_target_features", False):
        raise ValueError(f"drafter {config.drafter.path} is an EAGLE drafter: it reads the target's features, "
                         "which Target and Drafter replicas do not exchange; run it in-process "
                         "(`treeserve generate --in-process`, `treeserve bench`)")
    return drafter, int(target.model.config.vocab_size)
