"""The step planner: one place that decides each draft step of every drafter, lane by lane.

Every drafter in this process (`LocalDrafter`, `ParallelTreeDrafter`, `LookupDrafter`) asks its `StepPlanner` what
a step drafts: which hardware-aware chooser decides it (engine/budget.py), that chooser's `DraftPlan` (the budget,
copies alone, the plain steps held after it) and, when the step's records come back (`observe`), which chooser they
are credited to. The choosers measure a step's tokens per second per context, so a step must be credited to the
chooser that decided it, and per lane (engine/lanes.py), since lanes step concurrently:
- a batch-1 step: `budget` (None: fixed budgets, no plan);
- a batch-1 step of a lookup method whose copies are expected to pay (`copy_context_gain`): `copy_budget`, made on
  first use (a budget's rate where long copies carry the trees says little about stretches with nothing to copy: a
  contextual bandit with two contexts);
- a batched step: one chooser of the chain depth per batch-size bucket (`batch_budgets`), the bigger the batch the
  less a target forward has to spare for drafts.
The drafters act on the plans; what they draft with is theirs (engine/drafters/*_tree.py, batched_c2t_chains.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..budget import BATCH_STEP_COST, BudgetChooser, DraftPlan
from ..tree_settings import check_positive
from ..lanes import Lanes, batch_size_bucket
from ..requests import StepRecord
from .base import DraftRequest

# Batched steps explore only chain depths predicted within this share of the best prediction (and plain decoding),
# each for fewer steps than a batch-1 budget: a batched step's records carry every row's acceptance, and each
# exploratory step costs all the rows.
BATCH_EXPLORE_WITHIN = 0.8
BATCH_EXPLORE_STEPS = 4
# A batched step drafts only where that measured at least this many times plain decoding's tokens/s: what drafting
# costs a batch beyond its own steps' wall time is not in its measured rate. Served on the 2-core CPU, every depth
# measured within ~10% of plain decoding per lane at 8 streams (24-28 against 27-30 tokens/s), and at 16 streams
# drafted steps ran ~15% above plain decoding's per lane (15.8 tokens per 370 ms against 8 per 216 ms) while the
# level lost 12-21% overall (the drafter's load on cores the other lane's target uses, each request's drafter prefill,
# arrivals waiting on longer steps; performance.md section 16). On a flat (GPU) curve a depth's gain should approach
# its mean accepted length (1.6-2.0 in those runs), above the margin: not yet measured on a GPU.
BATCH_PLAIN_MARGIN = 1.25


@dataclass
class PlannerLane:
    """Which choosers decided a lane's last steps: the lane's records are credited to the lane's own decision."""

    step_chooser: BudgetChooser | None = None  # the chooser that decided the last batch-1 step
    batch_chooser: BudgetChooser | None = None  # the chooser that decided the last batched step


class StepPlanner:
    """Decides each step of a drafter (module docstring): the chooser, its plan, the plain steps held, per lane."""

    def __init__(self, budget: BudgetChooser | None, copy_context_gain: float | None = None,
                 batch_depth: int | None = None):
        """`budget`: the batch-1 chooser (None: every budget is the request's own); `copy_context_gain`: a lookup
        step whose lookup-only plan expects at least this many accepted tokens is decided by `copy_budget` (None:
        by `budget`); `batch_depth`: the deepest chain a batched step may draft (None: batched steps are not
        planned)."""
        self.budget = budget
        self.copy_context_gain = copy_context_gain
        self.copy_budget: BudgetChooser | None = None
        self.batch_depth = batch_depth
        self.batch_budgets: dict[int, BudgetChooser] = {}
        self.lanes: Lanes[PlannerLane] = Lanes(lambda lane: PlannerLane())

    def begin(self, lane: str) -> None:
        """A draft call starts: its batch-1 step is `budget`'s unless the step's plan names another chooser."""
        self.lanes[lane].step_chooser = self.budget

    def step_chooser(self, lane: str) -> BudgetChooser | None:
        """The chooser that decided the lane's last batch-1 step (what a tree drafted ahead from it follows)."""
        return self.lanes[lane].step_chooser

    def plan_tree(self, lane: str, auto: bool) -> DraftPlan | None:
        """A batch-1 tree's plan by `budget` when the request leaves its budget to the chooser (`auto`); None: the
        request's own budget."""
        if self.budget is None or not auto:
            return None
        return self.budget.plan(lane)

    def plan_copies(self, lane: str, gains: list[float], model: bool, explore: bool = True) -> DraftPlan:
        """A batch-1 step of a lookup method, given its lookup-only plan's `gains`: a lookup-only tree, a model
        budget whose tree merges the copies, or plain decoding (never held). Needs `budget`."""
        chooser = self._copy_chooser(gains)
        self.lanes[lane].step_chooser = chooser
        return chooser.plan_hybrid(gains, model=model, lane=lane, explore=explore)

    def _copy_chooser(self, gains: list[float]) -> BudgetChooser:
        """The chooser measuring this lookup step's context: `copy_budget` where the lookup-only plan expects at
        least `copy_context_gain` accepted tokens, else `budget`."""
        if self.copy_context_gain is None or not gains or gains[-1] < self.copy_context_gain:
            return self.budget
        if self.copy_budget is None:
            self.copy_budget = self.budget.fresh()
        return self.copy_budget

    def plan_batch(self, lane: str, batch_size: int, requests: Sequence[DraftRequest]) -> DraftPlan:
        """A batched step's plan: the chain depth chosen per batch-size bucket when every request leaves its budget
        to the hardware-aware chooser; else `batch_depth`, capped by the smallest explicit budget."""
        state = self.lanes[lane]
        explicit = [r.tree.budget for r in requests if not r.tree.budget_auto]
        for budget in explicit:  # what the batch-1 path's builder checks; a chain cap must be >= 1 too
            check_positive("budget", budget)
        if self.budget is None or explicit:
            state.batch_chooser = None
            return DraftPlan(budget=min([self.batch_depth, *explicit]))
        bucket = batch_size_bucket(batch_size)
        if bucket not in self.batch_budgets:
            # Priced at the bucket's rows: at a batch size where drafting cannot pay, plain decoding ranks first
            # and little time goes to measuring depths that lose. A batch that copies from its context measures
            # copying alone as a budget too (the first batch of the bucket says whether it does).
            copies = any(r.tree.parsed_method.copies for r in requests)
            self.batch_budgets[bucket] = self.budget.fresh(max_budget=self.batch_depth, rows=bucket,
                                                           explore_within=BATCH_EXPLORE_WITHIN, copies_arm=copies,
                                                           explore_steps=BATCH_EXPLORE_STEPS,
                                                           plain_margin=BATCH_PLAIN_MARGIN,
                                                           max_step_cost=BATCH_STEP_COST)
        state.batch_chooser = self.batch_budgets[bucket]
        return state.batch_chooser.plan(lane)

    def batch_chooser(self, lane: str) -> BudgetChooser | None:
        """The chooser that decided the lane's last batched step (None: a fixed depth)."""
        return self.lanes[lane].batch_chooser

    def follow(self, lane: str, chooser: BudgetChooser | None) -> None:
        """The lane's step is one `chooser` decided before (a tree drafted ahead at its budget): credit the step's
        records to that decision."""
        if chooser is not None:
            chooser.repeat(lane)
            self.lanes[lane].step_chooser = chooser

    def observe(self, record: StepRecord, lane: str = "") -> None:
        """Feed a finished step's records to the lane's chooser that decided it: the batch-1 one, or the batched
        chain depth's (one record per sequence of the batch); each ignores steps it did not decide."""
        state = self.lanes[lane]
        chooser = state.batch_chooser if record.batch_size > 1 else state.step_chooser or self.budget
        if chooser is not None:
            chooser.observe(record, lane)

    def step_choosers(self) -> dict[str, BudgetChooser]:
        """The batch-1 choosers by the context they measure ("": every step, or a lookup method's steps with
        nothing to copy; "copying": a lookup method's steps where the lookup expects to copy)."""
        choosers = {"": self.budget, "copying": self.copy_budget}
        return {context: chooser for context, chooser in choosers.items() if chooser is not None}
