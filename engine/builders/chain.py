"""Chain drafts: vanilla speculative sampling (Leviathan et al. 2023; Chen et al. 2023), and the
C2T chain with classifier early exit used for batch > 1 (C2T section 5.5, docs/design.md section 6).

How children are drawn (and hence the verification rule):
- temperature 0: argmax of q at every step -> ChildDraw.GREEDY (target-argmax matching).
- temperature > 0, `sampled=True` (SpS): each token sampled from q -> ChildDraw.WITHOUT_REPLACEMENT
  with one child per node, whose rule is min(1, p/q) with residual norm(max(p - q, 0)).
- temperature > 0, `sampled=False`: deterministic top-1 of q -> ChildDraw.TOP_K (point-mass rule).
The C2T chain is always deterministic top-1: its early exit looks at the chosen token's joint
probability, and stopping on a *sampled* token's value would bias which samples survive.

Over a hybrid oracle (engine/lookup/) the deterministic chains follow the top-1 of the merged rows. The
sampled chain follows a node's best lookup candidate (its `LookupSource`; deterministic, point-mass rule)
wherever it is at least as probable as everything the model could offer there (c >= 1 - w), or the model has
no row there, and samples from the model's row elsewhere: the choice depends on the root path only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..c2t_classifier import C2TClassifier, c2t_features
from ..requests import SamplingParams
from ..tree import ChildDraw, TokenTree
from ..tree_settings import check_open_unit, check_positive
from .base import DraftOracle, PartialTree, safe_log


@dataclass
class ChainBuilder:
    """Fixed-length chain of `length` draft tokens, one oracle call per token."""

    size_field: ClassVar[str | None] = "length"

    length: int = 5
    sampled: bool = True  # at temperature > 0: sample (SpS) rather than take the top-1 token

    def __post_init__(self) -> None:
        check_positive("length", self.length)

    def build(self, root_token: int, oracle: DraftOracle, sampling: SamplingParams, generator: torch.Generator) -> TokenTree:
        tree = PartialTree(root_token, oracle)
        if self.sampled and not sampling.is_greedy:
            return self._sampled(tree, generator)
        draw = ChildDraw.GREEDY if sampling.is_greedy else ChildDraw.TOP_K
        node = 0
        for _ in range(self.length):
            top = tree.top([node], 1)
            token, prob = int(top.tokens[0, 0]), float(top.values[0, 0])
            if prob <= 0.0:
                break
            tree.set_draw(node, draw)
            node = tree.add(node, token, safe_log(prob))
        return tree.finish()

    def _sampled(self, tree: PartialTree, generator: torch.Generator) -> TokenTree:
        """SpS: one token sampled per node. Over a lookup source a node's best candidate is taken instead where
        the module docstring says (deterministic, point-mass rule), and a node without a model row ends it."""
        lookup = tree.lookup
        node: int | None = 0
        for uniform in torch.rand(self.length, generator=generator, dtype=torch.float64).tolist():
            if lookup is not None:
                row = tree.candidates(node)
                backed = tree.model_backed(node)
                if row is not None and (not backed or row.values[0] >= 1.0 - row.total):
                    node = tree.add_copy(node, row.tokens[0], row.values[0])
                    continue
                if not backed:
                    break
            node = tree.add_sampled_child(node, uniform)
            if node is None:
                break
        return tree.finish()


@dataclass
class C2TChainBuilder:
    """Top-1 chain that stops before the first token whose C2T confidence is below `beta`."""

    size_field: ClassVar[str | None] = None

    classifier: C2TClassifier
    max_length: int = 8
    beta: float = 0.5

    def __post_init__(self) -> None:
        check_positive("max_length", self.max_length)
        check_open_unit("beta", self.beta)

    def build(self, root_token: int, oracle: DraftOracle, sampling: SamplingParams, generator: torch.Generator) -> TokenTree:
        tree = PartialTree(root_token, oracle)
        draw = ChildDraw.GREEDY if sampling.is_greedy else ChildDraw.TOP_K
        node = 0
        for depth in range(1, self.max_length + 1):
            top = tree.top([node], 1, entropy=True)
            prob, token = top.values[0, 0], top.tokens[0, 0]
            joint = torch.tensor([tree.log_joint[node]]).exp() * prob
            feats = c2t_features(joint, top.entropy, torch.tensor([float(depth)]))
            if float(self.classifier.confidence(feats)[0]) < self.beta:
                break
            tree.set_draw(node, draw)
            node = tree.add(node, int(token), safe_log(float(prob)))
        return tree.finish()
