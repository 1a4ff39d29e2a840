"""Direct gRPC between the router and the drafter / target replicas (DESIGN.md section 3).

Serve owns lifecycle, health and scaling; the per-step traffic (trees, distributions) goes over direct
grpc.aio channels because a DeploymentHandle round trip costs ~5x a gRPC call on a small box. Pieces:

- `ReplicaServer`: a grpc.aio server on a free port, run on its own thread and event loop inside a replica
  (independent of Serve's loops), with the replica's address (`host:port`).
- `Registry`: where replicas publish their address (Ray's internal KV, keyed by app / deployment / replica),
  with a heartbeat; `serve_registry_discovery` lists it for the router.
- `ReplicaPool`: the router's view of one deployment's live replicas: channels (max message length raised
  above 4 MB), a consistent-hash ring for session-affine choice, drop-on-failure with a cool-down, refresh.
- `RemoteTarget` / `RemoteDrafter`: the engine's Target / Drafter protocols over the pool. The async methods
  run on the router's event loop; the sync protocol methods (called by `SpeculativeEngine.step` on a worker
  thread) bridge onto that loop. A failed call drops that replica, refreshes and retries the affected
  sessions on another one: every request carries the full context, so any replica rebuilds the cache.
  For an EAGLE drafter the target returns its features with the scores and `RemoteDrafter` sends each
  Drafter replica only the rows it does not hold yet, resending them all when the replica says it lacks them.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable

import grpc

from treeserve.engine.drafting import AUTOREGRESSIVE, DraftRequest, root_only
from treeserve.engine.requests import StepRecord
from treeserve.engine.runners.target import ScoreRequest
from treeserve.engine.tree import TokenTree
from treeserve.engine.verify import TargetDists
from treeserve.services import wire
from treeserve.v1 import internal_pb2 as pb

log = logging.getLogger("treeserve.grpc")

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Status codes after which another replica may succeed (the replica died, restarts, or is overloaded).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                       grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED})


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # Fail fast on a dead replica instead of waiting in reconnect backoff.
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.enable_retries", 0)]


class _PollerNoiseFilter(logging.Filter):
    """grpc.aio used from more than one event loop in a process (a replica's server loop beside Serve's own)
    makes every loop but one find the completion queue's wake-up byte already read: a harmless BlockingIOError
    in PollerCompletionQueue._handle_events, logged by asyncio as an error each time (grpc/grpc#25364, the fix
    grpc/grpc#36096 is not released). Drop exactly those records."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BlockingIOError) and "_handle_events" in record.getMessage():
            return False
        return True


_POLLER_FILTER = _PollerNoiseFilter()


def quiet_poller_noise() -> None:
    """Install the filter on asyncio's logger (idempotent; uvloop logs through the same logger)."""
    logger = logging.getLogger("asyncio")
    if _POLLER_FILTER not in logger.filters:
        logger.addFilter(_POLLER_FILTER)


def node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # pragma: no cover - Ray missing or not in a worker
        pass
    return "127.0.0.1"


# ================================================================================================ server side
class ReplicaServer:
    """A grpc.aio server on its own thread and event loop; `address` is `host:port` once started.

    It listens on `host` only (default: this node's own address, never all interfaces unless `bind_host` says
    "0.0.0.0"). With `internal_secret` every rpc must carry the address-bound internal token
    (services/internal_auth.py); `credentials` (grpc.ServerCredentials) turn TLS on; `interceptors` run before
    the servicer (the public API's token check)."""

    def __init__(self, add_servicer: Callable[[Any, Any], None], servicer: Any,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, host: str | None = None, port: int = 0,
                 *, bind_host: str | None = None, internal_secret: str | None = None,
                 credentials: Any = None, interceptors: Iterable[Any] = (), options: Iterable[tuple] = (),
                 maximum_concurrent_rpcs: int | None = None):
        self._add = add_servicer
        self._servicer = servicer
        self._options = [o for o in channel_options(max_message_bytes)
                         if o[0] not in {k for k, _ in options}] + list(options)
        self._host = host or node_ip()
        self._bind_host = bind_host or self._host
        self._port_wanted = port
        self._credentials = credentials
        self._interceptors = list(interceptors)
        if internal_secret:
            from treeserve.services.internal_auth import InternalAuthInterceptor

            self._interceptors.insert(0, InternalAuthInterceptor(internal_secret, lambda: self.address))
        self._max_rpcs = maximum_concurrent_rpcs
        self.port = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._stopping: asyncio.Event | None = None  # set by stop(), on the server's loop
        self._grace_s = 1.0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="treeserve-grpc", daemon=True)

    @property
    def address(self) -> str:
        return f"{self._host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "ReplicaServer":
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError("gRPC server did not start")
        if self._error is not None:
            raise RuntimeError(f"gRPC server failed to start: {self._error}")
        return self

    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
            # Tasks the servicer started on this loop (a Router's step loop) end with the server.
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        except BaseException as exc:  # pragma: no cover - reported through start()/alive()
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        quiet_poller_noise()
        self._server = grpc.aio.server(options=self._options, interceptors=self._interceptors or None,
                                       maximum_concurrent_rpcs=self._max_rpcs)
        self._add(self._servicer, self._server)
        host = f"[{self._bind_host}]" if ":" in self._bind_host else self._bind_host
        bind = f"{host}:{self._port_wanted}"
        if self._credentials is not None:
            self.port = self._server.add_secure_port(bind, self._credentials)
        else:
            self.port = self._server.add_insecure_port(bind)
        if not self.port:
            raise RuntimeError(f"cannot listen on {bind}")
        self._stopping = asyncio.Event()
        await self._server.start()
        self._ready.set()
        await self._stopping.wait()
        # Stopped here, on the server's own loop: a stop awaited from another thread could outlive the loop
        # (which ends with the server) and wait out its timeout.
        await self._server.stop(self._grace_s)

    def stop(self, grace_s: float = 1.0) -> None:
        if self.loop is not None and self._server is not None and self._thread.is_alive():
            self._grace_s = grace_s
            self.loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout=grace_s + 5)


class Worker:
    """Runs blocking model work on one thread (models and caches are not thread-safe), off the server loop,
    so Health answers while a forward runs."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="treeserve-model")
        self.calls = 0

    async def run(self, fn: Callable, *args) -> Any:
        self.calls += 1
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit(self, fn: Callable, *args) -> Any:
        """Queue `fn` on the model thread from any thread, without waiting (a concurrent.futures.Future)."""
        return self._pool.submit(fn, *args)


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
            logging.getLogger("treeserve.replica").info(
                "released %d session(s) idle for more than %.0f s (their router went away)", released, self.idle_s)
        return released


def replica_identity() -> tuple[str, str, str]:
    """(app name, deployment name, replica id) inside a Serve replica; a process-unique id elsewhere."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return ctx.app_name, ctx.deployment, ctx.replica_id.unique_id
    except Exception:
        return "local", "local", f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


# ================================================================================================ discovery
@dataclass(frozen=True)
class Endpoint:
    replica_id: str
    address: str


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

    def list(self) -> list[Endpoint]:
        from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

        out = []
        for key in _internal_kv_list(self.prefix, namespace=self.NAMESPACE):
            raw = _internal_kv_get(key, namespace=self.NAMESPACE)
            if raw:
                data = json.loads(raw)
                out.append(Endpoint(data["replica_id"], data["address"]))
        return out


class Heartbeat:
    """Publishes a replica's address now and every `period_s` (re-creates the entry if a router removed it)."""

    def __init__(self, registry: Registry, replica_id: str, address: str, period_s: float = 5.0):
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


def serve_discovery(app: str, deployment: str, handle: Any = None,
                    scope: str = "") -> Callable[[], Awaitable[list[Endpoint]]]:
    """Discovery for a pool: the registry (every replica publishes itself there as soon as its server is up);
    the deployment handle only where there is no registry (no Ray KV).

    The handle is never asked while the registry is reachable: with no replica running (one was killed and Serve
    is restarting it), a handle call waits until one comes up, and a step waiting on it would freeze every
    stream, where an empty list lets the drafter client fall back to plain decoding at once."""
    registry = Registry(app, deployment, scope)

    async def discover() -> list[Endpoint]:
        if Registry.available():
            return await asyncio.to_thread(registry.list)
        if handle is None:
            return []
        try:
            replica_id, address = await asyncio.wait_for(handle.address.remote(), timeout=10.0)
            return [Endpoint(replica_id, address)]
        except Exception as exc:
            log.warning("no %s replica reachable through its handle: %s", deployment, exc)
            return []

    def forget(endpoint: Endpoint) -> None:
        # A dead replica's entry; a live one re-publishes within its heartbeat period anyway.
        if Registry.available():
            registry.withdraw(endpoint.replica_id)

    discover.forget = forget
    return discover


def static_discovery(addresses: Iterable[str]) -> Callable[[], Awaitable[list[Endpoint]]]:
    endpoints = [Endpoint(a, a) for a in addresses]

    async def discover() -> list[Endpoint]:
        return list(endpoints)

    return discover


# ================================================================================================ the pool
def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass
class _Live:
    endpoint: Endpoint
    channel: grpc.aio.Channel
    stub: Any


@dataclass
class ReplicaPool:
    """Live replicas of one deployment, chosen per session by consistent hashing."""

    name: str  # "Drafter" / "Target"
    stub_class: type
    discover: Callable[[], Awaitable[list[Endpoint]]]
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    virtual_nodes: int = 64
    cooldown_s: float = 10.0  # a dropped replica is not re-probed before this
    refresh_period_s: float = 5.0  # background refresh (scale-out) at most this often
    probe_timeout_s: float = 2.0
    internal_secret: str | None = None  # signs every call (services/internal_auth.py)
    live: dict[str, _Live] = field(default_factory=dict)
    _dropped: dict[str, float] = field(default_factory=dict)
    _ring: list[tuple[int, str]] = field(default_factory=list)
    _last_refresh: float = 0.0
    _lock: asyncio.Lock | None = None

    # -------------------------------------------------------------- choice
    def pick(self, session_id: str, exclude: set[str] = frozenset()) -> _Live | None:
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
                    forget = getattr(self.discover, "forget", None)
                    if forget is not None:
                        await asyncio.to_thread(forget, endpoint)
            self._rebuild_ring()

    async def _probe(self, endpoint: Endpoint) -> _Live | None:
        from treeserve.services.internal_auth import client_interceptors

        channel = grpc.aio.insecure_channel(endpoint.address, options=channel_options(self.max_message_bytes),
                                            interceptors=client_interceptors(self.internal_secret, endpoint.address))
        stub = self.stub_class(channel)
        try:
            await stub.Health(pb.HealthRequest(), timeout=self.probe_timeout_s)
        except Exception:
            await channel.close()
            return None
        return _Live(endpoint, channel, stub)

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


# ================================================================================================ clients
class NoReplicaError(RuntimeError):
    """No replica answered before the retry deadline."""


class _Bridge:
    """Run the async client methods from the engine's worker thread on the router's loop."""

    loop: asyncio.AbstractEventLoop | None = None

    def _sync(self, coro: Awaitable) -> Any:
        loop = self.loop
        if loop is None:
            raise RuntimeError("client not bound to an event loop (call bind_loop)")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            coro.close()
            raise RuntimeError("sync client method called on its own event loop; use the async method")
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def bind_loop(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()


class _GroupedCaller(_Bridge):
    """Send per-session items grouped by their affine replica; on a retryable failure drop the replica and
    re-send the failed group's items (regrouped on the smaller ring) until `retry_timeout_s` passes."""

    def __init__(self, pool: ReplicaPool, call_timeout_s: float, retry_timeout_s: float):
        self.pool = pool
        self.call_timeout_s = call_timeout_s
        self.retry_timeout_s = retry_timeout_s
        self.retries = 0

    wait_for_live = True  # False: fail at once (NoReplicaError) when no replica is live

    async def _grouped(self, items: list[Any], session_of: Callable[[Any], str],
                       send: Callable[[Any, list[Any]], Awaitable[list[Any]]],
                       deadline: float | None = None) -> list[Any]:
        deadline = deadline or time.monotonic() + self.retry_timeout_s
        await self.pool.refresh()
        if not self.pool.live and not (self.wait_for_live and await self.pool.wait_for_replica(deadline)):
            raise NoReplicaError(f"no live {self.pool.name} replica")
        groups: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            live = self.pool.pick(session_of(item))
            groups.setdefault(live.endpoint.replica_id, []).append(i)
        results: list[Any] = [None] * len(items)

        async def run(replica_id: str, idx: list[int]) -> None:
            group = [items[i] for i in idx]
            live = self.pool.live.get(replica_id)
            try:
                if live is None:
                    raise _Retry("replica dropped meanwhile")
                out = await send(live, group)
            except (grpc.aio.AioRpcError, _Retry) as exc:
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() not in RETRYABLE:
                    raise
                if time.monotonic() >= deadline:
                    raise NoReplicaError(f"{self.pool.name} call failed and the retry deadline passed: {exc}")
                if live is not None:
                    self.pool.drop(replica_id, _describe(exc))
                self.retries += 1
                out = await self._grouped(group, session_of, send, deadline)
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


class _Retry(Exception):
    pass


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


class RemoteTarget(_GroupedCaller):
    """engine Target protocol over Target replicas.

    `features_listener(session_id, features_start)` is called for every score that returned the target's
    features: the router's rows from `features_start` on are replaced by them (usually only new rows; all of
    them when a target replica rebuilt the session), which a `RemoteDrafter` must pass on to its replicas."""

    # Honours ScoreRequest.want_features (the engine checks it for an EAGLE drafter): Target replicas return the
    # features whether they hold a TargetRunner or a tensor-parallel group (services/tp_target.py).
    provides_features = True

    def __init__(self, pool: ReplicaPool, vocab_size: int, call_timeout_s: float = 120.0,
                 retry_timeout_s: float = 120.0, features_listener: Callable[[str, int], None] | None = None):
        super().__init__(pool, call_timeout_s, retry_timeout_s)
        self.vocab_size = vocab_size
        self.features_listener = features_listener
        self.last_score_ms = 0.0

    async def score_async(self, requests: list[ScoreRequest]) -> list[TargetDists]:
        async def send(live: _Live, group: list[ScoreRequest]) -> list[TargetDists]:
            message = pb.ScoreRequest(items=[_score_item(r) for r in group])
            reply = await live.stub.Score(message, timeout=self.call_timeout_s)
            if len(reply.dists) != len(group):
                raise _Retry(f"replica returned {len(reply.dists)} results for {len(group)} trees")
            if any(r.want_features and not d.HasField("features") for r, d in zip(group, reply.dists)):
                raise _Retry("replica returned no features for an item that asked for them")
            self.last_score_ms = reply.score_ms
            return [wire.decode_dists(d) for d in reply.dists]

        dists = await self._grouped(requests, lambda r: r.session_id, send)
        if self.features_listener is not None:
            for r, d in zip(requests, dists):
                if d.features is not None:
                    self.features_listener(r.session_id, d.features_start)
        return dists

    def score(self, requests: list[ScoreRequest]) -> list[TargetDists]:
        return self._sync(self.score_async(requests))

    async def prefill_async(self, session_id: str, context: list[int]) -> int:
        async def send(live: _Live, group: list[tuple[str, list[int]]]) -> list[int]:
            reply = await live.stub.Prefill(pb.PrefillRequest(session_id=group[0][0], context=group[0][1]),
                                            timeout=self.call_timeout_s)
            return [reply.cached_tokens]

        return (await self._grouped([(session_id, context)], lambda x: x[0], send))[0]


def _score_item(r: ScoreRequest) -> pb.ScoreItem:
    item = pb.ScoreItem(session_id=r.session_id, context=r.context, tree=wire.encode_tree(r.tree),
                        sampling=wire.encode_sampling(r.sampling), want_features=r.want_features)
    if r.accepted_nodes is not None:
        item.has_accepted_nodes = True
        item.accepted_nodes.extend(r.accepted_nodes)
    return item


class RemoteDrafter(_GroupedCaller):
    """engine Drafter protocol over Drafter replicas. Without a live drafter the step degrades to a root-only
    tree (one autoregressive step): it costs time, never tokens.

    With `reads_target_features` (an EAGLE drafter) each DraftRequest carries the target's features of its
    context, [len(context) - 1, hidden]. Sending them all every step would cost len(context) x hidden floats
    (32 MB at 1k tokens for a hidden size of 8192); a step adds a few rows. So the client keeps, per session
    and replica address, how many rows that replica holds, and sends only the rows after them. The replica
    is a cache: one that lacks the rows a delta builds on lists the session in `features_missing`, and the
    call is sent again with that session's rows from 0. Rows the target replaced (`features_rewritten`,
    wired to `RemoteTarget.features_listener`) are sent again too."""

    wait_for_live = False  # a step without a drafter is still a step: never wait for one

    def __init__(self, pool: ReplicaPool, call_timeout_s: float = 60.0, retry_timeout_s: float = 2.0,
                 reads_target_features: bool = False):
        super().__init__(pool, call_timeout_s, retry_timeout_s)
        self.reads_target_features = reads_target_features  # the engine then scores with want_features
        # session -> replica address -> feature rows (context positions [0, n)) that replica holds
        self._feature_rows: dict[str, dict[str, int]] = {}
        self.feature_resends = 0  # sessions whose rows a replica lacked and were sent again from 0
        self._observations: list[pb.StepObservation] = []
        self.fallbacks = 0
        self.last_model_ms = 0.0  # drafter runner time of the last draft call (engine StepRecord)
        self.last_forward_ms = 0.0  # of which model forwards
        self.hold_steps = 0  # further steps the replica's chooser decided are plain decoding (engine skips them)

    async def draft_async(self, requests: list[DraftRequest], batch_size: int | None = None) -> list[TokenTree]:
        observations, self._observations = self._observations[-64:], []
        holds: list[int] = []

        async def send(live: _Live, group: list[DraftRequest]) -> list[TokenTree]:
            address = live.endpoint.address
            resend: set[str] = set()  # sessions whose features go from position 0
            while True:
                items = [_draft_item(r, self._features_for(r, address, r.session_id in resend)) for r in group]
                message = pb.DraftRequest(items=items, observations=observations,
                                          router_batch_size=batch_size or len(requests))
                reply = await live.stub.Draft(message, timeout=self.call_timeout_s)
                if not reply.features_missing:
                    break
                # Each round sends more sessions in full, and a full send cannot be missing: this ends.
                missing = set(reply.features_missing)
                if not missing <= {r.session_id for r in group} - resend:
                    raise _Retry(f"replica reported features missing for {sorted(missing)} which it was sent in "
                                 "full or not at all")
                log.info("%s replica %s lacks the features of %d session(s); sending them in full", self.pool.name,
                         address, len(missing))
                self.feature_resends += len(missing)
                resend |= missing
            if len(reply.trees) != len(group):
                raise _Retry(f"replica returned {len(reply.trees)} trees for {len(group)} requests")
            for r in group:
                if self._sends_features(r):
                    self._feature_rows.setdefault(r.session_id, {})[address] = r.features.shape[0]
            self.last_model_ms, self.last_forward_ms = reply.draft_model_ms, reply.draft_forward_ms
            holds.append(reply.plain_steps_held)
            return [wire.decode_tree(t) for t in reply.trees]

        try:
            trees = await self._grouped(requests, lambda r: r.session_id, send)
            self.hold_steps = min(holds, default=0)  # several replicas: skip only what all of them decided
            return trees
        except NoReplicaError as exc:
            self.fallbacks += 1
            self.hold_steps = 0
            self.last_model_ms = self.last_forward_ms = 0.0
            log.warning("drafting skipped for this step (%s): root-only trees", exc)
            return [root_only(r.context) for r in requests]

    def draft(self, requests: list[DraftRequest], batch_size: int | None = None) -> list[TokenTree]:
        return self._sync(self.draft_async(requests, batch_size))

    def observe(self, record: StepRecord) -> None:
        # Sent with the next Draft call (the budget choosers live in the drafter replica). Steps without
        # a draft count too: they measure plain decoding, the budget-0 arm.
        self._observations.append(wire.encode_observation(record))

    def features_rewritten(self, session_id: str, start: int) -> None:
        """The router's feature rows of the session from context position `start` on were (re)computed:
        no replica holds them yet (RemoteTarget.features_listener)."""
        for address, held in self._feature_rows.get(session_id, {}).items():
            self._feature_rows[session_id][address] = min(held, start)

    async def release_async(self, session_id: str) -> int:
        self._feature_rows.pop(session_id, None)
        return await super().release_async(session_id)

    @staticmethod
    def _sends_features(r: DraftRequest) -> bool:
        # An autoregressive item is not drafted: its rows wait for the session's next drafted step.
        return r.features is not None and r.tree.method != AUTOREGRESSIVE

    def _features_for(self, r: DraftRequest, address: str, full: bool) -> pb.FeatureRows | None:
        """The rows the replica at `address` lacks (from the count it holds on; from 0 when `full`), or None."""
        if not self._sends_features(r):
            return None
        start = 0 if full else min(self._feature_rows.get(r.session_id, {}).get(address, 0), r.features.shape[0])
        return wire.encode_features(r.features[start:], start)


def _draft_item(r: DraftRequest, features: pb.FeatureRows | None = None) -> pb.DraftItem:
    item = pb.DraftItem(session_id=r.session_id, context=r.context, sampling=wire.encode_sampling(r.sampling),
                        tree=wire.encode_tree_config(r.tree), seed=r.seed % (1 << 64))
    if r.accepted_nodes is not None:
        item.has_accepted_nodes = True
        item.accepted_nodes.extend(r.accepted_nodes)
    if features is not None:
        item.features.CopyFrom(features)
    return item
