"""EAGLE-2 dynamic trees (Li et al. 2024, as summarised in C2T section 2.2): expand, then rerank.

Expand: the root's top-k tokens form layer 1; at every later step the k nodes of the newest layer
with the largest joint probability are expanded, each into its own top-k tokens, for `depth` layers
(one oracle call per layer). Rerank: all drafted nodes are ranked by joint probability and the best
`budget` are kept; a child's joint probability never exceeds its parent's, so the kept set is a
tree (ties broken by node index, parents first). `rerank=False` keeps the full expanded tree
(C2T trains its classifier on those).

Children are deterministic top-k picks of q: ChildDraw.TOP_K, point-mass verification.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..requests import SamplingParams
from ..tree import TokenTree
from ..tree_settings import check_positive
from .base import DraftOracle, PartialTree


@dataclass
class Eagle2Builder:
    size_field: ClassVar[str | None] = "budget"

    budget: int = 60  # N: draft nodes kept by the rerank
    depth: int = 6  # expansion rounds
    top_k: int = 10  # K: children per expanded node and nodes expanded per layer
    rerank: bool = True

    def __post_init__(self) -> None:
        check_positive("budget", self.budget)
        check_positive("depth", self.depth)
        check_positive("top_k", self.top_k)

    def build(self, root_token: int, oracle: DraftOracle, sampling: SamplingParams, generator: torch.Generator) -> TokenTree:
        tree = PartialTree(root_token, oracle)
        expand = [0]
        # The rerank keeps no node deeper than `budget` (each of its ancestors ranks before it), so those
        # layers would cost drafter calls for nothing: a budget-1 tree is one call, whatever the depth.
        rounds = min(self.depth, self.budget) if self.rerank else self.depth
        for _ in range(rounds):
            # A layer at a time in numpy (up to K x K candidates; per-node Python work dominated the build).
            # Every node is ChildDraw.TOP_K, PartialTree's default for new nodes and the root: no set_draw.
            top = tree.top(expand, self.top_k)
            values = top.values.numpy()  # [F, K], each row descending: its positive entries are a prefix
            kept = (values > 0.0).ravel()
            parents = np.repeat(np.asarray(expand), values.shape[1])[kept]
            # math.log, not np.log: numpy's SIMD log differs from it in the last bit on ~0.3% of inputs, and
            # the ranks below compare these sums.
            log_q = list(map(math.log, values.ravel()[kept].tolist()))
            first = tree.extend(parents.tolist(), top.tokens.numpy().ravel()[kept].tolist(), log_q)
            if first == len(tree):
                break
            # The K best of the layer by joint probability, ties to the earlier node (a stable sort).
            order = np.argsort(np.negative(tree.log_joint[first:]), kind="stable")[: self.top_k]
            expand = (order + first).tolist()
        if not self.rerank or len(tree) - 1 <= self.budget:
            return tree.finish()
        ranked = np.argsort(np.negative(tree.log_joint[1:]), kind="stable")[: self.budget] + 1
        return tree.finish(keep=ranked.tolist())
