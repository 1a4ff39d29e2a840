"""Sync engine calls onto the router's event loop.

`SpeculativeEngine.step` runs on a worker thread (the router's loop must keep serving streams meanwhile) and
calls the Target / Drafter protocols synchronously; the gRPC clients are grpc.aio objects bound to the router's
loop. `LoopBridge` runs a client's coroutine on that loop and waits for it from the worker thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Awaitable


class LoopBridge:
    """Base of the replica clients: `bind_loop` once on the router's loop, then `_sync(coro)` from any other
    thread."""

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
        try:
            return asyncio.run_coroutine_threadsafe(coro, loop).result()
        except concurrent.futures.CancelledError as exc:
            # Raised as is, asyncio.to_thread would turn it into asyncio.CancelledError in the router's step loop,
            # which then ends silently (not an Exception) and every stream waits forever: make it a failed call.
            raise RuntimeError("a replica call was cancelled before it finished") from exc

    def bind_loop(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
