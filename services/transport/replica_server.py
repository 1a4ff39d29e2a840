"""A replica's gRPC server on its own thread and event loop, and the thread its model work runs on.

Used by the Drafter / Target replicas (services/transport/replica.py) and by the Router's public API
(services/api_server.py). The server runs independently of Serve's own event loops, so a replica answers its
gRPC callers whatever Serve is doing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable

import grpc
from ..internal_auth import InternalAuthInterceptor

# Trees and distributions exceed grpcio's 4 MB default (args.grpc.max_message_bytes overrides it).
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# How long a connection attempt may take before the calls waiting on it fail (UNAVAILABLE) and go to another
# replica. gRPC's default is 20 s: measured, a call to an address that never answers the handshake (a host that
# vanished, a process that stopped accepting) failed after 20.0 s, with this after 2.0 s. A refused connection
# (a replica process killed on a live host) fails in ~1 ms either way.
CONNECT_TIMEOUT_MS = 2000


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Options of every replica channel and server: the raised message limit, fast reconnects, a short connect
    deadline, no retries (client-only options are ignored by servers)."""
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # Fail fast on a dead replica instead of waiting in reconnect backoff.
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000),
            # Despite its name, gRPC's minimum connect timeout (subchannel min_connect_timeout).
            ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
            ("grpc.enable_retries", 0)]


class PollerNoiseFilter(logging.Filter):
    """grpc.aio used from more than one event loop in a process (a replica's server loop beside Serve's own)
    makes every loop but one find the completion queue's wake-up byte already read: a harmless BlockingIOError
    in PollerCompletionQueue._handle_events, logged by asyncio as an error each time (grpc/grpc#25364, the fix
    grpc/grpc#36096 is not released). Drop exactly those records."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BlockingIOError) and "_handle_events" in record.getMessage():
            return False
        return True


_POLLER_FILTER = PollerNoiseFilter()


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


def limit_threads() -> None:
    """One torch thread per replica: two under contention stalled forwards to ~400 ms (docs/design.md section 4)."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    quiet_poller_noise()
