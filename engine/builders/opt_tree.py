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

import numpy as np
import torch

from treeserve.engine.builders.base import DraftOracle, PartialTree, check_positive
from treeserve.engine.sampling import SamplingParams
from treeserve.engine.tree import TokenTree


@dataclass
class OptTreeBuilder:
    budget: int = 60  # n: draft nodes per layer and in the final tree
    delta: float = 0.2  # stop when E_sub grows by delta or less (paper: between mu and 1)
    max_depth: int | None = None  # D(T) < n in the paper; an extra cap on drafter calls

    def __post_init__(self) -> None:
        check_positive("budget", self.budget)
        check_positive("max_depth", self.max_depth, allow_none=True)
        if not math.isfinite(self.delta) or self.delta < 0:
            raise ValueError(f"delta must be a finite number >= 0, got {self.delta}")

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
        phat = np.empty(0)  # p-hat of every draft node, in node order (node i + 1)
        frontier, scale = np.zeros(1, dtype=np.int64), np.ones(1)  # the last layer and its p-hat
        e_prev, trace = 0.0, []
        for _ in range(max_depth):
            values, rows, tokens, q = self._layer_topk(tree, frontier.tolist(), scale, n)
            # Children with q = 0 are not drafts. Siblings consecutive (by parent order), each family by
            # descending q: a stable sort by row of the value-descending list.
            keep = np.nonzero(q > 0.0)[0]
            order = keep[np.argsort(rows[keep], kind="stable")]
            if not len(order):
                trace.append(e_prev)
                break
            # Every node is ChildDraw.TOP_K, PartialTree's default for new nodes and the root: no set_draw.
            parents = frontier[rows[order]]
            first = tree.extend(parents.tolist(), tokens[order].tolist(), np.log(q[order]).tolist())
            scale = values[order]  # the new layer's p-hat
            phat = np.concatenate([phat, scale])
            # E_sub: the n largest p-hat so far (summed in sorted order: the same set gives the same sum).
            e_sub = float(np.sort(np.partition(phat, len(phat) - n)[-n:] if len(phat) > n else phat).sum())
            trace.append(e_sub)
            if e_sub - e_prev <= self.delta:
                break
            e_prev, frontier = e_sub, np.arange(first, len(tree))
        # The n best by p-hat, ties to the earlier node (a parent before its children): a stable sort.
        ranked = (np.argsort(-phat, kind="stable") + 1).tolist()
        return tree.finish(keep=ranked[:n]), trace

    @staticmethod
    def _layer_topk(tree: PartialTree, frontier: list[int], scale: np.ndarray,
                    n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The n largest p-hat = scale[r] * q_r[v] over the layer's rows (values descending, row
        index, token, unscaled q), exactly, from top-k summaries instead of the rows themselves.

        Start from each row's top min(n, 64): no row can hold more than n members, so for n <= 64
        one summary is exact. For larger n, theta = the n-th best scaled value listed so far is a lower
        bound of the layer's true n-th value, so a row whose smallest listed scaled value does not
        beat theta holds no further member of the top n. Only rows that still could are summarised
        again, 4x wider (the oracle keeps their rows: no new drafter forward). Most rows of a layer
        give a child or two; a few high-p-hat rows give many. Summaries cost the oracle next to
        nothing more at 64 than at 16 (one pass over the row either way). numpy on these [R, 16] arrays: its
        small ops cost about a microsecond, torch's several."""
        vocab = tree.oracle.vocab_size
        top = tree.top(frontier, min(64, n, vocab))
        vals, toks = top.values.numpy(), top.tokens.numpy()  # [R, k], each row descending
        row_scale = scale[:, None]
        while True:
            scaled = (vals * row_scale).ravel()
            m = min(n, scaled.size)
            best = np.argpartition(-scaled, m - 1)[:m]
            best = best[np.argsort(-scaled[best], kind="stable")]
            width = vals.shape[1]
            theta = scaled[best[-1]] if m == n else 0.0
            need = np.nonzero(scaled.reshape(-1, width)[:, -1] > theta)[0] if width < vocab else ()
            if not len(need):
                break
            wider = tree.top([frontier[r] for r in need.tolist()], min(vocab, 4 * width))
            grow = wider.values.shape[1] - width
            vals = np.pad(vals, ((0, 0), (0, grow)))  # zeros: never a child (q > 0 is required)
            toks = np.pad(toks, ((0, 0), (0, grow)))
            vals[need], toks[need] = wider.values.numpy(), wider.tokens.numpy()
        return scaled[best], best // width, toks.ravel()[best], vals.ravel()[best]
