"""DySpec dynamic token trees (Xiong et al.): greedy expansion (Algorithm 1) and the layer-wise
threshold variant (Algorithm 2).

Value of a node = prod of q along its root path (DySpec eq. 10; = exp(log_joint)). A "sampling
position" at node n is the next child draw there; it is reached with probability
s = v_n * (1 - sum of q over the children already drawn at n) (eq. 9).

How children are drawn (and hence the verification rule):
- temperature > 0: each child is SAMPLED from the residual draft distribution with the earlier
  siblings removed (Algorithm 1 lines 7-11) -> ChildDraw.WITHOUT_REPLACEMENT, verified by
  DySpec Algorithm 3. Which position to expand is decided from s alone, before the token is drawn
  (appendix A.1: the decision must not depend on the token, or the output would be biased).
- temperature 0: children are taken deterministically in descending order of q (top-k order of the
  residual) -> ChildDraw.TOP_K. The greedy then picks, among all candidate children, the one with
  the largest value v_n * q(next best token): exactly the greedy of appendix D.1, which is optimal
  (Theorem (B)): no tree with the same number of nodes has a larger sum of values.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from treeserve.engine.builders.base import (
    DraftOracle,
    PartialTree,
    UniformStream,
    check_open_unit,
    check_positive,
    safe_log,
)
from treeserve.engine.sampling import ResidualRow, SamplingParams
from treeserve.engine.tree import ChildDraw, TokenTree


@dataclass
class DySpecBuilder:
    """DySpec Algorithm 1: a heap of sampling positions, expanded one node at a time."""

    budget: int = 64  # draft nodes
    max_depth: int | None = None  # optional guard; the paper has none
    prefetch: int = 4  # rows fetched per oracle call: the popped node + the best unfetched heap nodes

    def __post_init__(self) -> None:
        check_positive("budget", self.budget)
        check_positive("max_depth", self.max_depth, allow_none=True)
        check_positive("prefetch", self.prefetch)

    def build(self, root_token: int, oracle: DraftOracle, sampling: SamplingParams, generator: torch.Generator) -> TokenTree:
        tree = PartialTree(root_token, oracle)
        if sampling.is_greedy:
            self._grow_greedy(tree)
        else:
            self._grow_sampled(tree, UniformStream(generator, chunk=self.budget + 8))
        return tree.finish()

    def _depth_ok(self, depth: int) -> bool:
        return self.max_depth is None or depth <= self.max_depth

    def _fetch(self, tree: PartialTree, residual: dict[int, ResidualRow], heap: list, node: int, greedy: bool) -> None:
        """Fetch `node`'s row in one oracle call together with the rows of the (prefetch - 1) best
        heap entries whose rows are still missing. Prefetching never changes the tree (rows do not
        depend on when they are fetched); it trades drafter work on rows that may go unused for
        fewer drafter calls, which dominate at budget 64+ (Algorithm 1 otherwise makes one call
        per node)."""
        wanted = [node]
        if self.prefetch > 1:
            # The first entries of the heap array are near its top; exact order does not matter here.
            for item in heap[: 4 * self.prefetch]:
                other = item[2]
                if other not in residual and other not in wanted:
                    wanted.append(other)
                    if len(wanted) == self.prefetch:
                        break
        rows = tree.query(wanted)
        # No batched pass here: a prefetched row may never be used, so each row computes its
        # block sums (sampling) or its top entries (greedy) on first use, one pass over V.
        residual.update(zip(wanted, ResidualRow.for_rows(rows)))

    def _grow_sampled(self, tree: PartialTree, uniforms: UniformStream) -> None:
        """Algorithm 1 at temperature > 0. Heap items: (-s, seq, node); rows are fetched lazily when
        a node's first position is popped, so leaves never cost an oracle call."""
        residual: dict[int, ResidualRow] = {}
        depth = {0: 0}
        heap = [(-1.0, 0, 0)]
        seq = 1
        while heap and len(tree) - 1 < self.budget:
            _, _, node = heapq.heappop(heap)
            if node not in residual:
                self._fetch(tree, residual, heap, node, greedy=False)
            res = residual[node]
            picked = res.sample(uniforms.next())
            if picked is None:
                continue
            token, prob = picked
            tree.set_draw(node, ChildDraw.WITHOUT_REPLACEMENT, res.row, res.total)
            child = tree.add(node, token, safe_log(prob))
            depth[child] = depth[node] + 1
            value = math.exp(tree.log_joint[node])
            sibling_reach = value * res.remaining  # v1 = v * (1 - R[y]), Algorithm 1 line 9
            if sibling_reach > 0.0:
                heapq.heappush(heap, (-sibling_reach, seq, node))
            if self._depth_ok(depth[child] + 1):
                heapq.heappush(heap, (-value * prob, seq + 1, child))  # v0 = v * R[y], line 8
            seq += 2

    def _grow_greedy(self, tree: PartialTree) -> None:
        """Appendix D.1 greedy at temperature 0. Heap items: (-priority, seq, node, resolved); an
        unresolved item carries the upper bound v_node (its row is not fetched yet), a resolved one
        the exact value of its next child, v_node * q(next best token). Popping a resolved item
        therefore always yields the best candidate (lazy evaluation of the heap keys)."""
        residual: dict[int, ResidualRow] = {}
        depth = {0: 0}
        heap = [(-1.0, 0, 0, False)]
        seq = 1
        while heap and len(tree) - 1 < self.budget:
            _, _, node, resolved = heapq.heappop(heap)
            value = math.exp(tree.log_joint[node])
            if not resolved:
                if node not in residual:
                    self._fetch(tree, residual, heap, node, greedy=True)
                top = residual[node].peek_top()
                if top is not None:
                    heapq.heappush(heap, (-value * top[1], seq, node, True))
                    seq += 1
                continue
            res = residual[node]
            picked = res.take_top()
            if picked is None:
                continue
            token, prob = picked
            tree.set_draw(node, ChildDraw.TOP_K)
            child = tree.add(node, token, safe_log(prob))
            depth[child] = depth[node] + 1
            nxt = res.peek_top()
            if nxt is not None:
                heapq.heappush(heap, (-value * nxt[1], seq, node, True))
            if self._depth_ok(depth[child] + 1):
                heapq.heappush(heap, (-value * prob, seq + 1, child, False))
            seq += 2


@dataclass
class DySpecThresholdBuilder:
    """DySpec Algorithm 2: layer by layer, one oracle call per layer; at each frontier node keep
    drawing children while the next position's reach s exceeds `threshold` (the printed
    `while v_i < t` is a typo for `>`, as the surrounding text says). `budget` caps the tree;
    frontier nodes are served in descending value so a cap cuts the least valuable positions."""

    threshold: float = 0.05
    budget: int = 64
    max_depth: int | None = None

    def __post_init__(self) -> None:
        check_open_unit("threshold", self.threshold)
        check_positive("budget", self.budget)
        check_positive("max_depth", self.max_depth, allow_none=True)

    def build(self, root_token: int, oracle: DraftOracle, sampling: SamplingParams, generator: torch.Generator) -> TokenTree:
        tree = PartialTree(root_token, oracle)
        greedy = sampling.is_greedy
        uniforms = UniformStream(generator, chunk=self.budget + 8)
        frontier, depth = [0], 0
        while frontier and len(tree) - 1 < self.budget and (self.max_depth is None or depth < self.max_depth):
            frontier.sort(key=lambda n: (-tree.log_joint[n], n))
            rows = tree.query(frontier)
            nxt: list[int] = []
            for node, res in zip(frontier, ResidualRow.for_rows(rows, top=8 if greedy else 0, block_sums=not greedy)):
                value = math.exp(tree.log_joint[node])
                reach = value
                while reach > self.threshold and len(tree) - 1 < self.budget:
                    picked = res.take_top() if greedy else res.sample(uniforms.next())
                    if picked is None:
                        break
                    token, prob = picked
                    if greedy:
                        tree.set_draw(node, ChildDraw.TOP_K)
                    else:
                        tree.set_draw(node, ChildDraw.WITHOUT_REPLACEMENT, res.row, res.total)
                    child = tree.add(node, token, safe_log(prob))
                    if value * prob > self.threshold:  # below it the child would draw nothing
                        nxt.append(child)
                    reach = value * res.remaining
            frontier, depth = nxt, depth + 1
        return tree.finish()
