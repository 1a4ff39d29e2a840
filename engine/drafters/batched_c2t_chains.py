"""The drafting mode above batch size 1: batched C2T chains (C2T section 5.5; docs/design.md section 6).

Every sequence drafts a top-1 chain; all still-growing chains advance together, one drafter forward per
depth, and a chain stops before the first token whose classifier confidence falls under `beta`. Chains are
deterministic top-1 (ChildDraw.GREEDY at temperature 0, TOP_K otherwise: point-mass verification), the
same rule as `C2TChainBuilder`, which is the single-sequence form of this loop (`draft_c2t_chains`).

`BatchedChains` drafts a batched step: the chain depth is the step planner's (per batch-size bucket, or the
fixed depth capped by the requests' explicit budgets; engine/drafters/planner.py), and a lookup request's copy
chain joins its model chain in one tree, or replaces it where the lookup is confident (or the method is "lookup").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..budget import allocate_copies
from ..c2t_classifier import C2TClassifier, c2t_features
from ..lookup import LookupSettings
from ..lookup.trees import lookup_chain, merge_chains
from ..tree import ChildDraw, TokenTree
from .base import DraftRequest
from .draft_step import DraftingParts, DraftStep, StepTrees
from .model_runner import DrafterRunner, SessionOracle


@dataclass
class _CopyChain:
    """A batched step's copy chain for one lookup request: free to draft, cut to what pays at the batch size."""

    tokens: list[int]  # copied tokens, the root's child first
    joints: list[float]  # their path probabilities (non-increasing)
    modelled: bool  # the model drafts a chain for the request too (not for method "lookup", nor a confident copy)


class BatchedChains:
    """`DraftMode` of a step above batch size 1 (engine/drafters/draft_step.py)."""

    def __init__(self, parts: DraftingParts, depth: int, beta: float):
        """`depth`: the longest chain (the planner's cap); `beta`: the classifier confidence a chain stops under."""
        self.parts = parts
        self.depth = depth
        self.beta = beta

    def draft(self, step: DraftStep) -> StepTrees:
        """A C2T chain per request at the step's depth, joined by (or, where the lookup is confident or alone,
        replaced by) the request's copy chain; and the plain steps its plan holds after it. Lagging requests that
        the plan has the model draft for take their copy chain alone, and catch up beside the step; the others stay
        as they are (parked: a session the model does not draft for costs it nothing)."""
        parts, requests = self.parts, step.requests
        plan = parts.planner.plan_batch(step.lane, step.batch_size, requests)
        # Copy chains cost no drafter forward: each row keeps the part that pays for its target time at this batch
        # size (`allocate_copies`) when the step takes copies: with model chains, or alone (LOOKUP_ONLY, an arm of
        # its own, so that whether copies pay is measured too); a plain step has none.
        depth = plan.budget
        copies = [None] * len(requests) if plan.plain else self._copy_chains(step, depth)
        wanted = [i for i, copy in enumerate(copies) if depth > 0 and (copy is None or copy.modelled)]
        modelled = [i for i in wanted if step.model_ready(requests[i])]
        trees: list[TokenTree | None] = [None] * len(requests)
        if modelled:
            oracles = [parts.begin(requests[i]) for i in modelled]
            chains = draft_c2t_chains(parts.runner, oracles, [requests[i].context[-1] for i in modelled],
                                      parts.classifier, self.beta, depth)
            for i, chain in zip(modelled, chains):
                trees[i] = chain
        for i, (r, copy) in enumerate(zip(requests, copies)):
            if copy is not None:
                chain = trees[i]
                trees[i] = merge_chains(r.context[-1], chain.token_list[1:] if chain else [],
                                        chain.log_joint.tolist()[1:] if chain else [], copy.tokens, copy.joints,
                                        r.sampling.is_greedy)
        # The lookup is checked every step: a step that copies holds no plain steps.
        return StepTrees(trees, 0 if any(copy is not None for copy in copies) else plan.held)

    def _copy_chains(self, step: DraftStep, depth: int) -> list[_CopyChain | None]:
        """Each lookup request's copy chain (None for the others), cut to what pays at this batch size when the
        planner's chooser prices steps (`allocate_copies`)."""
        settings = self.parts.lookups.settings
        chains: list[_CopyChain | None] = []
        for r in step.requests:
            chains.append(self._copy_chain(r, settings) if r.tree.parsed_method.copies else None)
        copies = [chain for chain in chains if chain is not None]
        chooser = self.parts.planner.batch_chooser(step.lane)
        if chooser is not None and copies:
            # The step as the chooser expects it: model chains of `depth` (measured rate at that depth).
            arm = chooser.arms.get(depth)
            expected = arm.tokens / arm.steps if arm is not None and arm.steps else float(step.batch_size)
            keep = allocate_copies([copy.joints for copy in copies], step.batch_size, 1 + depth, expected,
                                   chooser.profile, chooser.max_step_cost)
            for copy, n in zip(copies, keep):
                copy.tokens, copy.joints = copy.tokens[:n], copy.joints[:n]
        return chains

    def _copy_chain(self, r: DraftRequest, settings: LookupSettings) -> _CopyChain:
        """`r`'s most probable copy chain up to the longest chain, and whether the model drafts beside it."""
        session = self.parts.session(r)
        tokens, joints = lookup_chain(self.parts.copies(r, session), self.depth, settings.chain_min_joint)
        confident = bool(joints) and joints[0] >= settings.skip_model_above
        return _CopyChain(tokens, joints, not r.tree.parsed_method.lookup_only and not confident)


def draft_c2t_chains(drafter: DrafterRunner, oracles: list[SessionOracle], roots: list[int],
                     classifier: C2TClassifier, beta: float, max_length: int) -> list[TokenTree]:
    chains: list[list[int]] = [[r] for r in roots]
    log_joint: list[list[float]] = [[0.0] for _ in roots]
    growing = list(range(len(roots)))
    to_feed = {i: ([0], [roots[i]], [-1]) for i in growing}  # tree node ids, tokens, parents
    for depth in range(1, max_length + 1):
        if not growing:
            break
        feeds = [to_feed[i] for i in growing]
        head = drafter.extend_many([oracles[i] for i in growing], [f[0] for f in feeds], [f[1] for f in feeds],
                                   [f[2] for f in feeds])
        # [G, V_draft] distribution after each chain's last token, over the drafter's head
        top = drafter.summarize(torch.stack([p[-1] for p in head]), 1, entropy=True)
        top_p, top_tok = top.values[:, 0], top.tokens[:, 0]
        joint = torch.tensor([math.exp(log_joint[i][-1]) for i in growing]) * top_p
        feats = c2t_features(joint, top.entropy, torch.full((len(growing),), float(depth)))
        keep = classifier.confidence(feats) >= beta
        still = []
        for g, i in enumerate(growing):
            if not bool(keep[g]):
                continue
            token = int(top_tok[g])
            chains[i].append(token)
            log_joint[i].append(log_joint[i][-1] + math.log(max(float(top_p[g]), 1e-30)))
            to_feed[i] = ([len(chains[i]) - 1], [token], [len(chains[i]) - 2])
            still.append(i)
        growing = still
    trees = []
    for i, chain in enumerate(chains):
        draw = ChildDraw.GREEDY if oracles[i].sampling.is_greedy else ChildDraw.TOP_K
        trees.append(TokenTree.build(chain, list(range(-1, len(chain) - 1)), draw, log_joint[i]))
    return trees
