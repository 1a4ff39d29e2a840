"""What every Drafter / Target replica shares: its gRPC server, registry heartbeat, health and session upkeep.

`GrpcReplica` is the base of the Serve deployment classes (services/drafter_service.py, target_service.py):
it starts the servicer on its own server (services/transport/replica_server.py) on this node's address,
publishes the address (services/transport/discovery.py), answers Serve's health checks, and reports live
sessions as the custom autoscaling metric (services/app.py session_autoscaling_policy). `SessionClock` frees the sessions of a
router that went away.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

from ..internal_auth import registry_scope
from .discovery import Heartbeat, Registry, replica_identity
from .replica_server import ReplicaServer

log = logging.getLogger("treeserve.replica")


class SessionClock:
    """When each session was last used on a replica. A session nobody used for `idle_s` is an orphan: the
    router that owned it died (its Release never came) or lost track of it. Replicas free such sessions
    (`DrafterServicer.sweep`, `TargetServicer.sweep`), so a dead router's sessions neither hold KV-cache rows
    nor keep the session-based autoscaling policy scaled up. `idle_s=None` never expires anything."""

    def __init__(self, idle_s: float | None = None, period_s: float = 10.0):
        self.idle_s = idle_s
        self.period_s = period_s
        self._last: dict[str, float] = {}
        self._swept = time.monotonic()

    def touch(self, session_ids: Iterable[str]) -> None:
        now = time.monotonic()
        for session_id in session_ids:
            self._last[session_id] = now

    def forget(self, session_ids: Iterable[str]) -> None:
        for session_id in session_ids:
            self._last.pop(session_id, None)

    def due(self) -> bool:
        return self.idle_s is not None and time.monotonic() - self._swept >= self.period_s

    def stale(self) -> list[str]:
        """Sessions idle for longer than idle_s (and marks a sweep done)."""
        now = self._swept = time.monotonic()
        if self.idle_s is None:
            return []
        return [s for s, t in list(self._last.items()) if now - t > self.idle_s]

    def sweep(self, release: Callable[[list[str]], int]) -> int:
        """Free the stale sessions with `release` (a servicer's own release); logs how many went."""
        stale = self.stale()
        released = release(stale) if stale else 0
        if released:
            log.info(
                "released %d session(s) idle for more than %.0f s (their router went away)", released, self.idle_s)
        return released


class GrpcReplica:
    """Shared replica plumbing: server start, registry heartbeat, health, shutdown."""

    servicer: Any
    server: ReplicaServer
    heartbeat: Heartbeat | None = None

    def _start_server(self, add_servicer, max_message_bytes: int, internal_secret: str | None) -> None:
        """Start the replica's gRPC server on this node's own address. Inside Serve the application secret is
        required: every internal rpc is authenticated with it (services/internal_auth.py)."""
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
