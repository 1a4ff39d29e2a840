"""The autoregressive drafter kind: DraftRequests in, TokenTrees out, one drafter forward per tree depth.

`LocalDrafter` owns the drafter model's runner (engine/drafters/model_runner.py), one tree builder per tree
configuration, the C2T classifier for batched chain mode and the step planner (engine/drafters/planner.py: the
hardware-aware budget choosers and their decisions per lane). The in-process engine calls it directly; the Drafter
deployment serves the same `draft`/`release` over gRPC, so both paths build identical trees.

Each draft call is drafted by one mode, each a module of its own behind one interface (engine/drafters/
draft_step.py): above batch size 1 C2T chains drafted together, a lookup request's copy chain joining its chain or
replacing it where the lookup is confident (batched_c2t_chains.py); at batch size 1 the tree drafted ahead for the
step's context, if any (ahead_tree.py), else the method's tree: copies from the request's context joined by the
model's rows for methods "lookup" and "<builder>+lookup" (hybrid_tree.py), the model's alone for the others
(model_tree.py). The lookup methods keep a suffix index per session (engine/lookup/), updated with the tokens each
call's context adds.
"""

from __future__ import annotations

import time

import torch

from ..budget import BudgetChooser
from ..c2t_classifier import C2TClassifier
from ..lanes import Lanes
from ..lookup import LookupSession, LookupSettings, LookupSources
from ..requests import StepRecord
from ..runners.kv_pool import KVPoolExhausted
from .ahead_tree import RunAhead
from .base import Drafted, DraftRequest, FeatureNeeds, ModelDrafter, root_only
from .batched_c2t_chains import BatchedChains
from .draft_step import DraftingParts, DraftLane, DraftStep, StepTrees
from .hybrid_oracle import head_index
from .hybrid_tree import HybridTree
from .model_runner import DrafterRunner
from .model_tree import ModelTree
from .planner import StepPlanner
from .registry import AUTOREGRESSIVE_KIND
from .run_ahead import RunAheadStore


class LocalDrafter(ModelDrafter):
    """The `Drafter` over an autoregressive drafter model (distilled, EAGLE, EAGLE-3, a published head):
    one drafter forward per tree depth, the tree shaped by the request's builder."""

    kind = AUTOREGRESSIVE_KIND

    def __init__(self, runner: DrafterRunner, classifier: C2TClassifier | None = None,
                 budget: BudgetChooser | None = None, batch_chain_depth: int = 6, batch_chain_beta: float = 0.5,
                 lookup: LookupSettings | None = None, catch_up_beside: int | None = None):
        """`catch_up_beside`: a session whose drafter cache lags its context by more than this many tokens (a prompt
        the drafter has not read, a stretch decoded plainly) and that the step's plan has the model draft for is
        drafted without the model this step (its copies only, or nothing), and its catch-up forward is left to
        `catch_up`, which the caller runs while the target scores the step; so a long prompt's drafter prefill never
        lengthens a step of the batch (issue 60). A session the plan does not have the model draft for is left as it
        is (parked: it costs the drafter no forward until it does). None: the catch-up runs inline, in the step's
        first drafter forward (a caller with nothing running beside the target)."""
        if catch_up_beside is not None and catch_up_beside < 0:
            raise ValueError(f"catch_up_beside must be >= 0 (or None: inline), got {catch_up_beside}")
        self.catch_up_beside = catch_up_beside
        self.runner = runner
        # Copy-from-context drafting (methods "lookup", "<builder>+lookup"): per-session suffix indexes.
        self.lookups = LookupSources(lookup)
        self.classifier = classifier or C2TClassifier.joint_prob_prior()
        self.budget = budget
        self.batch_chain_depth = batch_chain_depth
        self.batch_chain_beta = batch_chain_beta
        # Every lane's steps are decided by the same choosers; what each lane's last step decided is its own.
        self.planner = StepPlanner(budget, self.lookups.settings.copy_context_gain, batch_chain_depth)
        self.parts = DraftingParts(runner, self.lookups, self.classifier, self.planner, head_index(runner.vocab_ids))
        self.lanes: Lanes[DraftLane] = Lanes(lambda lane: DraftLane())
        # Run-ahead (engine/drafters/run_ahead.py): trees drafted for the next step while the target scores this one.
        self.run_ahead = RunAheadStore()
        self.ahead = RunAhead(self.parts, self.run_ahead)
        self.batched = BatchedChains(self.parts, batch_chain_depth, batch_chain_beta)
        self.hybrid = HybridTree(self.parts)
        self.tree = ModelTree(self.parts)

    @property
    def run_ahead_hits(self) -> int:
        return self.run_ahead.hits

    @property
    def run_ahead_misses(self) -> int:
        return self.run_ahead.misses

    @property
    def lm(self):
        return self.runner.lm

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        return self.runner.vocab_ids

    @property
    def feature_needs(self) -> FeatureNeeds:
        """An EAGLE drafter reads the target's features of each request's context (the runner's model facts)."""
        reads = self.runner.reads_target_features
        return FeatureNeeds(reads, self.runner.target_feature_size if reads else 0, self.runner.feature_layers)

    def draft(self, requests: list[DraftRequest], batch_size: int | None = None, lane: str = "") -> Drafted:
        """One tree per request: the configured method alone at batch size 1, C2T chains drafted together
        above (`batch_size`: sequences in the step's target forward, default len(requests); a Drafter
        replica holding one sequence of a router's batch drafts it as a batch does), decided by `lane`'s
        planner."""
        before = self._counters()
        step = self._step(requests, batch_size, lane)
        return self._drafted(requests, step, self._draft(step), before)

    def _draft(self, step: DraftStep) -> StepTrees:
        """The step's trees, by the one mode that drafts it: chains together above batch size 1; at batch size 1 the
        tree drafted ahead for its context if there is one, else the method's tree (copies joined by the model's
        rows for a lookup method, the model's alone for the others)."""
        if not step.requests:
            return StepTrees([])
        if step.batch_size > 1:
            return self.batched.draft(step)
        ahead = self.ahead.draft(step)
        if ahead is not None:
            return ahead
        return (self.hybrid if step.requests[0].tree.parsed_method.copies else self.tree).draft(step)

    def _step(self, requests: list[DraftRequest], batch_size: int | None, lane: str) -> DraftStep:
        """The call as its mode sees it; the lane's state of the previous call (its last step, its catch-ups) is
        cleared for this one's."""
        state = self.lanes[lane]
        self.planner.begin(lane)
        state.last_step = None  # set again only by a batch-1 step that drafted with the model
        state.catching_up = []  # set by the mode: those of `lagging` the model would draft for
        speculative = [r for r in requests if not r.tree.parsed_method.is_autoregressive]
        return DraftStep(lane, state, speculative, batch_size or len(requests), self._lagging(speculative))

    def _counters(self) -> tuple[float, float, int, int]:
        """The drafter's running totals that a call reports the growth of: runner and forward seconds, run-ahead
        hits and misses."""
        return self.runner.seconds, self.runner.lm.forward_seconds, self.run_ahead.hits, self.run_ahead.misses

    def _drafted(self, requests: list[DraftRequest], step: DraftStep, drafted: StepTrees,
                 before: tuple[float, float, int, int]) -> Drafted:
        """The call's answer: a tree per request (the root alone for the autoregressive ones and the modes' None) and
        the call's facts."""
        state = step.state
        runner_seconds, forward_seconds, hits, misses = before
        caught_up_ms, state.catch_up_seconds = state.catch_up_seconds * 1e3, 0.0
        # A request without its target features (a remote router withholds a long context's rows until asked)
        # cannot be caught up: it asks for them instead, and catches up once they come with its next call.
        wanted = tuple(r.session_id for r in state.catching_up if not self._has_features(r))
        state.catching_up = [r for r in state.catching_up if self._has_features(r)]
        trees = iter(drafted.trees)
        return Drafted([(None if r.tree.parsed_method.is_autoregressive else next(trees)) or root_only(r.context)
                        for r in requests],
                       model_ms=(self.runner.seconds - runner_seconds) * 1e3,
                       forward_ms=(self.runner.lm.forward_seconds - forward_seconds) * 1e3,
                       hold_steps=drafted.held, run_ahead_hits=self.run_ahead.hits - hits,
                       run_ahead_misses=self.run_ahead.misses - misses,
                       catching_up=tuple(r.session_id for r in state.catching_up), features_wanted=wanted,
                       catch_up_ms=caught_up_ms)

    def _lagging(self, requests: list[DraftRequest]) -> set[str]:
        """Sessions among `requests` whose model drafting waits for their catch-up (`catch_up_beside`), or for the
        target features their request lacks."""
        beside = self.catch_up_beside
        return {r.session_id for r in requests if not r.tree.parsed_method.lookup_only
                and (not self._has_features(r)
                     or (beside is not None and self.runner.lm.lag(r.session_id, len(r.context)) > beside))}

    def _has_features(self, r: DraftRequest) -> bool:
        """Whether `r` carries what the model needs of the target: the features of its whole context[:-1] (for an
        EAGLE drafter; any request otherwise)."""
        return (not self.runner.reads_target_features
                or (r.features is not None and r.features.shape[0] >= len(r.context) - 1))

    def catch_up(self, lane: str = "") -> int:
        """Feed the drafter what its lagging sessions of the lane's last draft call missed, all in one batched
        forward (each session's unread context, then its root): run while the target scores that step, so their
        next step drafts without the wait. A session released meanwhile is skipped; the KV pool being full leaves
        the catch-up to the session's next drafted step (inline, as without `catch_up_beside`). Returns the
        sessions caught up."""
        state = self.lanes[lane]
        pending, state.catching_up = state.catching_up, []
        if not pending:
            return 0
        started = time.perf_counter()
        try:
            oracles = [self.runner.begin(r.session_id, r.context, r.sampling, r.accepted_nodes, r.features,
                                         r.cache_scope) for r in pending]
            self.runner.extend_many(oracles, [[0]] * len(pending), [[r.context[-1]] for r in pending],
                                    [[-1]] * len(pending))
        except KVPoolExhausted:
            return 0
        finally:
            state.catch_up_seconds += time.perf_counter() - started
        return len(pending)

    def draft_ahead(self, lane: str = "") -> bool:
        """Draft the next step's trees for the lane's last batch-1 greedy step, for the outcomes of its verification
        the drafter expects (engine/drafters/ahead_tree.py; call it while the target scores that step). False when
        there is nothing to draft ahead: no such step, a sampled one, a tree without draft nodes."""
        return self.ahead.draft_ahead(self.lanes[lane])

    def step_choosers(self) -> dict[str, BudgetChooser]:
        return self.planner.step_choosers()

    def lookup_session(self, session_id: str) -> LookupSession | None:
        """The lookup state of a session, if it has one (tests, stats)."""
        return self.lookups.get(session_id)

    def observe(self, record: StepRecord, lane: str = "") -> None:
        """Feed a finished step's records to the lane's chooser that decided it (engine/drafters/planner.py)."""
        self.planner.observe(record, lane)

    def release(self, session_id: str) -> bool:
        self.run_ahead.drop(session_id)
        for lane in self.lanes:
            state = self.lanes[lane]
            state.catching_up = [r for r in state.catching_up if r.session_id != session_id]
        looked = self.lookups.release(session_id)
        return self.runner.release(session_id) or looked
