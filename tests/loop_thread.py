"""An event loop on a thread of its own, for tests that drive an engine over replica clients from the test's thread.

The clients' grpc.aio channels belong to the loop they were first used on, and the engine's step awaits them, so
a remote engine's coroutines all run on one loop: the router's in the service, this one in a test.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine, timeout_s: float = 120.0) -> Any:
        """`coro` run on the loop; its result, waited for here."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
