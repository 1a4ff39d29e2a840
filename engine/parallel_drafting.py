"""Tree drafting with the parallel drafter: ONE drafter forward per step gives k+1 position distributions,
and a token tree is built from them (ParallelSpec Algorithm 1's draft; Medusa-style trees).

Per request: `CachedLM.begin` reconciles the session's KV cache with the context (real tokens only), then
one batched `extend` feeds [root, MASK_1..MASK_k] as a chain for every request. Row 0 of the result is
q_1 = q(x_{t+1} | x_<=t), row j is q_{j+1} = q(x_{t+1+j} | x_<=t, MASK_1..MASK_j). The masks' KV is
dropped at the next `begin` (CachedLM keeps the root: the accepted path through negative ids is empty),
so the cache only ever holds real tokens.

The k+1 distributions are treated as independent positions: a node at depth d takes its token from q_d,
whatever its ancestors are. Tree shapes (`TreeConfig.method`):
- "static": the configured rank paths (Medusa / EAGLE choices, binary, explicit `static_paths`), cut at
  depth k+1, the r-th ranked token of q_d at depth d;
- "chain": the top-1 token of q_1..q_depth (depth <= k+1);
- every dynamic method ("dyspec", "opt_tree", "eagle2", "c2t", ...): the `budget` nodes with the largest
  path probability prod_d q_d(token_d), i.e. the tree maximising the expected accepted length E(A) under
  independence (OPT-Tree's objective, solved exactly: best-first search over rank paths, every node's
  value is at most its parent's and its previous sibling's, so the popped set is ancestor-closed);
  "dyspec_threshold" additionally stops at path probabilities below `threshold`.
Children are deterministic top-ranked tokens, so every node is ChildDraw.TOP_K and verification uses the
point-mass rule (lossless whatever q is; at temperature 0 it follows the target argmax) - ParallelSpec's
Algorithm 1 token tree verification. Draft probabilities are not needed by that rule and not shipped.

Above batch size 1 (DESIGN.md section 6) every sequence drafts a chain (top-1 of each position) cut where
its joint probability drops below `batch_chain_min_joint`, all from the same single batched forward.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from treeserve.engine.builders import TreeConfig
from treeserve.engine.builders.static import named_tree
from treeserve.engine.drafters.base import AUTOREGRESSIVE, DrafterBase, DraftRequest, root_only
from treeserve.engine.requests import StepRecord
from treeserve.engine.runners.cached_lm import CachedLM, ExtendRequest
from treeserve.engine.sampling import warp_probs
from treeserve.engine.tree import ChildDraw, TokenTree

PARALLEL = "parallel"
Path = tuple[int, ...]


@dataclass
class ParallelTreeBuilder:
    """Builds a tree from per-depth ranked candidates (top tokens of q_1..q_D and their probabilities).

    `paths` set: a static tree (ranks per depth). Otherwise best-first over rank paths: the `budget` nodes
    of largest path probability, depth <= max_depth, at most `max_width` children per node, stopping at
    path probabilities below `min_prob`."""

    budget: int = 16
    max_depth: int = 5
    max_width: int = 16
    min_prob: float = 0.0
    paths: tuple[Path, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("budget", "max_depth", "max_width"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not (0.0 <= self.min_prob < 1.0):
            raise ValueError(f"min_prob must lie in [0, 1), got {self.min_prob}")

    @property
    def width(self) -> int:
        """Candidates needed per position."""
        if self.paths is not None:
            return max(p[-1] for p in self.paths) + 1
        return min(self.max_width, self.budget)

    def build(self, root_token: int, values: list[list[float]], tokens: list[list[int]]) -> TokenTree:
        """values/tokens [D][w]: the ranked probabilities and tokens of q_1..q_D (descending)."""
        depth = min(self.max_depth, len(values))
        if self.paths is not None:
            return self._static(root_token, values, tokens, depth)
        out_tokens, parents, log_joint = [root_token], [-1], [0.0]
        # Heap entries: (-path prob, tie-break, parent node, depth, rank, parent path prob).
        heap: list[tuple[float, int, int, int, int, float]] = []
        counter = 0

        def push(parent: int, d: int, rank: int, parent_prob: float) -> None:
            nonlocal counter
            if d > depth or rank >= len(values[d - 1]) or rank >= self.max_width:
                return
            prob = parent_prob * values[d - 1][rank]
            if prob <= 0.0 or prob < self.min_prob:
                return
            counter += 1
            heapq.heappush(heap, (-prob, counter, parent, d, rank, parent_prob))

        push(0, 1, 0, 1.0)
        while heap and len(out_tokens) - 1 < self.budget:
            neg, _, parent, d, rank, parent_prob = heapq.heappop(heap)
            node = len(out_tokens)
            out_tokens.append(tokens[d - 1][rank])
            parents.append(parent)
            log_joint.append(math.log(-neg))
            push(node, d + 1, 0, -neg)  # first child
            push(parent, d, rank + 1, parent_prob)  # next sibling
        return TokenTree.build(out_tokens, parents, ChildDraw.TOP_K, log_joint)

    def _static(self, root_token, values, tokens, depth) -> TokenTree:
        out_tokens, parents, log_joint = [root_token], [-1], [0.0]
        node_of: dict[Path, int] = {(): 0}
        for path in sorted(self.paths, key=lambda p: (len(p), p)):
            d, rank = len(path), path[-1]
            parent = node_of.get(path[:-1])
            if d > depth or parent is None or rank >= len(values[d - 1]) or values[d - 1][rank] <= 0.0:
                continue  # beyond the drafter's positions, or a zero-probability (warped away) token
            node_of[path] = len(out_tokens)
            out_tokens.append(tokens[d - 1][rank])
            parents.append(parent)
            log_joint.append(log_joint[parent] + math.log(values[d - 1][rank]))
        return TokenTree.build(out_tokens, parents, ChildDraw.TOP_K, log_joint)


def builder_for_config(config: TreeConfig, positions: int) -> ParallelTreeBuilder:
    """The parallel tree for a TreeConfig, over `positions` (= k+1) distributions."""
    cap = positions if config.max_depth is None else min(positions, config.max_depth)
    if config.method == "static":
        paths = config.static_paths if config.static_paths is not None else named_tree(config.static_tree, config.depth)
        paths = tuple(tuple(int(r) for r in p) for p in paths if len(p) <= positions)
        if not paths:
            raise ValueError("static tree has no path within the parallel drafter's positions")
        return ParallelTreeBuilder(budget=len(paths), max_depth=positions, paths=paths)
    if config.method == "chain":
        length = min(config.depth, positions)
        return ParallelTreeBuilder(budget=length, max_depth=length, max_width=1)
    if config.method == "c2t_chain":  # chain with early exit: stop where the joint probability falls below 0.1
        length = min(config.depth, positions)
        return ParallelTreeBuilder(budget=length, max_depth=length, max_width=1, min_prob=0.1)
    if config.method == "dyspec_threshold":
        return ParallelTreeBuilder(budget=config.budget, max_depth=cap, min_prob=config.threshold)
    return ParallelTreeBuilder(budget=config.budget, max_depth=cap)


class ParallelTreeDrafter(DrafterBase):
    """The `Drafter` (engine/drafters/base.py) over a parallel drafter model: draft / observe / release."""

    kind = PARALLEL

    def __init__(self, model: torch.nn.Module, target_vocab_size: int, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, budget=None, max_sessions: int = 256,
                 batch_chain_min_joint: float = 0.1):
        from treeserve.engine.models.parallel_drafter import mask_ids

        self.lm = CachedLM(model, device, dtype, max_sessions)
        self.vocab_size = target_vocab_size
        self.num_masks = int(model.num_masks)
        self.masks = mask_ids(self.num_masks)
        ids = getattr(model, "vocab_ids", None)
        self.vocab_ids = None if ids is None else ids.cpu()
        self.budget = budget  # optional BudgetChooser (batch-1 trees)
        self.batch_chain_min_joint = batch_chain_min_joint
        self.hold_steps = 0  # further steps the chooser decided are plain decoding (see LocalDrafter)
        self._builders: dict[str, ParallelTreeBuilder] = {}
        self.last_model_ms = 0.0  # drafter runner time of the last draft() call (forward, KV upkeep, warping)
        self.last_forward_ms = 0.0  # of which the model forward
        self.last_positions: list[Tensor] = []  # warped q_1..q_{k+1} per drafted request (draft vocab), for tests

    @property
    def model(self) -> torch.nn.Module:
        return self.lm.model

    @property
    def positions(self) -> int:
        return self.num_masks + 1

    def builder(self, config: TreeConfig) -> ParallelTreeBuilder:
        key = repr(config)
        if key not in self._builders:
            self._builders[key] = builder_for_config(config, self.positions)
        return self._builders[key]

    def position_probs(self, requests: list[DraftRequest]) -> list[Tensor]:
        """One batched forward: warped [k+1, V_draft] position distributions per request."""
        for r in requests:
            if not r.context:
                raise ValueError(f"session {r.session_id}: context must hold at least the root token")
            self.lm.begin(r.session_id, r.context)  # the tree hint indexes the target's tree, not our chain
        chain = list(range(-1, self.num_masks))
        logits = self.lm.extend([ExtendRequest(r.session_id, [r.context[-1], *self.masks], chain) for r in requests])
        return [warp_probs(rows, r.sampling) for r, rows in zip(requests, logits)]

    def draft(self, requests: list[DraftRequest], batch_size: int | None = None) -> list[TokenTree]:
        """One tree per request from one batched forward: the configured tree at batch size 1, chains that
        stop below `batch_chain_min_joint` above (`batch_size` as `LocalDrafter.draft`), capped by an
        explicit budget."""
        speculative = [r for r in requests if r.tree.method != AUTOREGRESSIVE]
        trees: dict[int, TokenTree] = {}
        plans: list[tuple[DraftRequest, ParallelTreeBuilder]] = []
        self.hold_steps = 0
        batched = (batch_size or len(requests)) > 1
        for r in speculative:
            if batched:
                depth = min(r.tree.depth, self.positions)
                if not r.tree.budget_auto:
                    depth = min(depth, r.tree.budget)
                builder = ParallelTreeBuilder(budget=depth, max_depth=depth, max_width=1,
                                              min_prob=self.batch_chain_min_joint)
            else:
                builder = self.builder(r.tree)
                if self.budget is not None and r.tree.budget_auto and builder.paths is None and builder.max_width > 1:
                    builder = self.budget.builder_for(builder)  # None: no drafting pays this step
                    self.hold_steps = self.budget.held
            if builder is not None:
                plans.append((r, builder))
        started, forward_seconds = time.perf_counter(), self.lm.forward_seconds
        self.last_positions = self.position_probs([r for r, _ in plans]) if plans else []
        self.last_model_ms = (time.perf_counter() - started) * 1e3 if plans else 0.0
        self.last_forward_ms = (self.lm.forward_seconds - forward_seconds) * 1e3
        for (r, builder), rows in zip(plans, self.last_positions):
            trees[id(r)] = self._build(r.context[-1], rows, builder)
        return [trees.get(id(r)) or root_only(r.context) for r in requests]

    def _build(self, root: int, rows: Tensor, builder: ParallelTreeBuilder) -> TokenTree:
        width = min(builder.width, rows.shape[-1])
        values, index = torch.topk(rows, width, dim=-1)
        values, index = values.cpu(), index.cpu()  # vocab_ids live on the CPU, as the builder does
        tokens = index if self.vocab_ids is None else self.vocab_ids[index]
        return builder.build(root, values.tolist(), tokens.tolist())

    def observe(self, record: StepRecord) -> None:
        """Feed a finished step's timing to the budget chooser (it ignores steps it did not decide)."""
        if self.budget is not None and record.batch_size == 1:
            self.budget.observe(record)

    def release(self, session_id: str) -> bool:
        return self.lm.release(session_id)
