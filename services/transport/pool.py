"""The router's view of one deployment's replicas, and calls that survive losing one.

`ReplicaPool` holds a channel per live replica (found through services/transport/discovery.py and probed with
Health before use), places each new session on the live replica holding the fewest of its sessions (ties
broken by a consistent-hash ring) and keeps it there, so its KV cache is reused, and refreshes to see scale-out. A replica is marked down the moment a call to it fails or its connection drops (a
watch on each channel's connectivity sees a killed replica within milliseconds, before any call to it): it leaves
the ring at once, so its sessions and new ones go to live replicas only, and discovery does not bring it back while its
registry entry is still listed (a killed replica's entry stays until its heartbeats age out). It is probed again,
and re-admitted only if the probe answers, once its registry heartbeat is newer than the failure (it is running),
after a cool-down, or when no replica is left and a caller is waiting for one.

`GroupedCaller` sends per-session items grouped by their replica. Every request carries the full context, so
any replica can rebuild a session's cache: a group whose replica failed is sent again to the others. A replica
whose KV pool is full (RESOURCE_EXHAUSTED) is not a failed one: it stays in the pool, the group is offered to
the replicas with room, and when none has room the call fails with `ReplicasFullError` (the router answers
RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import grpc

from treeserve.v1 import internal_pb2 as pb
from ..internal_auth import client_interceptors
from .discovery import Discovery, Endpoint
from .prefix_affinity import PrefixIndex, block_hashes
from .replica_server import DEFAULT_MAX_MESSAGE_BYTES, channel_options

log = logging.getLogger("treeserve.grpc")

# Status codes after which another replica may succeed (the replica died, restarts, or is overloaded).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                       grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED})
# Of those, the one a healthy replica answers when its KV pool (max_sessions x max_context_tokens) is full.
FULL = grpc.StatusCode.RESOURCE_EXHAUSTED

_State = grpc.ChannelConnectivity
# A replica marked down keeps its channel this long for the calls already on it: closing a grpc.aio channel
# cancels them (asyncio.CancelledError in the caller), where on a dead connection they fail by themselves
# (UNAVAILABLE) and on a live replica they may still finish.
CLOSE_GRACE_S = 30.0
# A new session goes to the replica holding the longest prefix of its context unless that replica holds more than
# this many sessions beyond the least-loaded one (SGLang's cache-aware router balances with such an absolute
# threshold): a lane that far ahead costs its streams more than the prefill the prefix saves.
PREFIX_LOAD_MARGIN = 2
# ... and only for a prefix worth a prefill: at least this many tokens and this share of the context (SGLang's
# cache_threshold is 0.5). Every chat shares its template's opening: alone it would herd every session onto one lane.
PREFIX_MIN_TOKENS = 64
PREFIX_MIN_SHARE = 0.5


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass
class LiveReplica:
    endpoint: Endpoint
    channel: grpc.aio.Channel
    stub: Any


@dataclass
class Down:
    """A replica marked down: when (monotonic, for the cool-down), and the newest registry heartbeat that does not
    prove it running (wall clock: the failure's time, or a heartbeat whose probe then failed)."""

    at: float
    seen_heartbeat: float
    reason: str


@dataclass
class ReplicaPool:
    """Live replicas of one deployment, and the one each session is placed on (`pick`)."""

    name: str  # "Drafter" / "Target"
    stub_class: type
    discover: Discovery  # lists the deployment's replicas
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    virtual_nodes: int = 64
    cooldown_s: float = 10.0  # a replica marked down is not re-probed before this (unless it heartbeats anew)
    refresh_period_s: float = 5.0  # background refresh (scale-out) at most this often
    probe_timeout_s: float = 2.0
    internal_secret: str | None = None  # signs every call (services/internal_auth.py)
    watch_connections: bool = True  # mark a replica down when its channel fails (see `_watch`)
    on_down: Callable[[str, str], None] | None = None  # (pool name, reason) per replica marked down: metrics
    live: dict[str, LiveReplica] = field(default_factory=dict)
    down: dict[str, Down] = field(default_factory=dict)
    marked_down: int = 0  # replicas taken out of the ring after a failed call or a dropped connection
    _ring: list[tuple[int, str]] = field(default_factory=list)
    _placed: dict[str, str] = field(default_factory=dict)  # session id -> replica id it was placed on
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)  # what prompts went where (prefix placement)
    _last_refresh: float = 0.0
    _lock: asyncio.Lock | None = None
    _watchers: dict[str, asyncio.Task] = field(default_factory=dict)
    _refresh_task: asyncio.Task | None = None

    # -------------------------------------------------------------- choice
    def pick(self, session_id: str, exclude: set[str] = frozenset(),
             prefix: tuple[str, list[int]] | None = None) -> LiveReplica | None:
        """The session's replica: the one it was placed on, while that one is live and not excluded; else (a new
        session, or its replica lost or full) a live replica not excluded, where it is placed from then on: the
        one holding the longest prefix of its `prefix` ((cache scope, context): services/transport/
        prefix_affinity.py) when that prefix is worth a prefill (PREFIX_MIN_TOKENS, PREFIX_MIN_SHARE), unless it
        holds more than PREFIX_LOAD_MARGIN sessions beyond the least-loaded one;
        else the one holding the fewest of this pool's sessions, ties broken by the consistent-hash ring (first
        point clockwise of hash(session)). Least-loaded placement gives every replica an equal share of a
        router's batch (the hash alone gave one of two Target replicas 5-7 of 8 sessions), and the router steps
        each Target replica's sessions as a lane of their own (services/router.py)."""
        placed = self._placed.get(session_id)
        if placed in self.live and placed not in exclude:
            return self.live[placed]
        if not self._ring:
            return None
        start = bisect.bisect(self._ring, (_hash(session_id), ""))
        order = [self._ring[(start + i) % len(self._ring)][1] for i in range(len(self._ring))]
        candidates = list(dict.fromkeys(r for r in order if r not in exclude))
        if not candidates:
            return None
        load = collections.Counter(r for r in self._placed.values() if r in self.live)
        chosen = min(candidates, key=lambda r: load[r])  # min keeps the first of equals: ring order
        if prefix is not None:
            hashes = block_hashes(prefix[0], prefix[1][:-1], self.prefixes.block_tokens)
            within = [r for r in candidates if load[r] <= load[chosen] + PREFIX_LOAD_MARGIN]
            held = max(within, key=lambda r: (self.prefixes.matched(r, hashes), -load[r]))
            matched = self.prefixes.matched(held, hashes) * self.prefixes.block_tokens
            if matched >= max(PREFIX_MIN_TOKENS, PREFIX_MIN_SHARE * len(prefix[1])):
                chosen = held
            self.prefixes.insert(chosen, hashes)
        self._placed[session_id] = chosen
        return self.live[chosen]

    def forget(self, session_id: str, prefix: tuple[str, list[int]] | None = None) -> None:
        """The session ended: it no longer counts toward its replica's load, and its final `prefix` (cache scope,
        context: the prompt and the answer, which the replica keeps cached) is what that replica holds now: a
        conversation's next turn goes there."""
        replica = self._placed.pop(session_id, None)
        if replica is not None and prefix is not None and replica in self.live:
            self.prefixes.insert(replica, block_hashes(prefix[0], prefix[1], self.prefixes.block_tokens))

    def _rebuild_ring(self) -> None:
        self._ring = sorted((_hash(f"{rid}#{v}"), rid) for rid in self.live for v in range(self.virtual_nodes))

    # -------------------------------------------------------------- membership
    def _remove(self, replica_id: str, live: LiveReplica | None) -> LiveReplica | None:
        """Take the replica out of the ring and close its channel; `live`: only if it is still that instance (a
        failure seen on an old channel must not remove a replica re-admitted meanwhile)."""
        current = self.live.get(replica_id)
        if current is None or (live is not None and current is not live):
            return None
        del self.live[replica_id]
        self.prefixes.drop(replica_id)
        watcher = self._watchers.pop(replica_id, None)
        if watcher is not None and watcher is not _current_task():
            watcher.cancel()
        self._rebuild_ring()
        asyncio.ensure_future(current.channel.close(CLOSE_GRACE_S))
        return current

    def mark_down(self, replica_id: str, reason: str = "", live: LiveReplica | None = None) -> None:
        """A call to the replica failed or its connection dropped: no new session goes to it, and discovery does not
        re-admit it until a probe answers (see the module docstring)."""
        removed = self._remove(replica_id, live)
        if removed is None:
            return
        log.warning("%s replica %s (%s) marked down: %s", self.name, replica_id, removed.endpoint.address, reason)
        self.down[replica_id] = Down(time.monotonic(), time.time(), reason)
        self.marked_down += 1
        if self.on_down is not None:
            self.on_down(self.name, reason)

    def _probe_due(self, endpoint: Endpoint, now: float, desperate: bool) -> bool:
        """Whether a listed replica not in the ring should be probed now. `desperate`: none is live and the caller
        waits for one, so every listed replica is worth a probe."""
        down = self.down.get(endpoint.replica_id)
        if down is None or desperate:
            return True
        if endpoint.heartbeat is not None and endpoint.heartbeat > down.seen_heartbeat:
            return True  # it re-published after the failure: running (a probe still decides)
        return now - down.at >= self.cooldown_s

    async def refresh(self, force: bool = False) -> None:
        """Re-list replicas: add those that answer a Health probe, forget ones no longer listed. At most every
        `refresh_period_s` unless forced. Only the first refresh and forced ones are awaited: the others run in
        the background, so a step never waits on discovery or on probing an address that does not answer."""
        if force or not self._last_refresh:
            await self._refresh(force)
            return
        if time.monotonic() - self._last_refresh < self.refresh_period_s:
            return
        if self._refresh_task is None or self._refresh_task.done():
            self._refresh_task = asyncio.ensure_future(self._refresh(False))
            self._refresh_task.add_done_callback(_log_failure)

    async def _refresh(self, force: bool) -> None:
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
            if listed:  # an empty list is more likely a discovery hiccup than every replica gone
                for rid in [r for r in self.live if r not in ids]:
                    self._remove(rid, None)
                    log.warning("%s replica %s no longer registered", self.name, rid)
                for rid in [r for r in self.down if r not in ids]:
                    del self.down[rid]  # its entry is gone: should it come back, it is probed like a new one
            now = time.monotonic()
            desperate = force and not self.live
            new = [e for e in listed if e.replica_id not in self.live and self._probe_due(e, now, desperate)]
            probes = await asyncio.gather(*(self._probe(e) for e in new))
            for endpoint, live in zip(new, probes):
                rid = endpoint.replica_id
                if live is not None:
                    previous = self.down.pop(rid, None)
                    if previous is not None:
                        log.info("%s replica %s (%s) answers again; back in the pool", self.name, rid,
                                 endpoint.address)
                    self.live[rid] = live
                    self._start_watch(rid, live)
                else:
                    previous = self.down.get(rid)
                    seen = max(previous.seen_heartbeat if previous else time.time(), endpoint.heartbeat or 0.0)
                    self.down[rid] = Down(time.monotonic(), seen, "did not answer its probe")
                    try:
                        await asyncio.to_thread(self.discover.forget, endpoint)
                    except Exception as exc:
                        log.warning("could not withdraw %s replica %s: %s", self.name, rid, exc)
            self._rebuild_ring()

    async def _probe(self, endpoint: Endpoint) -> LiveReplica | None:
        channel = grpc.aio.insecure_channel(endpoint.address, options=channel_options(self.max_message_bytes),
                                            interceptors=client_interceptors(self.internal_secret, endpoint.address))
        stub = self.stub_class(channel)
        try:
            await stub.Health(pb.HealthRequest(), timeout=self.probe_timeout_s)
        except Exception:
            await channel.close()
            return None
        return LiveReplica(endpoint, channel, stub)

    # -------------------------------------------------------------- connection watch
    def _start_watch(self, replica_id: str, live: LiveReplica) -> None:
        if self.watch_connections:
            self._watchers[replica_id] = asyncio.ensure_future(self._watch(replica_id, live))

    async def _watch(self, replica_id: str, live: LiveReplica) -> None:
        """Mark the replica down as soon as its channel fails to connect. A replica killed on a live host closes
        its connection: the channel goes IDLE, and reconnecting at once (rather than at the next call) finds the
        port closed within milliseconds (TRANSIENT_FAILURE), so the ring loses it before any session is sent
        there. A live replica's channel that went IDLE (idle timeout, GOAWAY) just reconnects."""
        channel = live.channel
        try:
            state = channel.get_state(try_to_connect=True)
            while self.live.get(replica_id) is live:
                if state == _State.TRANSIENT_FAILURE:
                    self.mark_down(replica_id, "connection lost", live)
                    return
                if state == _State.SHUTDOWN:
                    return
                if state == _State.IDLE:
                    state = channel.get_state(try_to_connect=True)
                    if state != _State.IDLE:
                        continue
                await channel.wait_for_state_change(state)
                state = channel.get_state()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the channel closed under the watch: nothing left to watch
            log.debug("%s replica %s: connection watch ended: %r", self.name, replica_id, exc)
        finally:
            if self._watchers.get(replica_id) is _current_task():
                del self._watchers[replica_id]

    # -------------------------------------------------------------- waiting, broadcast, close
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
        tasks = list(self._watchers.values()) + ([self._refresh_task] if self._refresh_task is not None else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._watchers.clear()
        for live in list(self.live.values()):
            await live.channel.close()
        self.live.clear()
        self._ring = []


def _current_task() -> asyncio.Task | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop
        return None


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("background replica refresh failed: %r", task.exception())


class NoReplicaError(RuntimeError):
    """No replica answered before the retry deadline."""


class ReplicasFullError(NoReplicaError):
    """Every live replica refused the call with RESOURCE_EXHAUSTED: their KV pools are full. The replicas are
    healthy and stay in the pool; the request is over the deployment's capacity."""


class MessageTooLargeError(ReplicasFullError):
    """A call or its reply exceeded grpc.max_message_bytes (gRPC answers RESOURCE_EXHAUSTED for that too): the
    request is over what the deployment is configured to carry, not a full or failed replica; no retry helps."""


class Retry(Exception):
    """A reply that is unusable (wrong item count, missing features): treated like a failed replica."""


def describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


class GroupedCaller:
    """Send per-session items grouped by their affine replica. On a retryable failure mark the replica down and
    re-send the failed group's items (regrouped on the smaller ring) until `retry_timeout_s` passes. A full
    replica (RESOURCE_EXHAUSTED) stays in the pool: its group goes to the replicas not yet refused for this call,
    and `ReplicasFullError` says when none has room. `on_retry(deployment)` hears of each re-sent group (the
    router's metrics)."""

    def __init__(self, pool: ReplicaPool, call_timeout_s: float, retry_timeout_s: float,
                 on_retry: Callable[[str], None] | None = None):
        self.pool = pool
        self.call_timeout_s = call_timeout_s
        self.retry_timeout_s = retry_timeout_s
        self.retries = 0
        self.on_retry = on_retry

    wait_for_live = True  # False: fail at once (NoReplicaError) when no replica is live

    async def _grouped(self, items: list[Any], session_of: Callable[[Any], str],
                       send: Callable[[LiveReplica, list[Any]], Awaitable[list[Any]]],
                       deadline: float | None = None, full: dict[str, str] | None = None) -> list[Any]:
        """`items`: engine DraftRequests or ScoreRequests (a new session is placed by its cache scope and context);
        `full`: replica id -> its refusal, for the replicas that said RESOURCE_EXHAUSTED during this call."""
        deadline = deadline or time.monotonic() + self.retry_timeout_s
        full = {} if full is None else full
        await self.pool.refresh()
        if not self.pool.live and not (self.wait_for_live and await self.pool.wait_for_replica(deadline)):
            raise NoReplicaError(f"no live {self.pool.name} replica")
        groups: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            live = self.pool.pick(session_of(item), exclude=set(full), prefix=(item.cache_scope, item.context))
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
                    raise Retry("replica marked down meanwhile")
                try:
                    out = await send(live, group)
                except asyncio.CancelledError:
                    # grpc.aio cancels the calls of a channel being closed (its replica was marked down and the
                    # grace passed): a failed call, unless this task itself is being cancelled.
                    if asyncio.current_task().cancelling():
                        raise
                    raise Retry("call cancelled: its replica's channel was closed") from None
            except (grpc.aio.AioRpcError, Retry) as exc:
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() not in RETRYABLE:
                    raise
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == FULL and \
                        "larger than max" in (exc.details() or ""):
                    raise MessageTooLargeError(
                        f"a {self.pool.name} message is over grpc.max_message_bytes ({exc.details()}): lower the "
                        "tree budget or raise grpc.max_message_bytes") from None
                if time.monotonic() >= deadline:
                    raise NoReplicaError(f"{self.pool.name} call failed and the retry deadline passed: {exc}")
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == FULL:
                    full[replica_id] = exc.details() or "KV pool full"
                elif live is not None:
                    self.pool.mark_down(replica_id, describe(exc), live)
                self.retries += 1
                if self.on_retry is not None:
                    self.on_retry(self.pool.name)
                out = await self._grouped(group, session_of, send, deadline, full)
            for i, value in zip(idx, out):
                results[i] = value

        await asyncio.gather(*(run(rid, idx) for rid, idx in groups.items()))
        return results

    async def release(self, session_id: str, prefix: tuple[str, list[int]] | None = None) -> bool:
        """Drop the session on every live replica (a retry may have moved it); True if any held it. A background
        task: it waits for a busy replica (up to 30 s) rather than leave the session behind, and a replica it
        misses frees the session once idle (SessionClock). `prefix`: its final (cache scope, context), cached where
        it ran (placement by prefix)."""
        self.pool.forget(session_id, prefix)
        await self.pool.refresh()
        replies = await self.pool.broadcast("Release", pb.ReleaseRequest(session_ids=[session_id]), timeout_s=30.0)
        return sum(r.released for r in replies) > 0
