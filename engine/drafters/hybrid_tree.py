"""The batch-1 drafting mode of a lookup method ("lookup", "<builder>+lookup"; docs/design.md section 8): the
request's copies from its context, joined by the drafter model's rows in one tree shaped by the method's builder
(`HybridOracle`). With an auto budget the step planner prices the step with and without the model
(engine/drafters/planner.py `plan_copies`): a lookup-only tree (no drafter forward), the builder's tree over both
sources at a measured budget, or plain decoding. While the model catches up beside the step its copies draft
alone."""

from __future__ import annotations

from ..budget import BudgetChooser
from ..lookup.trees import plan_lookup
from ..tree import TokenTree
from .draft_step import DraftingParts, DraftStep, StepTrees
from .hybrid_oracle import HybridOracle


class HybridTree:
    """`DraftMode` of a batch-1 step whose method drafts copies (engine/drafters/draft_step.py); it holds no plain
    steps: the lookup is checked every step."""

    def __init__(self, parts: DraftingParts):
        self.parts = parts

    def draft(self, step: DraftStep) -> StepTrees:
        (r,) = step.requests
        return StepTrees([self._tree(step, r.tree.parsed_method.lookup_only or not step.model_ready(r))])

    def _tree(self, step: DraftStep, copies_alone: bool) -> TokenTree | None:
        """The tree the plan calls for (None: plain decoding); `copies_alone`: no drafter forward this step."""
        (r,) = step.requests
        parts = self.parts
        session = parts.session(r)
        copies = parts.copies(r, session)
        root, greedy = r.context[-1], r.sampling.is_greedy
        builder = parts.builder(r.tree)
        if parts.planner.budget is not None and r.tree.budget_auto:
            lookup = plan_lookup(copies, root, session.plan_nodes, parts.lookups.settings.min_value)
            gains = lookup.gains()
            plan = parts.planner.plan_copies(step.lane, gains, model=not copies_alone,
                                             explore=not session.follows_prediction)
            if plan.lookup_only:
                return lookup.tree(plan.lookup_nodes, greedy)
            if plan.plain:
                return None
            builder = BudgetChooser.resized(builder, plan.budget)
        generator = parts.generator(r)
        if copies_alone:
            return builder.build(root, HybridOracle(None, copies, parts.runner.vocab_size, model_enabled=False),
                                 r.sampling, generator)
        model = parts.begin(r)
        oracle = HybridOracle(model, copies, parts.runner.vocab_size, head_index=parts.head_index)
        tree = builder.build(root, oracle, r.sampling, generator)
        step.remember(r, tree, builder, parts.planner.step_chooser(step.lane))  # trees ahead mix copies in too
        return tree
