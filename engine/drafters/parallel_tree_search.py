"""ParallelSpec's tree search: the token tree drawn from k+1 independent position distributions.

A parallel drafter (engine/drafters/models/parallel.py) gives, from ONE forward, q_1..q_{k+1}: the
distributions of the next k+1 positions, each independent of the tokens chosen before it. So this is not a
`TreeBuilder` (engine/builders): those grow a tree by asking a `DraftOracle` for the distribution after each
node they add; here every distribution is known before the search starts, and a node at depth d takes its
token from q_d whatever its ancestors are. `ParallelTreeSearch.search(root, values, tokens)` reads the ranked
top tokens of each position instead of an oracle. Tree shapes (`TreeConfig.method`, `search_for_config`):
- "static": the configured rank paths (Medusa / EAGLE choices, binary, explicit `static_paths`), cut at
  depth k+1, the r-th ranked token of q_d at depth d;
- "chain": the top-1 token of q_1..q_depth (depth <= k+1); "c2t_chain" stops it below joint probability 0.1;
- every dynamic method ("dyspec", "opt_tree", "eagle2", "c2t", ...): the `budget` nodes with the largest
  path probability prod_d q_d(token_d), i.e. the tree maximising the expected accepted length E(A) under
  independence (OPT-Tree's objective, solved exactly: best-first search over rank paths, every node's
  value is at most its parent's and its previous sibling's, so the popped set is ancestor-closed);
  "dyspec_threshold" additionally stops at path probabilities below `threshold`.
Children are deterministic top-ranked tokens, so every node is ChildDraw.TOP_K (point-mass verification).
The budget chooser resizes a search as it resizes a builder (its `budget` field).

A request with a grammar (docs/design.md section 5) passes `allowed`: a candidate the grammar refuses after its
parent's path is skipped for the next-ranked one (its subtree with it), so no node goes to a token the target's
masked row gives probability 0; `max_width` then counts the children kept.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, ClassVar

from ..builders.static import named_tree
from ..tree import ChildDraw, TokenTree
from ..tree_config import TreeConfig
from ..tree_settings import C2TChainSettings, ChainSettings, DySpecThresholdSettings, StaticSettings

Path = tuple[int, ...]
# Whether the request's grammar allows `token` after a node's path below the root (tokens, root excluded)
Allowed = Callable[[tuple[int, ...], int], bool]


@dataclass
class ParallelTreeSearch:
    """Chooses a tree from per-depth ranked candidates (top tokens of q_1..q_D and their probabilities).

    `paths` set: a static tree (ranks per depth). Otherwise best-first over rank paths: the `budget` nodes
    of largest path probability, depth <= max_depth, at most `max_width` children per node, stopping at
    path probabilities below `min_prob`."""

    size_field: ClassVar[str | None] = "budget"

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

    def search(self, root_token: int, values: list[list[float]], tokens: list[list[int]],
               allowed: Allowed | None = None) -> TokenTree:
        """values/tokens [D][w]: the ranked probabilities and tokens of q_1..q_D (descending); `allowed`: the
        request's grammar (None: none)."""
        depth = min(self.max_depth, len(values))
        if self.paths is not None:
            return self._static(root_token, values, tokens, depth, allowed)
        out_tokens, parents, log_joint = [root_token], [-1], [0.0]
        paths: list[Path] = [()]  # each node's tokens below the root (what `allowed` reads)
        kept = [0]  # children kept per node
        # Heap entries: (-path prob, tie-break, parent node, depth, rank, parent path prob).
        heap: list[tuple[float, int, int, int, int, float]] = []
        counter = 0

        def push(parent: int, d: int, rank: int, parent_prob: float) -> None:
            nonlocal counter
            if d > depth or rank >= len(values[d - 1]) or kept[parent] >= self.max_width:
                return
            prob = parent_prob * values[d - 1][rank]
            if prob <= 0.0 or prob < self.min_prob:
                return
            counter += 1
            heapq.heappush(heap, (-prob, counter, parent, d, rank, parent_prob))

        push(0, 1, 0, 1.0)
        while heap and len(out_tokens) - 1 < self.budget:
            neg, _, parent, d, rank, parent_prob = heapq.heappop(heap)
            token = tokens[d - 1][rank]
            if allowed is not None and not allowed(paths[parent], token):
                push(parent, d, rank + 1, parent_prob)  # the next-ranked token in its place
                continue
            node = len(out_tokens)
            out_tokens.append(token)
            parents.append(parent)
            log_joint.append(math.log(-neg))
            paths.append(paths[parent] + (token,))
            kept.append(0)
            kept[parent] += 1
            push(node, d + 1, 0, -neg)  # first child
            push(parent, d, rank + 1, parent_prob)  # next sibling
        return TokenTree.build(out_tokens, parents, ChildDraw.TOP_K, log_joint)

    def _static(self, root_token, values, tokens, depth, allowed: Allowed | None) -> TokenTree:
        out_tokens, parents, log_joint = [root_token], [-1], [0.0]
        node_of: dict[Path, int] = {(): 0}
        below: dict[int, Path] = {0: ()}  # node -> its tokens below the root
        for path in sorted(self.paths, key=lambda p: (len(p), p)):
            d, rank = len(path), path[-1]
            parent = node_of.get(path[:-1])
            if d > depth or parent is None or rank >= len(values[d - 1]) or values[d - 1][rank] <= 0.0:
                continue  # beyond the drafter's positions, or a zero-probability (warped away) token
            if allowed is not None and not allowed(below[parent], tokens[d - 1][rank]):
                continue  # refused by the grammar there: the node and its subtree are left out
            node_of[path] = len(out_tokens)
            below[node_of[path]] = below[parent] + (tokens[d - 1][rank],)
            out_tokens.append(tokens[d - 1][rank])
            parents.append(parent)
            log_joint.append(log_joint[parent] + math.log(values[d - 1][rank]))
        return TokenTree.build(out_tokens, parents, ChildDraw.TOP_K, log_joint)


def search_for_config(config: TreeConfig, positions: int) -> ParallelTreeSearch:
    """The parallel tree for a TreeConfig, over `positions` (= k+1) distributions: "static", "chain", "c2t_chain"
    and "dyspec_threshold" shaped by their builders' settings; every other method the best-first tree."""
    method = config.parsed_method
    # The parallel drafter drafts no copies from the context (a Serve config refuses "<builder>+lookup" with it): a
    # request naming such a method gets the best-first tree, whatever its builder.
    settings = None if method.copies or method.builder not in _OWN_SHAPES else config.settings
    if isinstance(settings, StaticSettings):
        paths = settings.static_paths if settings.static_paths is not None else \
            named_tree(settings.static_tree, settings.depth)
        paths = tuple(tuple(int(r) for r in p) for p in paths if len(p) <= positions)
        if not paths:
            raise ValueError("static tree has no path within the parallel drafter's positions")
        return ParallelTreeSearch(budget=len(paths), max_depth=positions, paths=paths)
    if isinstance(settings, ChainSettings):
        length = min(settings.depth, positions)
        return ParallelTreeSearch(budget=length, max_depth=length, max_width=1)
    if isinstance(settings, C2TChainSettings):  # a chain with early exit: stop where the joint probability < 0.1
        length = min(settings.depth, positions)
        return ParallelTreeSearch(budget=length, max_depth=length, max_width=1, min_prob=0.1)
    if isinstance(settings, DySpecThresholdSettings):
        return ParallelTreeSearch(budget=settings.budget, max_depth=_cap(settings.max_depth, positions),
                                  min_prob=settings.threshold)
    # The best-first tree stands in for eagle2, dyspec, opt_tree and c2t (and every "+lookup" method), read from
    # TreeConfig itself: its cap is `max_depth` for all of them, though eagle2's and c2t's builders ignore it and
    # are bounded by `depth` (engine/tree_settings.py); capping by depth would change their parallel trees.
    return ParallelTreeSearch(budget=config.budget, max_depth=_cap(config.max_depth, positions))


# The methods the parallel drafter shapes as their builders do (from their settings), not best-first.
_OWN_SHAPES = ("static", "chain", "c2t_chain", "dyspec_threshold")


def _cap(max_depth: int | None, positions: int) -> int:
    return positions if max_depth is None else min(positions, max_depth)
