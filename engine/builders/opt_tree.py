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

import torch
from torch import Tensor

from treeserve.engine.builders.base import DraftOracle, PartialTree, check_positive
from treeserve.engine.sampling import BLOCK, SamplingParams, _blocked, global_topk
from treeserve.engine.tree import ChildDraw, TokenTree


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
        p_hat: list[float] = []  # p-hat of every draft node, to evaluate E_sub
        frontier, e_prev, trace = [0], 0.0, []
        for _ in range(max_depth):
            rows = tree.query(frontier)
            scale = [math.exp(tree.log_joint[f]) for f in frontier]
            values, row_idx, tokens, q = self._layer_topk(rows, scale, n)
            order = sorted(range(len(values)), key=lambda i: (row_idx[i], -values[i]))
            new_layer = []
            for i in order:
                if q[i] <= 0.0:
                    continue
                parent = frontier[row_idx[i]]
                tree.set_draw(parent, ChildDraw.TOP_K)
                child = tree.add(parent, tokens[i], math.log(q[i]))
                new_layer.append(child)
                p_hat.append(math.exp(tree.log_joint[child]))
            e_sub = sum(sorted(p_hat, reverse=True)[:n])
            trace.append(e_sub)
            if not new_layer or e_sub - e_prev <= self.delta:
                break
            e_prev, frontier = e_sub, new_layer
        ranked = sorted(range(1, len(tree)), key=lambda i: (-tree.log_joint[i], i))
        return tree.finish(keep=ranked[:n]), trace

    @staticmethod
    def _layer_topk(rows: Tensor, scale: list[float], n: int) -> tuple[list[float], list[int], list[int], list[float]]:
        """The n largest scale[r] * rows[r, v] as Python lists (values, row index, token, and the
        unscaled q = rows[r, v]).

        One block-maximum pass over the layer's rows, no copy of them (`global_topk`). Skipping
        rows by a running bound does not pay: a layer of n nodes needs n children, which reach deep
        into the rows' tails, so the bound stays too low to skip anything (measured: 35-47 of 64
        rows contribute per layer; on the benchmark rows 400 of the 449 rows of a budget-64,
        depth-8 build have a scale >= the layer's final n-th value, so exactness requires reading
        them). This one pass is therefore the floor of OPT-Tree's CPU cost: ~25-35 us per
        49k-token row on one core, memory-bound (a strided column maximum measured the same)."""
        row_scale = torch.tensor(scale, dtype=rows.dtype)
        blocks = _blocked(rows)
        if blocks is None:
            values, row_t, token_t = global_topk(rows, row_scale, n)
            row_idx, tokens = row_t.tolist(), token_t.tolist()
            q = rows[row_t, token_t].tolist()
            return values.tolist(), row_idx, tokens, q
        # global_topk's blocked path, with the unscaled candidates kept to read q without
        # indexing the rows again and the token ids computed in Python.
        num_rows, nb = blocks.shape[0], blocks.shape[1]
        n = min(n, num_rows * rows.shape[1])
        block_max = blocks.amax(dim=2) * row_scale[:, None]  # [R, nb]
        best = block_max.reshape(-1).topk(min(n, num_rows * nb)).indices  # flat (row, block)
        row_of = best // nb
        raw = blocks[row_of, best % nb]  # [n, BLOCK] unscaled
        values, pos = (raw * row_scale[row_of, None]).reshape(-1).topk(n)
        q = raw.reshape(-1)[pos].tolist()
        best_l, pos_l = best.tolist(), pos.tolist()
        cand = [best_l[p // BLOCK] for p in pos_l]
        row_idx = [c // nb for c in cand]
        tokens = [(c % nb) * BLOCK + p % BLOCK for c, p in zip(cand, pos_l)]
        return values.tolist(), row_idx, tokens, q
