"""C2T tree construction (Huo et al., section 4.2): layer-wise pre-pruning with a classifier.

At each layer, every frontier node proposes its top-K tokens (the first use of Top-K: only those
are scored, section 4.2.2 item 1); each candidate gets features [joint probability, top-1000
entropy of the frontier node's distribution, depth] and a classifier confidence; candidates with
confidence >= beta survive (first pruning, 4.2.1); of those, at most K with the highest confidence
are kept (second pruning, 4.2.2 item 2). Kept candidates are both verified and expanded next
layer. Growth stops at `max_depth`, when no candidate survives, or at `budget` draft nodes.

Children are deterministic (top-K of q filtered by a deterministic classifier): ChildDraw.TOP_K,
point-mass verification.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..c2t_classifier import C2TClassifier
from ..requests import SamplingParams
from ..tree import TokenTree
from ..tree_settings import check_open_unit, check_positive
from .base import DraftOracle, PartialTree


@dataclass
class C2TBuilder:
    size_field: ClassVar[str | None] = "budget"

    classifier: C2TClassifier
    beta: float = 0.5  # confidence threshold
    top_k: int = 15  # K for both uses of Top-K (paper default 15)
    max_depth: int = 10
    budget: int = 64  # cap on draft nodes

    def __post_init__(self) -> None:
        check_open_unit("beta", self.beta)
        check_positive("top_k", self.top_k)
        check_positive("max_depth", self.max_depth)
        check_positive("budget", self.budget)

    def build(self, root_token: int, oracle: DraftOracle, sampling: SamplingParams, generator: torch.Generator) -> TokenTree:
        tree = PartialTree(root_token, oracle)
        frontier = [0]
        for depth in range(1, self.max_depth + 1):
            room = self.budget - (len(tree) - 1)
            if not frontier or room <= 0:
                break
            top = tree.top(frontier, self.top_k, entropy=True)
            probs, tokens = top.values.numpy(), top.tokens.numpy()  # [F, K]
            width = probs.shape[1]
            # numpy for the layer's few dozen candidates (features as `c2t_features`: float32).
            parent_joint = np.exp(np.array([tree.log_joint[f] for f in frontier])).astype(np.float32)
            joint = (parent_joint[:, None] * probs).ravel()
            conf = self.classifier.confidence_numpy(joint, np.repeat(top.entropy.numpy(), width), float(depth))
            conf[probs.ravel() <= 0] = 0.0
            passing = np.nonzero(conf >= self.beta)[0]
            if not len(passing):
                break
            keep = min(self.top_k, room, len(passing))
            # flat index = frontier slot * K + rank: sorted, parents in order and siblings by rank
            chosen = np.sort(passing[np.argsort(-conf[passing], kind="stable")[:keep]])
            # The layer in one extend. Every node is ChildDraw.TOP_K, PartialTree's default for new nodes and
            # the root: no set_draw. The frontier is a run of consecutive node ids (the root, then the last layer).
            log_q = list(map(math.log, probs.ravel()[chosen].tolist()))
            first = tree.extend((frontier[0] + chosen // width).tolist(), tokens.ravel()[chosen].tolist(), log_q)
            frontier = list(range(first, len(tree)))
        return tree.finish()
