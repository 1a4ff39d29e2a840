"""Static trees: a fixed set of rank paths filled with the drafter's top-ranked tokens
(Medusa / EAGLE-1 choices, binary trees, and Sequoia's dynamic-programming trees).

A path (r1, ..., rd) is the node reached by taking the r1-th most likely token at the root, then
the r2-th most likely after it, and so on. Children are deterministic top-k picks of q, so they
are ChildDraw.TOP_K and verified with the point-mass rule at temperature > 0.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

import torch

from ..requests import SamplingParams
from ..tree import ChildDraw, TokenTree
from ..tree_settings import check_positive
from .base import DraftOracle, PartialTree, safe_log

Path = tuple[int, ...]

# Medusa's mc_sim_7b_63 choices (63 draft nodes, depth 4), also EAGLE-1's first default tree.
MC_SIM_7B_63: tuple[Path, ...] = tuple(tuple(p) for p in [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0],
    [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0],
    [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5],
    [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9],
    [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0],
    [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
])
# EAGLE-1's released default (eagle/model/choices.py, 25 draft nodes, depth 5).
EAGLE1_25: tuple[Path, ...] = tuple(tuple(p) for p in [
    [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [0, 0, 0],
    [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0], [0, 0, 0, 0],
    [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
])


def binary_tree(depth: int) -> tuple[Path, ...]:
    """Full binary tree of the top-2 tokens at every level: 2 + 4 + ... + 2**depth draft nodes."""
    check_positive("depth", depth)
    return tuple(p for d in range(1, depth + 1) for p in itertools.product((0, 1), repeat=d))


def sequoia_tree(acceptance_by_rank: Sequence[float], budget: int, max_depth: int) -> tuple[Path, ...]:
    """Sequoia's tree by dynamic programming over measured acceptance-by-rank statistics.

    acceptance_by_rank[r] = probability that the r-th ranked draft child is the one accepted (the
    positional acceptance vector of Sequoia section 3.1). Under Sequoia's position-independence
    assumption a node's acceptance probability is the product of the rank probabilities along its
    path, and the tree with `budget` draft nodes and depth <= max_depth maximising the sum of those
    products (= expected accepted drafts) satisfies

        f(n, d)    = 1 + g(n - 1, d - 1, 0)                       (n nodes incl. root, depth <= d)
        g(m, d, r) = max_{s=1..m} p_r * f(s, d) + g(m - s, d, r + 1),   g(0, d, r) = 0

    Cost O(max_depth * ranks * budget^2) Python steps: meant for offline use (budget <= ~128).
    """
    check_positive("budget", budget)
    check_positive("max_depth", max_depth)
    probs = [float(p) for p in acceptance_by_rank]
    if not probs or any(not (0.0 <= p <= 1.0) for p in probs):
        raise ValueError("acceptance_by_rank must be a non-empty list of probabilities in [0, 1]")
    neg = float("-inf")
    size = budget + 1
    ranks = len(probs)
    # f[d][n]; g_choice[d][r][m] stores the argmax subtree size for reconstruction.
    f = [[neg] * (size + 1) for _ in range(max_depth + 1)]
    choice: list[list[list[int]]] = [[] for _ in range(max_depth + 1)]
    for d in range(max_depth + 1):
        f[d][1] = 1.0
        if d == 0:
            continue
        g = [[neg] * size for _ in range(ranks + 1)]
        pick = [[0] * size for _ in range(ranks + 1)]
        g[ranks][0] = 0.0
        for r in range(ranks - 1, -1, -1):
            g[r][0] = 0.0
            for m in range(1, size):
                best, arg = g[r + 1][m], 0  # rank r unused (then no later rank is either: p sorted)
                for s in range(1, m + 1):
                    if f[d - 1][s] == neg or g[r + 1][m - s] == neg:
                        continue
                    val = probs[r] * f[d - 1][s] + g[r + 1][m - s]
                    if val > best:
                        best, arg = val, s
                g[r][m], pick[r][m] = best, arg
        for n in range(2, size + 1):
            f[d][n] = 1.0 + g[0][n - 1]
        choice[d] = pick

    paths: list[Path] = []

    def expand(prefix: Path, n: int, d: int) -> None:
        m, r = n - 1, 0
        while m > 0 and r < ranks:
            s = choice[d][r][m]
            if s:
                paths.append(prefix + (r,))
                expand(prefix + (r,), s, d - 1)
                m -= s
            r += 1

    expand((), size, max_depth)
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


def named_tree(name: str, depth: int = 4) -> tuple[Path, ...]:
    """'mc_sim_7b_63', 'eagle1_25' or 'binary' (uses `depth`)."""
    if name == "mc_sim_7b_63":
        return MC_SIM_7B_63
    if name == "eagle1_25":
        return EAGLE1_25
    if name == "binary":
        return binary_tree(depth)
    raise ValueError(f"static_tree must be one of 'mc_sim_7b_63', 'eagle1_25', 'binary', got {name!r}")


@dataclass
class StaticTreeBuilder:
    """Fill a fixed path set with top-ranked draft tokens, one oracle call per tree level."""

    size_field: ClassVar[str | None] = None

    paths: tuple[Path, ...] = field(default=MC_SIM_7B_63)

    def __post_init__(self) -> None:
        paths = tuple(tuple(int(r) for r in p) for p in self.paths)
        if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
            raise ValueError("paths must be non-empty tuples of ranks >= 0")
        known = set(paths)
        if len(known) != len(paths) or any(p[:-1] and p[:-1] not in known for p in paths):
            raise ValueError("paths must be distinct and closed under prefixes")
        self.paths = tuple(sorted(paths, key=lambda p: (len(p), p)))

    def build(self, root_token: int, oracle: DraftOracle, sampling: SamplingParams, generator: torch.Generator) -> TokenTree:
        tree = PartialTree(root_token, oracle)
        node_of: dict[Path, int] = {(): 0}
        max_len = len(self.paths[-1])
        for depth in range(1, max_len + 1):
            layer = [p for p in self.paths if len(p) == depth]
            parents = sorted({p[:-1] for p in layer}, key=lambda p: node_of[p])
            top = tree.top([node_of[p] for p in parents], max(p[-1] for p in layer) + 1)
            values, tokens = top.values.tolist(), top.tokens.tolist()
            slot = {p: i for i, p in enumerate(parents)}
            for path in layer:
                parent = node_of[path[:-1]]
                i, rank = slot[path[:-1]], path[-1]
                tree.set_draw(parent, ChildDraw.TOP_K)
                node_of[path] = tree.add(parent, tokens[i][rank], safe_log(values[i][rank]))
        return tree.finish()
