"""The instrumentation of one engine step: phase timings, one StepRecord per sequence, the drafter's feedback.

`SpeculativeEngine.step` decodes; this records what the step did, so the decoding reads like the protocol.
A step's records carry the batch's drafting and scoring wall times, the drafter runner's share of drafting,
the per-sequence verification time, and the tree's and the accepted path's counts by draft source. The
finished records go to the drafter's `observe` (its budget chooser learns from them), except on a step that
prefilled a new sequence's prompt: such a step costs far more than decoding, and the chooser would blame
whatever budget it tried then.
"""

from __future__ import annotations

import time
from typing import Protocol

from .drafters.base import Drafter
from .requests import StepRecord
from .tree import TokenTree
from .verify import VerifyResult


class Sequence(Protocol):
    """What the recorder reads of a sequence (the engine's `Sequence`): the records of its steps so far."""

    steps: list[StepRecord]


class StepRecorder:
    """Times one step of `batch` from its creation on and appends each sequence's StepRecord.

    Call in step order: `drafted`, `scored`, `verified` once per sequence, then `finish`."""

    def __init__(self, batch: list[Sequence], drafter: Drafter | None) -> None:
        self.batch = batch
        self.drafter = drafter
        self.prefill = any(not s.steps for s in batch)  # some sequence's prompt is fed in this step
        self.started = time.perf_counter()
        self.draft_done = self.score_done = self.started
        self.called_drafter = self.ahead_hit = False
        self.draft_model_ms = self.draft_forward_ms = 0.0
        self.ahead_hits = drafter.run_ahead_hits if drafter is not None else 0

    def drafted(self, called_drafter: bool) -> None:
        """Drafting is over; `called_drafter`: the drafter ran (not a root-only or held plain step)."""
        self.draft_done = time.perf_counter()
        self.called_drafter = called_drafter
        # Run-ahead serves batch-1 steps only: a hit during this call was this step's one sequence.
        self.ahead_hit = called_drafter and self.drafter.run_ahead_hits > self.ahead_hits

    def scored(self) -> None:
        """The target's forward is over; reads the drafter runner's share of the drafting time."""
        self.score_done = time.perf_counter()
        if self.called_drafter:
            self.draft_model_ms = self.drafter.last_model_ms
            self.draft_forward_ms = self.drafter.last_forward_ms

    def verified(self, s: Sequence, tree: TokenTree, result: VerifyResult) -> None:
        """Append the record of sequence `s`, whose `tree` verified to `result`."""
        _, size_lookup, size_both = tree.count_sources()
        _, accepted_lookup, accepted_both = tree.count_sources(result.accepted_nodes)
        s.steps.append(StepRecord(tree_size=tree.num_nodes - 1, accepted=result.num_accepted,
                                  emitted=len(result.tokens), batch_size=len(self.batch),
                                  draft_ms=(self.draft_done - self.started) * 1e3,
                                  draft_model_ms=self.draft_model_ms,
                                  score_ms=(self.score_done - self.draft_done) * 1e3, verify_ms=0.0,
                                  draft_forward_ms=self.draft_forward_ms,
                                  tree_size_lookup=size_lookup + size_both, accepted_lookup=accepted_lookup,
                                  accepted_both=accepted_both,
                                  run_ahead_hit=self.ahead_hit and tree.num_nodes > 1))

    def finish(self) -> None:
        """Share the verification time among the records and report them to the drafter."""
        verify_ms = (time.perf_counter() - self.score_done) * 1e3 / len(self.batch)
        for s in self.batch:
            s.steps[-1].verify_ms = verify_ms
            if self.drafter is not None and not self.prefill:
                self.drafter.observe(s.steps[-1])
