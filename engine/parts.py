"""The engine's two parts as the step awaits them: the async `Target` and `Drafter` protocols, and the adapters
that put an in-process runner behind them.

`SpeculativeEngine.step` (engine/speculative_engine.py) is a coroutine: it awaits its drafter's trees and its
target's scores. The services' replica clients (services/transport/clients.py) are grpc.aio objects and implement
these protocols directly, on the router's event loop. An in-process runner (`TargetRunner`, the tensor-parallel
target, `LocalDrafter`, `ParallelTreeDrafter`, `LookupDrafter`) stays synchronous inside and is wrapped once, at
its own boundary: `InProcessTarget` / `InProcessDrafter` run each call on the runner's own worker thread, so an
event loop serving streams never waits on a forward, and one runner never runs on two threads at once (a release
must not clear the KV pool under a forward; router lanes step concurrently). Wrap a runner once: its adapter is
its lock.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from .drafters.base import Drafted, Drafter as LocalDrafterProtocol, DraftRequest, FeatureNeeds
from .requests import StepRecord
from .runners.target import ScoreRequest
from .verify import TargetDists

# (cache scope, context) of a session: where the replica clients place it and what it leaves cached when released
Prefix = tuple[str, list[int]]


class Target(Protocol):
    """What the step awaits of a target: `InProcessTarget` or a client of the Target replicas (`RemoteTarget`)."""

    vocab_size: int
    provides_features: bool  # honours ScoreRequest.want_features (returns the features an EAGLE drafter reads)

    async def score(self, requests: list[ScoreRequest]) -> list[TargetDists]: ...

    async def release(self, session_id: str, prefix: Prefix | None = None) -> bool:
        """Free the session's caches; `prefix`: its final (cache scope, context), for placement by prefix."""
        ...

    def lane_of(self, session_id: str, prefix: Prefix | None = None) -> str:
        """The router's lane of a session: the sessions stepped together (one Target replica's; in-process, one)."""
        ...


class Drafter(Protocol):
    """What the step awaits of a drafter: `InProcessDrafter` or a client of the Drafter replicas (`RemoteDrafter`).
    The calls are engine/drafters/base.py's `Drafter`'s, awaited; a step's records are observed at once, and what
    it drafts while the target scores is one call (`beside_score`)."""

    feature_needs: FeatureNeeds
    run_ahead_hits: int
    run_ahead_misses: int

    async def draft(self, requests: list[DraftRequest], batch_size: int | None = None, lane: str = "") -> Drafted: ...

    async def observe(self, records: list[StepRecord], lane: str = "") -> None:
        """A finished step's records (one per sequence verified), for the budget chooser of `lane`."""
        ...

    async def beside_score(self, lane: str = "") -> None:
        """The drafter's work while the target scores the lane's step: the catch-up of sessions its call left
        lagging, then the next step's trees drafted ahead (engine/drafters/run_ahead.py)."""
        ...

    def wants_features(self, session_id: str, missing_rows: int) -> bool: ...

    async def release(self, session_id: str, prefix: Prefix | None = None) -> bool: ...


class LocalTarget(Protocol):
    """A target in this process: `TargetRunner` or the tensor-parallel target (synchronous: a Target replica calls
    it on its work thread, the engine through `InProcessTarget`)."""

    vocab_size: int
    provides_features: bool

    def score(self, requests: list[ScoreRequest]) -> list[TargetDists]: ...
    def release(self, session_id: str) -> bool: ...


class InProcessTarget:
    """The async `Target` over an in-process one (`runner`, kept for the callers that read its KV cache)."""

    def __init__(self, runner: LocalTarget):
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.provides_features = runner.provides_features
        # the runner's own thread: its calls run there one at a time, in the order they were awaited
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="treeserve-target")

    async def score(self, requests: list[ScoreRequest]) -> list[TargetDists]:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.runner.score, requests)

    async def release(self, session_id: str, prefix: Prefix | None = None) -> bool:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.runner.release, session_id)

    def lane_of(self, session_id: str, prefix: Prefix | None = None) -> str:
        """One lane: the sessions share one runner."""
        return ""


class InProcessDrafter:
    """The async `Drafter` over an in-process one (`local`: engine/drafters/base.py's protocol; a `ModelDrafter`
    for the callers that read its model, cache or choosers)."""

    def __init__(self, local: LocalDrafterProtocol):
        self.local = local
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="treeserve-drafter")  # as InProcessTarget's

    @property
    def feature_needs(self) -> FeatureNeeds:
        return self.local.feature_needs

    @property
    def run_ahead_hits(self) -> int:
        return self.local.run_ahead_hits

    @property
    def run_ahead_misses(self) -> int:
        return self.local.run_ahead_misses

    async def draft(self, requests: list[DraftRequest], batch_size: int | None = None, lane: str = "") -> Drafted:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.local.draft, requests, batch_size,
                                                                lane)

    async def observe(self, records: list[StepRecord], lane: str = "") -> None:
        # on the worker too: a budget chooser must not learn while another lane's call reads it
        if records:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._observe, records, lane)

    def _observe(self, records: list[StepRecord], lane: str) -> None:
        for record in records:
            self.local.observe(record, lane)

    async def beside_score(self, lane: str = "") -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self._beside_score, lane)

    def _beside_score(self, lane: str) -> None:
        self.local.catch_up(lane)
        self.local.draft_ahead(lane)

    def wants_features(self, session_id: str, missing_rows: int) -> bool:
        return self.local.wants_features(session_id, missing_rows)

    async def release(self, session_id: str, prefix: Prefix | None = None) -> bool:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.local.release, session_id)
