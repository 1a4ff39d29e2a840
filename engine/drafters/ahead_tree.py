"""The run-ahead drafting mode (engine/drafters/run_ahead.py describes the method): at batch size 1, a greedy
step whose context is one the drafter guessed while the target scored the step before is answered with the tree
drafted ahead for it; `draft_ahead` drafts those trees from the lane's last step (`DraftLane.last_step`)."""

from __future__ import annotations

from ..lookup import AheadLookup
from .draft_step import DraftingParts, DraftLane, DraftStep, StepTrees
from .hybrid_oracle import HybridOracle
from .run_ahead import BONUS_CANDIDATES, GUESSES, TREE_SPAN, AheadTree, OffsetOracle, RunAheadStore, likely_path


class RunAhead:
    """`DraftMode` of a batch-1 step drafted ahead (engine/drafters/draft_step.py): `draft` answers None where no
    tree drafted ahead matches the step (the step's own mode drafts it then)."""

    def __init__(self, parts: DraftingParts, store: RunAheadStore):
        self.parts = parts
        self.store = store  # the trees drafted ahead by session, and the hits and misses

    def draft(self, step: DraftStep) -> StepTrees | None:
        """The tree drafted ahead for this step, if the context is the one it assumed (then the step is credited
        to the budget that drafted it, and the lookup, if any, still indexes the emitted tokens)."""
        (r,) = step.requests
        if not self.store.trees or not r.sampling.is_greedy:
            return None
        ahead = self.store.take(r.session_id, r.context)
        if ahead is None:
            return None
        tree, state = ahead.tree, step.state
        if r.tree.parsed_method.copies:
            session = self.parts.session(r)
            if ahead.predictions is not None:
                session.adopt(ahead.predictions)
        self.parts.planner.follow(step.lane, state.ahead_chooser)
        step.remember(r, tree, state.ahead_builder, state.ahead_chooser)  # a hit drafts ahead again
        return StepTrees([tree])

    def draft_ahead(self, state: DraftLane) -> bool:
        """Draft the next step's trees for the lane's last batch-1 greedy step, for the outcomes of its verification
        the drafter expects (call it while the target scores that step). False when there is nothing to draft
        ahead: no such step, a sampled one, a tree without draft nodes."""
        if state.last_step is None:
            return False
        r, tree, builder, chooser = state.last_step
        state.last_step = None
        path = likely_path(tree)
        if not path or not r.sampling.is_greedy:
            return False
        parts = self.parts
        state.ahead_chooser, state.ahead_builder = chooser, builder
        chain = [r.context[-1], *(int(tree.tokens[n]) for n in path)]
        oracle = parts.runner.begin(r.session_id, r.context, r.sampling, None, r.features, r.cache_scope,
                                    r.processors, r.grammar)
        # A hybrid method's trees ahead mix in the copies the lookup finds after the guessed tokens, as its steps do.
        session = parts.lookups.get(r.session_id) if r.tree.parsed_method.copies else None
        base = len(chain)
        for length in range(len(path), max(-1, len(path) - GUESSES), -1):
            end = path[length - 1] if length else 0
            rejected = {int(tree.tokens[c]) for c in tree.children(end)}
            # The drafter's distribution after the guessed path (chain node `length`, fed once for all guesses).
            top = oracle.summarize(chain[:length + 1], [-1, *range(length)], [length],
                                   BONUS_CANDIDATES + len(rejected), False)
            # a token of probability 0 is no guess (top-k pads with them where a grammar or a warp leaves fewer)
            bonuses = [int(t) for t, q in zip(top.tokens[0].tolist(), top.values[0].tolist())
                       if q > 0.0 and int(t) not in rejected][:BONUS_CANDIDATES]
            for bonus in bonuses:
                below = OffsetOracle(oracle, chain[:length + 1], length, base)
                lookup = None if session is None else AheadLookup(session, chain[1:length + 1] + [bonus])
                if lookup is not None:
                    below = HybridOracle(below, parts.copies(r, lookup, lookup.prefix), parts.runner.vocab_size,
                                         head_index=parts.head_index)
                ahead = builder.build(bonus, below, r.sampling, parts.generator(r, 1))
                base += TREE_SPAN
                if ahead.num_nodes > 1:
                    self.store.put(r.session_id, AheadTree(r.context + chain[1:length + 1] + [bonus], ahead,
                                                           None if lookup is None else lookup.predictions))
        return True
