"""Discovery: where replicas publish their gRPC address and how the router lists them.

Every Drafter / Target replica publishes `host:port` in Ray's internal KV as soon as its server is up
(`Registry`) and re-publishes it on a `Heartbeat`; the router's pools list the registry (`serve_discovery`).
Tests without Ray pass fixed addresses (`static_discovery`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

log = logging.getLogger("treeserve.grpc")


def replica_identity() -> tuple[str, str, str]:
    """(app name, deployment name, replica id) inside a Serve replica; a process-unique id elsewhere."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return ctx.app_name, ctx.deployment, ctx.replica_id.unique_id
    except Exception:
        return "local", "local", f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class Endpoint:
    replica_id: str
    address: str
    # Wall-clock time (time.time() on the replica) of its last registry heartbeat; None where the source has no
    # heartbeat (a fixed list, the deployment handle). A pool re-probes a replica it marked down once this is
    # newer than the failure: the replica is evidently still running (services/transport/pool.py).
    heartbeat: float | None = field(default=None, compare=False)


HEARTBEAT_PERIOD_S = 5.0
# Three missed heartbeats: a live replica re-publishes every period (a GCS hiccup may cost it one).
STALE_AFTER_S = 3 * HEARTBEAT_PERIOD_S


class Registry:
    """Replica addresses in Ray's internal KV: key replicas/<app>/<scope>/<deployment>/<replica>, value JSON.
    `scope` (internal_auth.registry_scope of the application secret) separates application builds: a router
    lists only the replicas that accept its tokens."""

    NAMESPACE = "treeserve"

    def __init__(self, app: str, deployment: str, scope: str = ""):
        self.prefix = f"replicas/{app}/{scope + '/' if scope else ''}{deployment}/"

    @staticmethod
    def available() -> bool:
        try:
            from ray.experimental.internal_kv import _internal_kv_initialized

            return bool(_internal_kv_initialized())
        except Exception:
            return False

    def publish(self, replica_id: str, address: str) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        value = json.dumps({"replica_id": replica_id, "address": address, "pid": os.getpid(), "time": time.time()})
        _internal_kv_put(self.prefix + replica_id, value, overwrite=True, namespace=self.NAMESPACE)

    def withdraw(self, replica_id: str) -> None:
        from ray.experimental.internal_kv import _internal_kv_del

        try:
            _internal_kv_del(self.prefix + replica_id, namespace=self.NAMESPACE)
        except Exception:  # pragma: no cover - Ray already shutting down
            pass

    def list(self, max_age_s: float = STALE_AFTER_S) -> list[Endpoint]:
        """The published replicas, without those whose last heartbeat is older than `max_age_s`: a replica
        killed outright never withdraws its entry, and until a router's probe forgets it, everyone listing the
        registry would try it."""
        from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

        oldest = time.time() - max_age_s
        out = []
        for key in _internal_kv_list(self.prefix, namespace=self.NAMESPACE):
            raw = _internal_kv_get(key, namespace=self.NAMESPACE)
            if raw:
                data = json.loads(raw)
                if data.get("time", oldest) >= oldest:
                    out.append(Endpoint(data["replica_id"], data["address"], data.get("time")))
        return out


class Heartbeat:
    """Publishes a replica's address now and every `period_s` (re-creates the entry if a router removed it)."""

    def __init__(self, registry: Registry, replica_id: str, address: str, period_s: float = HEARTBEAT_PERIOD_S):
        self.registry, self.replica_id, self.address = registry, replica_id, address
        self._stop = threading.Event()
        registry.publish(replica_id, address)
        self._thread = threading.Thread(target=self._run, daemon=True, name="treeserve-heartbeat")
        self._period = period_s
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self.registry.publish(self.replica_id, self.address)
            except Exception:  # pragma: no cover - GCS briefly unreachable
                pass

    def stop(self) -> None:
        self._stop.set()
        self.registry.withdraw(self.replica_id)


class Discovery:
    """What a pool asks for its deployment's replicas: `await discovery()` lists them, `forget(endpoint)` tells
    the source that a listed replica did not answer."""

    async def __call__(self) -> list[Endpoint]:
        raise NotImplementedError

    def forget(self, endpoint: Endpoint) -> None:
        """A listed replica did not answer its probe (nothing to do for a fixed list)."""


class RegistryDiscovery(Discovery):
    """The registry (every replica publishes itself there as soon as its server is up); the deployment handle
    only where there is no registry (no Ray KV).

    The handle is never asked while the registry is reachable: with no replica running (one was killed and Serve
    is restarting it), a handle call waits until one comes up, and a step waiting on it would freeze every
    stream, where an empty list lets the drafter client fall back to plain decoding at once."""

    def __init__(self, app: str, deployment: str, handle: Any = None, scope: str = ""):
        self.registry = Registry(app, deployment, scope)
        self.deployment = deployment
        self.handle = handle

    async def __call__(self) -> list[Endpoint]:
        if Registry.available():
            return await asyncio.to_thread(self.registry.list)
        if self.handle is None:
            return []
        try:
            replica_id, address = await asyncio.wait_for(self.handle.address.remote(), timeout=10.0)
            return [Endpoint(replica_id, address)]
        except Exception as exc:
            log.warning("no %s replica reachable through its handle: %s", self.deployment, exc)
            return []

    def forget(self, endpoint: Endpoint) -> None:
        # A dead replica's entry; a live one re-publishes within its heartbeat period anyway.
        if Registry.available():
            self.registry.withdraw(endpoint.replica_id)


class StaticDiscovery(Discovery):
    """A fixed list of addresses (tests, in-process serving): each address is its own replica id."""

    def __init__(self, addresses: Iterable[str]):
        self.endpoints = [Endpoint(a, a) for a in addresses]

    async def __call__(self) -> list[Endpoint]:
        return list(self.endpoints)


def serve_discovery(app: str, deployment: str, handle: Any = None, scope: str = "") -> RegistryDiscovery:
    """Discovery of a Serve deployment's replicas (scoped to one application build)."""
    return RegistryDiscovery(app, deployment, handle, scope)


def static_discovery(addresses: Iterable[str]) -> StaticDiscovery:
    return StaticDiscovery(addresses)
