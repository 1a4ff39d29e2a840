"""OPT-Tree (Wang et al.), Algorithm 1: grow the draft tree layer by layer, each layer being the n
children of the previous layer with the largest p-hat (eq. 2: product of q along the path), while
the best achievable E(A) keeps growing by more than delta; then keep the n best nodes.

E_sub(T, n) = max E(A) over sub-trees of T with n nodes containing the root = the sum of the n
largest p-hat in T (Theorem 3.1 makes the n largest an ancestor-closed set). Theorem 3.2: E_sub is
non-decreasing over drafting steps (a new layer only adds candidates). `build_with_trace` returns
the E_sub sequence so that property can be checked.

Children are deterministic top picks of q: ChildDraw.TOP_K (point-mass verification).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..requests import SamplingParams
from ..tree import TokenTree
from ..tree_settings import check_non_negative, check_positive
from .base import DraftOracle, PartialTree


@dataclass
class OptTreeBuilder:
    size_field: ClassVar[str | None] = "budget"

    budget: int = 60  # n: draft nodes per layer and in the final tree
    delta: float = 0.2  # stop when E_sub grows by delta or less (paper: between mu and 1)
    max_depth: int | None = None  # D(T) < n in the paper; an extra cap on drafter calls

    def __post_init__(self) -> None:
        check_positive("budget", self.budget)
        check_positive("max_depth", self.max_depth, allow_none=True)
        check_non_negative("delta", self.delta)

    def build(self, root_token: int, oracle: DraftOracle, sampling: SamplingParams, generator: torch.Generator) -> TokenTree:
        return self.build_with_trace(root_token, oracle, sampling, generator)[0]

    def build_with_trace(
        self, root_token: int, oracle: DraftOracle, sampling: SamplingParams, generator: torch.Generator
    ) -> tuple[TokenTree, list[float]]:
        """The tree and E_sub(T, n) after every drafting step."""
        n = self.budget
        max_depth = n if self.max_depth is None else min(self.max_depth, n)
        tree = PartialTree(root_token, oracle)
        # Per layer in numpy (a layer is up to n children; per-child Python work would dominate).
        phat: list[np.ndarray] = []  # p-hat of every draft node by layer, in node order
        best_n = np.empty(0)  # the n largest p-hat so far, unordered
        frontier, scale = [0], np.ones(1)  # the last layer and its p-hat
        e_prev, trace = 0.0, []
        for _ in range(max_depth):
            parents, tokens, q, layer_phat = self._layer(tree, frontier, scale, n)
            if not len(tokens):
                trace.append(e_prev)
                break
            # Every node is ChildDraw.TOP_K, PartialTree's default for new nodes and the root: no set_draw.
            first = tree.extend(parents.tolist(), tokens.tolist(), np.log(q).tolist())
            phat.append(layer_phat)
            pool = np.concatenate([best_n, layer_phat])
            if len(pool) > n:  # in place (the array methods skip numpy's function dispatch): pool is a fresh copy
                pool.partition(len(pool) - n)
                pool = pool[len(pool) - n:]
            best_n = pool
            # E_sub: the sum of the n largest p-hat so far. fsum is exactly rounded, so the same set gives
            # the same sum in any order, and a larger set never a smaller one (Theorem 3.2 holds exactly).
            e_sub = math.fsum(best_n.tolist())
            trace.append(e_sub)
            if e_sub - e_prev <= self.delta:
                break
            e_prev, frontier, scale = e_sub, list(range(first, len(tree))), layer_phat
        # The n best by p-hat, ties to the earlier node (a parent before its children): a stable sort.
        ranked = (np.argsort(-np.concatenate(phat or [np.empty(0)]), kind="stable") + 1).tolist()
        return tree.finish(keep=ranked[:n]), trace

    @staticmethod
    def _layer(tree: PartialTree, frontier: list[int], scale: np.ndarray,
               n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The next layer: the n children of `frontier` (consecutive node ids) with the largest p-hat =
        scale[r] * q_r[v] (fewer if fewer have q > 0), as (parent, token, q, p-hat) arrays, siblings consecutive
        in frontier order and each family by descending q. Exact, from top-k summaries instead of the rows
        themselves.

        Start from each row's top min(n, 64): no row can hold more than n members, so for n <= 64
        one summary is exact. For larger n, theta = the n-th best scaled value listed so far is a lower
        bound of the layer's true n-th value, so a row whose smallest listed scaled value does not
        beat theta holds no further member of the top n. Only rows that still could are summarised
        again, 4x wider (the oracle keeps their rows: no new drafter forward). Most rows of a layer
        give a child or two; a few high-p-hat rows give many. Summaries cost the oracle next to
        nothing more at 64 than at 16 (one pass over the row either way). numpy on these [R, 64]
        arrays, in as few calls as possible: this runs right after a drafter forward, when each
        numpy or torch call costs ~10 us (cold caches), several times its warm cost."""
        vocab = tree.oracle.vocab_size
        top = tree.top(frontier, min(64, n, vocab))
        vals, toks = top.values.numpy(), top.tokens.numpy()  # [R, k], each row descending
        while True:
            width = vals.shape[1]
            scaled = (vals * scale[:, None]).ravel()
            m = min(n, int(np.count_nonzero(scaled)))  # children need q > 0: the m largest are all positive
            best = scaled.argpartition(scaled.size - m)[scaled.size - m:] if m else np.empty(0, np.int64)
            if width >= min(n, vocab):
                break
            theta = scaled[best].min() if m == n else 0.0
            need = np.nonzero(scaled.reshape(-1, width)[:, -1] > theta)[0]
            if not len(need):
                break
            wider = tree.top([frontier[r] for r in need.tolist()], min(vocab, 4 * width))
            grow = wider.values.shape[1] - width
            vals = np.pad(vals, ((0, 0), (0, grow)))  # zeros: never a child (q > 0 is required)
            toks = np.pad(toks, ((0, 0), (0, grow)))
            vals[need], toks[need] = wider.values.numpy(), wider.tokens.numpy()
        best.sort()  # flat index = row * width + rank: parents in frontier order, siblings by rank
        # The frontier is a run of consecutive node ids (the root, then the previous layer): parent ids by
        # arithmetic, not a gather from the list (which numpy would convert first).
        return frontier[0] + best // width, toks.ravel()[best], vals.ravel()[best], scaled[best]
