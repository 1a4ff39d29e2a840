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

Over a hybrid oracle (engine/lookup/) the greedy reads merged rows (lookup candidates mixed into q) and
needs no change. Sampling does (the same growers, over the oracle's `LookupSource`): a node's lookup
candidates become its first children when its first position is popped (deterministic, each of value v * c,
verified by the point-mass rule), then its children are sampled from q with those tokens removed, the
position reached with v * (1 - w) * (mass left), w the lookup candidates' calibrated mass. Whether a node
gets lookup children depends only on its root path, never on what is sampled there, so the verification
stays exact (engine/verify.py).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..lookup.suffix_index import LookupRow
from ..requests import SamplingParams
from ..sampling import ResidualRow
from ..tree import ChildDraw, TokenTree
from ..tree_settings import check_open_unit, check_positive
from .base import DraftOracle, LookupSource, PartialTree, UniformStream, safe_log


@dataclass
class DySpecBuilder:
    """DySpec Algorithm 1: a heap of sampling positions, expanded one node at a time."""

    size_field: ClassVar[str | None] = "budget"

    budget: int = 64  # draft nodes
    max_depth: int | None = None  # optional guard; the paper has none
    # Rows per oracle call: T > 0 the popped node + best unfetched heap nodes; T = 0 the best candidates. A
    # drafter forward's cost barely grows with its rows (default drafter, 1 thread, T=0, 64 nodes, same tree:
    # prefetch 4 -> 16 took 19 -> 8 calls, 310 -> 153 ms of drafting, 3.5 -> 2.1 ms of building).
    prefetch: int = 16

    def __post_init__(self) -> None:
        check_positive("budget", self.budget)
        check_positive("max_depth", self.max_depth, allow_none=True)
        check_positive("prefetch", self.prefetch)

    def build(self, root_token: int, oracle: DraftOracle, sampling: SamplingParams, generator: torch.Generator) -> TokenTree:
        tree = PartialTree(root_token, oracle)
        if sampling.is_greedy:
            return self._grow_greedy(tree)
        self._grow_sampled(tree, UniformStream(generator, chunk=self.budget + 8))
        return tree.finish()

    def _depth_ok(self, depth: int) -> bool:
        return self.max_depth is None or depth <= self.max_depth

    def _grow_sampled(self, tree: PartialTree, uniforms: UniformStream) -> None:
        """Algorithm 1 at temperature > 0. Heap items: (-s, seq, node); rows are fetched lazily when a node's
        first position is popped, so leaves never cost an oracle call. Over a lookup source (module docstring)
        a node's first pop opens it instead (`_open`); later pops draw from its model row."""
        lookup = tree.lookup
        residual: dict[int, ResidualRow] = {}
        share: dict[int, float] = {}  # lookup: the mass of the node's row left to the model after its candidates
        opened: set[int] = set()  # lookup: nodes whose first position was popped
        depth = {0: 0}
        heap = [(-1.0, 0, 0)]
        seq = 1
        while heap and len(tree) - 1 < self.budget:
            _, _, node = heapq.heappop(heap)
            if lookup is not None and node not in opened:
                seq = self._open(tree, heap, residual, share, opened, node, depth, seq)
                continue
            if node not in residual:
                self._fetch(tree, residual, heap, node, opened)
            seq = self._sample_child(tree, heap, residual[node], node, math.exp(tree.log_joint[node]),
                                     1.0 if lookup is None else share[node], uniforms, depth, seq)

    def _open(self, tree: PartialTree, heap: list, residual: dict[int, ResidualRow], share: dict[int, float],
              opened: set[int], node: int, depth: dict[int, int], seq: int) -> int:
        """A node's first pop over a lookup source: its lookup candidates appended (deterministic, each of value
        v * c) and pushed, then, where the model backs it, its model row fetched (with up to prefetch - 1 unopened
        model-backed heap nodes), their tokens removed from it, and its first sampling position pushed, reached
        with v * (1 - w) * (mass left). Returns the next heap sequence number."""
        opened.add(node)
        value = math.exp(tree.log_joint[node])
        row = tree.candidates(node)
        added = 0
        if row is not None:
            for token, c in zip(row.tokens, row.values):
                if len(tree) - 1 >= self.budget:
                    break
                child = tree.add_copy(node, token, c)
                added += 1
                depth[child] = depth[node] + 1
                if self._depth_ok(depth[child] + 1):
                    heapq.heappush(heap, (-value * c, seq, child))
                    seq += 1
        if not tree.model_backed(node) or len(tree) - 1 >= self.budget:
            return seq
        if node not in residual:
            self._fetch(tree, residual, heap, node, opened)
        res = residual[node]
        share[node] = _model_share(res, row, added)
        reach = value * share[node] * res.remaining
        if reach > 0.0:
            heapq.heappush(heap, (-reach, seq, node))
            seq += 1
        return seq

    def _fetch(self, tree: PartialTree, residual: dict[int, ResidualRow], heap: list, node: int,
               opened: set[int]) -> None:
        """Fetch `node`'s row in one oracle call together with the rows of the (prefetch - 1) best
        heap entries whose rows are still missing. Prefetching never changes the tree (rows do not
        depend on when they are fetched); it trades drafter work on rows that may go unused for
        fewer drafter calls, which dominate at budget 64+ (Algorithm 1 otherwise makes one call
        per node). Over a lookup source: the model's own rows, of unopened model-backed nodes only; every
        unopened node of the window is asked whether the model backs it (which records its lookup prediction)."""
        wanted = [node]
        # The first entries of the heap array are near its top; exact order does not matter here.
        window = heap[: 4 * self.prefetch] if self.prefetch > 1 or tree.lookup is not None else ()
        if tree.lookup is not None:
            window = [item for item in window
                      if item[2] not in opened and item[2] not in residual and tree.model_backed(item[2])]
        for item in window:
            if len(wanted) >= self.prefetch:
                break
            other = item[2]
            if other not in residual and other not in wanted:
                wanted.append(other)
        rows = tree.query_model(wanted)
        # No batched pass here: a prefetched row may never be used, so each row computes its
        # block sums (sampling) or its top entries (greedy) on first use, one pass over V.
        residual.update(zip(wanted, ResidualRow.for_rows(rows)))

    def _sample_child(self, tree: PartialTree, heap: list, res: ResidualRow, node: int, value: float, share: float,
                      uniforms: UniformStream, depth: dict[int, int], seq: int) -> int:
        """One sampling position of `node` (Algorithm 1 lines 7-9): draw its next child from the residual row and
        push the two positions that opens, the node's next draw v1 = v * (1 - R[y]) and the child's v0 = v * R[y].
        `share`: the part of the node's row left to the model (1 without lookup candidates; over a lookup source
        the model's children carry it in their values). Returns the next heap sequence number."""
        picked = res.sample(uniforms.next())
        if picked is None:
            return seq
        token, prob = picked
        tree.set_draw(node, ChildDraw.WITHOUT_REPLACEMENT, res.row, res.total)
        child = tree.add(node, token, safe_log(share * prob))
        depth[child] = depth[node] + 1
        reach = value * share * res.remaining
        if reach > 0.0:
            heapq.heappush(heap, (-reach, seq, node))
        if self._depth_ok(depth[child] + 1):
            heapq.heappush(heap, (-value * share * prob, seq + 1, child))
        return seq + 2

    def _grow_greedy(self, tree: PartialTree) -> TokenTree:
        """Appendix D.1 greedy at temperature 0, evaluated in value-ordered batches.

        The greedy adds, one at a time, the candidate child with the largest value v = v_parent *
        q(token) (eq. 10); values never grow along a path, so its result is the set of the
        `budget` highest-valued nodes of the (infinite) draft tree, ancestor-closed with ties
        broken parents first (Theorem (B): optimal). Finding that set needs the rows of exactly
        the nodes whose value exceeds the budget-th value theta (their children may qualify) and
        no others. This loop computes the same set without a heap pop per node: it fetches the
        best unfetched candidates `prefetch` rows per drafter call, in descending value, lists
        each fetched row's top children whose value exceeds the running theta (the budget-th
        largest value listed so far, a lower bound of the final one: a child at or below it can
        never qualify), and stops when no unfetched candidate and no unlisted child can exceed
        theta. One batched top-k per call replaces one top-k per node (the per-node torch op
        overhead dominated the build), and the drafter runs budget / prefetch forwards instead of
        one per node. Nodes fetched and then overtaken are dropped by `finish(keep=...)`; siblings
        stay in descending q, the order the greedy would have drawn them (TOP_K)."""
        budget, max_depth = self.budget, self.max_depth
        vocab = tree.oracle.vocab_size
        width = min(32, vocab)  # children listed per fetched row (more only if they could qualify)
        # Heaps of listed children keyed by value, ties to the earlier listed (seq is unique, so the children
        # themselves are never compared): every candidate, best first, and the budget best, worst first.
        cand: list[tuple[float, int, _Child]] = []  # (-v, seq, child)
        best: list[tuple[float, int, _Child]] = []  # (v, -seq, child); best[0][0] is theta once full
        cut_rows: list[_CutRow] = []
        theta = 0.0
        seq = 0

        def offer(node: int, value: float, depth: int, pairs) -> float:  # type: ignore[no-untyped-def]
            """List children (q, token) of `node` in descending q while their value beats theta;
            returns the value bound of the first one not listed (0.0 if none is left)."""
            nonlocal theta, seq
            for q, tok in pairs:
                v = value * q
                if v <= theta or q <= 0.0:
                    return 0.0
                seq += 1
                child = _Child(node, tok, q, depth)
                heapq.heappush(best, (v, -seq, child))
                if len(best) > budget:
                    heapq.heappop(best)
                if len(best) == budget:
                    theta = best[0][0]
                heapq.heappush(cand, (-v, seq, child))
            return -1.0  # all offered pairs listed: the caller bounds the rest

        fetch = [(0, 1.0, 0)]  # (node, value, depth) appended and due for their rows
        while True:
            if fetch:
                top = tree.top([node for node, _, _ in fetch], width)
                values, tokens = top.values.numpy(), top.tokens.numpy()  # [F, width], rows descending
                # tolist makes a Python object per entry (~15 ns each), and once theta is set most rows list a
                # child or two: convert the first `head` columns of all rows, the rest of a row only when its
                # whole head was listed (offered right away, so the order of the offers is unchanged).
                head = min(width, 8)
                heads = zip(values[:, :head].tolist(), tokens[:, :head].tolist())
                for row, ((node, value, depth), (vals, toks)) in enumerate(zip(fetch, heads)):
                    if max_depth is not None and depth + 1 > max_depth:
                        continue
                    listed_all = offer(node, value, depth + 1, zip(vals, toks)) < 0.0
                    if listed_all and head < width:
                        vals, toks = values[row].tolist(), tokens[row].tolist()
                        listed_all = offer(node, value, depth + 1, zip(vals[head:], toks[head:])) < 0.0
                    if listed_all and width < vocab:
                        cut_rows.append(_CutRow(node, value, depth + 1, set(toks), width, value * vals[-1]))
                fetch = []
            while cand and len(fetch) < self.prefetch and -cand[0][0] > theta:
                neg_v, _, child = heapq.heappop(cand)
                child.node = tree.add(child.parent, child.token, safe_log(child.q))
                fetch.append((child.node, -neg_v, child.depth))
            if fetch:
                continue
            # No candidate beats theta; list more children of rows cut at `width` that still could.
            grow = [cut for cut in cut_rows if cut.bound > theta]
            if not grow:
                break
            for cut in grow:
                k = min(vocab, 4 * cut.rank)
                wider = tree.top([cut.node], k)  # summarised oracle-side: no drafter forward (the row is kept)
                vals, toks = wider.values[0].tolist(), wider.tokens[0].tolist()
                fresh = [(q, t) for q, t in zip(vals, toks) if t not in cut.seen]
                cut.seen.update(t for _, t in fresh)
                cut.rank, cut.bound = k, (cut.value * vals[-1] if k < vocab else 0.0)
                if offer(cut.node, cut.value, cut.depth, fresh) >= 0.0:
                    cut.bound = 0.0
        # The selected set: fetched ones are appended; append the others, siblings by descending q.
        rest = sorted((child.parent, -child.q, -neg_seq, child) for _, neg_seq, child in best if child.node < 0)
        for _, _, _, child in rest:
            child.node = tree.add(child.parent, child.token, safe_log(child.q))
        return tree.finish(keep=sorted(child.node for _, _, child in best))


def _model_share(res: ResidualRow, row: LookupRow | None, added: int) -> float:
    """Over a lookup source: remove the tokens of a node's first `added` lookup candidates `row` (appended as
    its children) from the model's residual row `res`, as the model's children are drawn without them; returns
    1 - w, the part of the node's row left to the model (w: the candidates' calibrated mass)."""
    if added:
        for token in row.tokens[:added]:
            res.remove(token, float(res.row[token]))
    return 1.0 - (row.total if row is not None else 0.0)


class _Child:
    """A child the greedy listed (`DySpecBuilder._grow_greedy`): a candidate for the tree, appended (`node`) when
    its row is fetched or when it is among the budget best at the end."""

    __slots__ = ("parent", "token", "q", "depth", "node")

    def __init__(self, parent: int, token: int, q: float, depth: int) -> None:
        self.parent = parent
        self.token = token
        self.q = q
        self.depth = depth
        self.node = -1  # its index in the partial tree, once appended


class _CutRow:
    """A fetched row whose children the greedy listed only down to rank `rank` (all of them beat theta then):
    more of them may qualify while `bound`, the value of the last one listed (0 once none is left), beats
    theta. `seen`: the tokens listed."""

    __slots__ = ("node", "value", "depth", "seen", "rank", "bound")

    def __init__(self, node: int, value: float, depth: int, seen: set[int], rank: int, bound: float) -> None:
        self.node = node
        self.value = value
        self.depth = depth  # of its children
        self.seen = seen
        self.rank = rank
        self.bound = bound


@dataclass
class DySpecThresholdBuilder:
    """DySpec Algorithm 2: layer by layer, one oracle call per layer; at each frontier node keep
    drawing children while the next position's reach s exceeds `threshold` (the printed
    `while v_i < t` is a typo for `>`, as the surrounding text says). `budget` caps the tree;
    frontier nodes are served in descending value so a cap cuts the least valuable positions."""

    size_field: ClassVar[str | None] = "budget"

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
        # Lookup candidates become children of their own only where children are sampled (module docstring of
        # DySpecBuilder); deterministic draws take them from the merged rows.
        lookup = None if greedy else tree.lookup
        frontier, depth = [0], 0
        while frontier and len(tree) - 1 < self.budget and (self.max_depth is None or depth < self.max_depth):
            frontier.sort(key=lambda n: (-tree.log_joint[n], n))
            nxt: list[int] = []
            for node, res in zip(frontier, self._residuals(tree, frontier, greedy, lookup)):
                value = math.exp(tree.log_joint[node])
                share, scaled, reach = 1.0, value, value  # scaled = v * (1 - w): the model's part of the value
                if lookup is not None:
                    row = tree.candidates(node)
                    added = 0
                    if row is not None:  # lookup children first, while their value v * c beats the threshold
                        for token, c in zip(row.tokens, row.values):
                            if value * c <= self.threshold or len(tree) - 1 >= self.budget:
                                break
                            nxt.append(tree.add_copy(node, token, c))
                            added += 1
                    if res is None:  # no model row here
                        continue
                    share = _model_share(res, row, added)
                    scaled = value * share
                    reach = scaled * res.remaining
                while reach > self.threshold and len(tree) - 1 < self.budget:
                    picked = res.take_top() if greedy else res.sample(uniforms.next())
                    if picked is None:
                        break
                    token, prob = picked
                    if greedy:
                        tree.set_draw(node, ChildDraw.TOP_K)
                    else:
                        tree.set_draw(node, ChildDraw.WITHOUT_REPLACEMENT, res.row, res.total)
                    child = tree.add(node, token, safe_log(share * prob))
                    if scaled * prob > self.threshold:  # below it the child would draw nothing
                        nxt.append(child)
                    reach = scaled * res.remaining
            frontier, depth = nxt, depth + 1
        return tree.finish()

    @staticmethod
    def _residuals(tree: PartialTree, frontier: list[int], greedy: bool,
                   lookup: LookupSource | None) -> list[ResidualRow | None]:
        """One oracle call for the layer. Sampling needs every row's block sums (over a lookup source: the
        model's own rows, None for a node it does not back); deterministic draws need only each row's first few
        entries (the full row is fetched, from the oracle's cache, for a node that draws past them)."""
        if lookup is not None:
            backed = [n for n in frontier if tree.model_backed(n)]
            rows = dict(zip(backed, ResidualRow.for_rows(tree.query_model(backed), block_sums=True))) if backed else {}
            return [rows.get(n) for n in frontier]
        if not greedy:
            return ResidualRow.for_rows(tree.query(frontier), block_sums=True)
        top = tree.top(frontier, 8)
        return [ResidualRow.from_top(vals, toks, lambda node=node: tree.query([node])[0])
                for node, vals, toks in zip(frontier, top.values.tolist(), top.tokens.tolist())]
