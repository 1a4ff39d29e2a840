"""The router's view of one deployment's replicas, and calls that survive losing one.

`ReplicaPool` holds a channel per live replica (found through services/transport/discovery.py and probed with
Health before use), chooses each session's replica on a consistent-hash ring (so its KV cache is reused), drops
a replica that fails with a cool-down before it is probed again, and refreshes to see scale-out.

`GroupedCaller` sends per-session items grouped by their replica. Every request carries the full context, so
any replica can rebuild a session's cache: a group whose replica failed is sent again to the others. A replica
whose KV pool is full (RESOURCE_EXHAUSTED) is not a failed one: it stays in the pool, the group is offered to
the replicas with room, and when none has room the call fails with `ReplicasFullError` (the router answers
RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import grpc

from treeserve.services.transport.bridge import LoopBridge
from treeserve.services.transport.discovery import Discovery, Endpoint
from treeserve.services.transport.replica_server import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from treeserve.v1 import internal_pb2 as pb

log = logging.getLogger("treeserve.grpc")

# Status codes after which another replica may succeed (the replica died, restarts, or is overloaded).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                       grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED})
# Of those, the one a healthy replica answers when its KV pool (max_sessions x max_context_tokens) is full.
FULL = grpc.StatusCode.RESOURCE_EXHAUSTED


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass
class LiveReplica:
    endpoint: Endpoint
    channel: grpc.aio.Channel
    stub: Any


@dataclass
class ReplicaPool:
    """Live replicas of one deployment, chosen per session by consistent hashing."""

    name: str  # "Drafter" / "Target"
    stub_class: type
    discover: Discovery  # lists the deployment's replicas
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    virtual_nodes: int = 64
    cooldown_s: float = 10.0  # a dropped replica is not re-probed before this
    refresh_period_s: float = 5.0  # background refresh (scale-out) at most this often
    probe_timeout_s: float = 2.0
    internal_secret: str | None = None  # signs every call (services/internal_auth.py)
    live: dict[str, LiveReplica] = field(default_factory=dict)
    _dropped: dict[str, float] = field(default_factory=dict)
    _ring: list[tuple[int, str]] = field(default_factory=list)
    _last_refresh: float = 0.0
    _lock: asyncio.Lock | None = None

    # -------------------------------------------------------------- choice
    def pick(self, session_id: str, exclude: set[str] = frozenset()) -> LiveReplica | None:
        """The session's replica: first ring point clockwise of hash(session) not excluded."""
        if not self._ring:
            return None
        start = bisect.bisect(self._ring, (_hash(session_id), ""))
        for i in range(len(self._ring)):
            replica = self._ring[(start + i) % len(self._ring)][1]
            if replica not in exclude:
                return self.live[replica]
        return None

    def _rebuild_ring(self) -> None:
        self._ring = sorted((_hash(f"{rid}#{v}"), rid) for rid in self.live for v in range(self.virtual_nodes))

    # -------------------------------------------------------------- membership
    def drop(self, replica_id: str, reason: str = "") -> None:
        live = self.live.pop(replica_id, None)
        if live is None:
            return
        log.warning("dropping %s replica %s (%s): %s", self.name, replica_id, live.endpoint.address, reason)
        self._dropped[replica_id] = time.monotonic()
        self._rebuild_ring()
        asyncio.ensure_future(live.channel.close())

    async def refresh(self, force: bool = False) -> None:
        """Re-list replicas: add new ones that answer a Health probe, forget ones no longer listed."""
        now = time.monotonic()
        if not force and now - self._last_refresh < self.refresh_period_s:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if not force and time.monotonic() - self._last_refresh < self.refresh_period_s:
                return
            try:
                listed = await self.discover()
            except Exception as exc:
                log.warning("%s discovery failed: %s", self.name, exc)
                listed = []
            self._last_refresh = time.monotonic()
            ids = {e.replica_id for e in listed}
            for rid in [r for r in self.live if r not in ids and listed]:
                self.drop(rid, "no longer registered")
            new = [e for e in listed if e.replica_id not in self.live
                   and time.monotonic() - self._dropped.get(e.replica_id, -1e9) >= self.cooldown_s]
            probes = await asyncio.gather(*(self._probe(e) for e in new))
            for endpoint, live in zip(new, probes):
                if live is not None:
                    self.live[endpoint.replica_id] = live
                    self._dropped.pop(endpoint.replica_id, None)
                else:
                    self._dropped[endpoint.replica_id] = time.monotonic()
                    await asyncio.to_thread(self.discover.forget, endpoint)
            self._rebuild_ring()

    async def _probe(self, endpoint: Endpoint) -> LiveReplica | None:
        from treeserve.services.internal_auth import client_interceptors

        channel = grpc.aio.insecure_channel(endpoint.address, options=channel_options(self.max_message_bytes),
                                            interceptors=client_interceptors(self.internal_secret, endpoint.address))
        stub = self.stub_class(channel)
        try:
            await stub.Health(pb.HealthRequest(), timeout=self.probe_timeout_s)
        except Exception:
            await channel.close()
            return None
        return LiveReplica(endpoint, channel, stub)

    async def wait_for_replica(self, deadline: float) -> bool:
        """Refresh until a replica is live or the monotonic `deadline` passes."""
        delay = 0.1
        while not self.live:
            await self.refresh(force=True)
            if self.live:
                break
            if time.monotonic() + delay > deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)
        return True

    async def broadcast(self, method: str, request: Any, timeout_s: float = 5.0) -> list[Any]:
        """Call `method` on every live replica; failures are ignored (returns the successful replies)."""
        lives = list(self.live.values())
        replies = await asyncio.gather(*(getattr(l.stub, method)(request, timeout=timeout_s) for l in lives),
                                       return_exceptions=True)
        return [r for r in replies if not isinstance(r, BaseException)]

    async def close(self) -> None:
        for live in list(self.live.values()):
            await live.channel.close()
        self.live.clear()
        self._ring = []




class NoReplicaError(RuntimeError):
    """No replica answered before the retry deadline."""


class ReplicasFullError(NoReplicaError):
    """Every live replica refused the call with RESOURCE_EXHAUSTED: their KV pools are full. The replicas are
    healthy and stay in the pool; the request is over the deployment's capacity."""


class Retry(Exception):
    """A reply that is unusable (wrong item count, missing features): treated like a failed replica."""


def describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


class GroupedCaller(LoopBridge):
    """Send per-session items grouped by their affine replica. On a retryable failure drop the replica and
    re-send the failed group's items (regrouped on the smaller ring) until `retry_timeout_s` passes. A full
    replica (RESOURCE_EXHAUSTED) stays in the pool: its group goes to the replicas not yet refused for this call,
    and `ReplicasFullError` says when none has room."""

    def __init__(self, pool: ReplicaPool, call_timeout_s: float, retry_timeout_s: float):
        self.pool = pool
        self.call_timeout_s = call_timeout_s
        self.retry_timeout_s = retry_timeout_s
        self.retries = 0

    wait_for_live = True  # False: fail at once (NoReplicaError) when no replica is live

    async def _grouped(self, items: list[Any], session_of: Callable[[Any], str],
                       send: Callable[[LiveReplica, list[Any]], Awaitable[list[Any]]],
                       deadline: float | None = None, full: dict[str, str] | None = None) -> list[Any]:
        """`full`: replica id -> its refusal, for the replicas that said RESOURCE_EXHAUSTED during this call."""
        deadline = deadline or time.monotonic() + self.retry_timeout_s
        full = {} if full is None else full
        await self.pool.refresh()
        if not self.pool.live and not (self.wait_for_live and await self.pool.wait_for_replica(deadline)):
            raise NoReplicaError(f"no live {self.pool.name} replica")
        groups: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            live = self.pool.pick(session_of(item), exclude=set(full))
            if live is None:
                raise ReplicasFullError(
                    f"every {self.pool.name} replica is full ({len(full)} refused: "
                    f"{'; '.join(sorted(set(full.values())))}); retry later or raise max_sessions / replicas")
            groups.setdefault(live.endpoint.replica_id, []).append(i)
        results: list[Any] = [None] * len(items)

        async def run(replica_id: str, idx: list[int]) -> None:
            group = [items[i] for i in idx]
            live = self.pool.live.get(replica_id)
            try:
                if live is None:
                    raise Retry("replica dropped meanwhile")
                out = await send(live, group)
            except (grpc.aio.AioRpcError, Retry) as exc:
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() not in RETRYABLE:
                    raise
                if time.monotonic() >= deadline:
                    raise NoReplicaError(f"{self.pool.name} call failed and the retry deadline passed: {exc}")
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == FULL:
                    full[replica_id] = exc.details() or "KV pool full"
                elif live is not None:
                    self.pool.drop(replica_id, describe(exc))
                self.retries += 1
                out = await self._grouped(group, session_of, send, deadline, full)
            for i, value in zip(idx, out):
                results[i] = value

        await asyncio.gather(*(run(rid, idx) for rid, idx in groups.items()))
        return results

    async def release_async(self, session_id: str) -> int:
        """Drop the session on every live replica (a retry may have moved it); returns how many held it. A
        background task: it waits for a busy replica (up to 30 s) rather than leave the session behind, and a
        replica it misses frees the session once idle (SessionClock)."""
        await self.pool.refresh()
        replies = await self.pool.broadcast("Release", pb.ReleaseRequest(session_ids=[session_id]), timeout_s=30.0)
        return sum(r.released for r in replies)

    def release(self, session_id: str) -> bool:
        return self._sync(self.release_async(session_id)) > 0
