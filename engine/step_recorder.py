"""The instrumentation of one engine step: phase timings, one StepRecord per sequence, the drafter's feedback.

`SpeculativeEngine.step` decodes; this records what the step did, so the decoding reads like the protocol.
A step's records carry the batch's drafting and scoring wall times, the drafter runner's share of drafting,
the per-sequence verification time, and the tree's and the accepted path's counts by draft source. The
finished records are what the engine reports to the drafter's `observe` (its budget chooser learns from them),
except on a step that prefilled a new sequence's prompt: such a step costs far more than decoding, and the chooser would blame
whatever budget it tried then.
"""

from __future__ import annotations

import time
from typing import Protocol

from .drafters.base import Drafted
from .requests import StepRecord
from .tree import TokenTree
from .verify import VerifyResult


class Sequence(Protocol):
    """What the recorder reads of a sequence (the engine's `Sequence`): the records of its steps so far."""

    steps: list[StepRecord]


class StepRecorder:
    """Times one step of `batch` from its creation on and appends each sequence's StepRecord.

    Call in step order: `drafted`, `scored`, `verified` once per sequence, then `finish`."""

    def __init__(self, batch: list[Sequence]) -> None:
        self.batch = batch
        self.prefill = any(not s.steps for s in batch)  # some sequence's prompt is fed in this step
        self.started = time.perf_counter()
        self.draft_done = self.score_done = self.started
        self.recorded: list[Sequence] = []  # the sequences verified (one still prefilling in chunks is not)
        self.call: Drafted | None = None

    def drafted(self, call: Drafted | None) -> None:
        """Drafting is over; `call`: what the drafter's call returned (None: a root-only or held plain step)."""
        self.draft_done = time.perf_counter()
        self.call = call

    def scored(self) -> None:
        """The target's forward is over."""
        self.score_done = time.perf_counter()

    def verified(self, s: Sequence, tree: TokenTree, result: VerifyResult, parked: bool = False) -> None:
        """Append the record of sequence `s`, whose `tree` verified to `result`; `parked`: the drafter did not follow
        its context this step (StepRecord.parked)."""
        _, size_lookup, size_both = tree.count_sources()
        _, accepted_lookup, accepted_both = tree.count_sources(result.accepted_nodes)
        call = self.call
        self.recorded.append(s)
        s.steps.append(StepRecord(tree_size=tree.num_nodes - 1, accepted=result.num_accepted,
                                  emitted=len(result.tokens), batch_size=len(self.batch),
                                  draft_ms=(self.draft_done - self.started) * 1e3,
                                  draft_model_ms=call.model_ms if call else 0.0,
                                  score_ms=(self.score_done - self.draft_done) * 1e3, verify_ms=0.0,
                                  draft_forward_ms=call.forward_ms if call else 0.0,
                                  tree_size_lookup=size_lookup + size_both, accepted_lookup=accepted_lookup,
                                  accepted_both=accepted_both,
                                  # Run-ahead serves batch-1 steps only: a hit of the call was this sequence's.
                                  run_ahead_hit=bool(call and call.run_ahead_hits) and tree.num_nodes > 1,
                                  catch_up=bool(call) and (s.session_id in call.catching_up
                                                           or s.session_id in call.features_wanted),
                                  catch_up_ms=call.catch_up_ms / len(self.batch) if call else 0.0,
                                  fed_prompt=self.prefill, parked=parked))

    def finish(self) -> list[StepRecord]:
        """Share the verification time among the records; returns those the drafter observes (none after a
        prefill)."""
        verify_ms = (time.perf_counter() - self.score_done) * 1e3 / max(1, len(self.recorded))
        for s in self.recorded:
            s.steps[-1].verify_ms = verify_ms
        return [] if self.prefill else [s.steps[-1] for s in self.recorded]
