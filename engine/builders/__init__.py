"""Tree builders and the registry that makes one from a `TreeConfig`: a table from its builder's settings
(`TreeConfig.settings`, engine/tree_settings.py) to the builder.

Budget always counts DRAFT nodes (the root, i.e. the last emitted token, excluded).
"""

from __future__ import annotations

from typing import Callable

from ..c2t_classifier import C2TClassifier
from ..lookup.trees import LookupTreeBuilder
from ..tree_config import TreeConfig
from ..tree_settings import (BuilderSettings, C2TChainSettings, C2TSettings, ChainSettings, DySpecSettings,
                             DySpecThresholdSettings, Eagle2Settings, LookupTreeSettings, OptTreeSettings,
                             StaticSettings)
from .base import DraftOracle, PartialTree, TreeBuilder
from .c2t import C2TBuilder
from .chain import C2TChainBuilder, ChainBuilder
from .dyspec import DySpecBuilder, DySpecThresholdBuilder
from .eagle2 import Eagle2Builder
from .opt_tree import OptTreeBuilder
from .static import StaticTreeBuilder, binary_tree, named_tree, sequoia_tree


def _classifier(path: str | None, default: C2TClassifier | None) -> C2TClassifier:
    if path:
        return C2TClassifier.load(path)
    return default or C2TClassifier.joint_prob_prior()


def _lookup(s: LookupTreeSettings, classifier: C2TClassifier | None) -> TreeBuilder:
    return LookupTreeBuilder(budget=s.budget)


def _chain(s: ChainSettings, classifier: C2TClassifier | None) -> TreeBuilder:
    return ChainBuilder(length=s.depth, sampled=s.chain_sampled)


def _static(s: StaticSettings, classifier: C2TClassifier | None) -> TreeBuilder:
    if s.static_paths is not None:
        paths = s.static_paths
    elif s.static_tree == "sequoia":
        paths = sequoia_tree(s.acceptance_by_rank, s.budget, s.depth)
    else:
        paths = named_tree(s.static_tree, s.depth)
    return StaticTreeBuilder(paths=tuple(paths))


def _eagle2(s: Eagle2Settings, classifier: C2TClassifier | None) -> TreeBuilder:
    return Eagle2Builder(budget=s.budget, depth=s.depth, top_k=s.top_k, rerank=s.rerank)


def _dyspec(s: DySpecSettings, classifier: C2TClassifier | None) -> TreeBuilder:
    return DySpecBuilder(budget=s.budget, max_depth=s.max_depth, prefetch=s.prefetch)


def _dyspec_threshold(s: DySpecThresholdSettings, classifier: C2TClassifier | None) -> TreeBuilder:
    return DySpecThresholdBuilder(threshold=s.threshold, budget=s.budget, max_depth=s.max_depth)


def _opt_tree(s: OptTreeSettings, classifier: C2TClassifier | None) -> TreeBuilder:
    return OptTreeBuilder(budget=s.budget, delta=s.delta, max_depth=s.max_depth)


def _c2t(s: C2TSettings, classifier: C2TClassifier | None) -> TreeBuilder:
    chosen = _classifier(s.c2t_classifier_path, classifier)
    return C2TBuilder(chosen, beta=chosen.beta if s.beta is None else s.beta, top_k=s.top_k, max_depth=s.depth,
                      budget=s.budget)


def _c2t_chain(s: C2TChainSettings, classifier: C2TClassifier | None) -> TreeBuilder:
    chosen = _classifier(s.c2t_classifier_path, classifier)
    return C2TChainBuilder(chosen, max_length=s.depth, beta=chosen.beta if s.beta is None else s.beta)


# A builder's settings type -> its builder, given the drafter's own C2T classifier.
_BUILDERS: dict[type, Callable[..., TreeBuilder]] = {
    LookupTreeSettings: _lookup, ChainSettings: _chain, StaticSettings: _static, Eagle2Settings: _eagle2,
    DySpecSettings: _dyspec, DySpecThresholdSettings: _dyspec_threshold, OptTreeSettings: _opt_tree,
    C2TSettings: _c2t, C2TChainSettings: _c2t_chain,
}


def make_builder(config: TreeConfig, classifier: C2TClassifier | None = None) -> TreeBuilder:
    """The builder for `config.method`, from its settings; invalid parameters raise ValueError naming the field
    (`TreeConfig.settings`). `classifier`: the C2T classifier when the config names no file (the drafter's own)."""
    settings: BuilderSettings = config.settings
    return _BUILDERS[type(settings)](settings, classifier)


__all__ = [
    "make_builder", "DraftOracle", "TreeBuilder", "PartialTree", "ChainBuilder", "C2TChainBuilder",
    "StaticTreeBuilder", "Eagle2Builder", "DySpecBuilder", "DySpecThresholdBuilder", "OptTreeBuilder", "C2TBuilder",
    "binary_tree", "named_tree", "sequoia_tree",
]
