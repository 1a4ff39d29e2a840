"""The Drafter without a drafter model: copy-from-context trees alone (docs/design.md section 8, method "lookup").

A target with no drafter (no published head, none trained yet) still decodes speculatively from its own context,
as vLLM's n-gram proposer needs no draft model: each session's suffix index (engine/lookup/) proposes the
continuations of its longest match, SuffixDecoding's expansion (Oliaro et al. 2024, arXiv:2411.04975, section
4: the best-first tree of the highest path probabilities) sized per step. With a hardware profile of the target
(`measure_profile(target, None)`), the budget chooser prices each batch-1 step's lookup tree on the target's cost
curve exactly as the hybrid's copies are priced (`BudgetChooser.plan_hybrid` with no model arm), and a batched
step's copy chains are cut by OPT-Tree's criterion across the batch (`allocate_copies`); without one, a step
sends the request's budget of the most probable nodes. No model: no KV cache, no features, nothing to draft ahead.
"""

from __future__ import annotations

from ..budget import BATCH_STEP_COST, BudgetChooser, allocate_copies
from ..hardware.profile import HardwareProfile
from ..lookup import LookupSettings, LookupSources
from ..lookup.trees import lookup_chain, merge_chains, plan_lookup
from ..methods import LOOKUP
from ..requests import StepRecord
from ..tree import TokenTree
from .base import Drafted, DraftRequest, DrafterBase, root_only
from .planner import StepPlanner
from .registry import NO_DRAFTER

# Copy chain length of a batched step before the criterion cuts it (LocalDrafter's batch chain depth).
BATCH_CHAIN_DEPTH = 6


class LookupDrafter(DrafterBase):
    """Copy-from-context drafting with no drafter model; see the module docstring."""

    kind = NO_DRAFTER

    def __init__(self, lookup: LookupSettings | None = None, profile: HardwareProfile | None = None):
        self.lookups = LookupSources(lookup)
        self.profile = profile
        self.budget = BudgetChooser(profile) if profile is not None else None
        self.planner = StepPlanner(self.budget)

    def draft(self, requests: list[DraftRequest], batch_size: int | None = None, lane: str = "") -> Drafted:
        for r in requests:
            if r.tree.parsed_method.model_drafts:
                raise ValueError(f"method {r.tree.method!r} drafts with a drafter model, and this engine has none "
                                 f"(drafter {NO_DRAFTER!r}): use method {LOOKUP!r} or configure a drafter")
        speculative = [r for r in requests if not r.tree.parsed_method.is_autoregressive]
        batch = batch_size or len(requests)
        trees = dict(zip(map(id, speculative), self._batch(speculative, batch) if batch > 1 else
                         [self._single(r, lane) for r in speculative]))
        return Drafted([trees.get(id(r)) or root_only(r.context) for r in requests])

    def _single(self, r: DraftRequest, lane: str) -> TokenTree | None:
        """Batch size 1: the lookup-only tree the chooser prices (or the request's budget of nodes)."""
        session = self.lookups.session(r.session_id, r.context, r.cache_scope, r.sampling.is_greedy, r.prediction)
        settings = self.lookups.settings
        auto = self.budget is not None and r.tree.budget_auto
        plan = plan_lookup(session, r.context[-1], session.plan_nodes if auto else r.tree.budget, settings.min_value)
        nodes = r.tree.budget
        if auto:
            decision = self.planner.plan_copies(lane, plan.gains(), model=False)
            nodes = decision.lookup_nodes if decision.lookup_only else 0
        return plan.tree(nodes, r.sampling.is_greedy) if nodes and plan.size else None

    def _batch(self, requests: list[DraftRequest], batch_size: int) -> list[TokenTree | None]:
        """A batched step: each request's most probable copy chain, cut across the batch where the target's cost
        curve is known."""
        settings = self.lookups.settings
        sessions = [self.lookups.session(r.session_id, r.context, r.cache_scope, r.sampling.is_greedy, r.prediction)
                    for r in requests]
        chains = [lookup_chain(session, BATCH_CHAIN_DEPTH, settings.chain_min_joint) for session in sessions]
        if self.profile is not None:
            keep = allocate_copies([joints for _, joints in chains], batch_size, 1, float(batch_size), self.profile,
                                   BATCH_STEP_COST)
            chains = [(tokens[:n], joints[:n]) for (tokens, joints), n in zip(chains, keep)]
        return [merge_chains(r.context[-1], [], [], tokens, joints, r.sampling.is_greedy) if tokens else None
                for r, (tokens, joints) in zip(requests, chains)]

    def observe(self, record: StepRecord, lane: str = "") -> None:
        self.planner.observe(record, lane)

    def release(self, session_id: str) -> bool:
        return self.lookups.release(session_id)

    def session_ids(self) -> list[str]:
        return self.lookups.session_ids()
