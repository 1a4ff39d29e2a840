"""Per-lane state: what a drafter and its budget choosers keep apart for each lane.

A lane is a batch whose steps come in order: the in-process engine's one batch (lane ""), or, served, the sessions
one router places on one Target replica (services/router.py), which the router steps concurrently with its other
lanes. Whatever is decided for a step and settled by that step's records (a budget chooser's decision, a plain-
decoding hold, the tree to draft ahead from) belongs to the step's lane: kept once for all lanes, each lane's records
would be credited to whichever lane decided last."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Iterator, TypeVar

LaneState = TypeVar("LaneState")
MAX_LANES = 64  # lanes kept: a router's Target replicas come and go (scale-out, restarts), routers too


def batch_size_bucket(batch_size: int) -> int:
    """The power of two at or above `batch_size`: batched steps share one budget chooser (and its plain
    decoding holds) per bucket, so requests joining or leaving a batch do not reset what was measured."""
    return 1 << (batch_size - 1).bit_length()


class Lanes(Generic[LaneState]):
    """State per lane, made on a lane's first step; past `limit` lanes the least recently stepped one is dropped (a
    lane whose replica left steps no more; one that comes back starts afresh)."""

    def __init__(self, make: Callable[[str], LaneState], limit: int = MAX_LANES):
        self._make, self._limit = make, limit
        self._states: OrderedDict[str, LaneState] = OrderedDict()

    def __getitem__(self, lane: str) -> LaneState:
        if lane not in self._states:
            self._states[lane] = self._make(lane)
            while len(self._states) > self._limit:
                self._states.popitem(last=False)
        self._states.move_to_end(lane)
        return self._states[lane]

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[str]:
        """The lanes held, least recently stepped first."""
        return iter(list(self._states))
