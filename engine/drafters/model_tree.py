"""The batch-1 drafting mode of a model-only method: the builder's tree over the drafter model's rows, at the
request's budget or at the step planner's (engine/drafters/planner.py; a plan may also say plain decoding, and hold
it for the steps after)."""

from __future__ import annotations

from ..budget import BudgetChooser
from .draft_step import DraftingParts, DraftStep, StepTrees


class ModelTree:
    """`DraftMode` of a batch-1 step whose method drafts with the model alone (engine/drafters/draft_step.py)."""

    def __init__(self, parts: DraftingParts):
        self.parts = parts

    def draft(self, step: DraftStep) -> StepTrees:
        """The tree (None while the model catches up beside the step, or where the plan says plain decoding) and the
        plain steps the plan holds after it."""
        (r,) = step.requests
        if not step.model_ready(r):
            return StepTrees([None])
        parts = self.parts
        oracle = parts.begin(r)
        builder = parts.builder(r.tree)
        plan = parts.planner.plan_tree(step.lane, r.tree.budget_auto)
        if plan is not None:
            if plan.plain:  # the chooser found that no drafting pays this step
                return StepTrees([None], plan.held)
            builder = BudgetChooser.resized(builder, plan.budget)
        tree = builder.build(r.context[-1], oracle, r.sampling, parts.generator(r))
        step.remember(r, tree, builder, parts.planner.step_chooser(step.lane))
        return StepTrees([tree], plan.held if plan is not None else 0)
