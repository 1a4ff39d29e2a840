"""Tree builders and the registry that makes one from a `TreeConfig`.

Budget always counts DRAFT nodes (the root, i.e. the last emitted token, excluded).
"""

from __future__ import annotations

from ..c2t_classifier import C2TClassifier
from ..lookup.trees import LookupTreeBuilder
from ..methods import HYBRID_BUILDERS, LOOKUP, METHODS
from ..tree_config import TreeConfig
from .base import DraftOracle, PartialTree, TreeBuilder
from .c2t import C2TBuilder
from .chain import C2TChainBuilder, ChainBuilder
from .dyspec import DySpecBuilder, DySpecThresholdBuilder
from .eagle2 import Eagle2Builder
from .opt_tree import OptTreeBuilder
from .static import StaticTreeBuilder, binary_tree, named_tree, sequoia_tree


def _classifier(config: TreeConfig, default: C2TClassifier | None) -> C2TClassifier:
    if config.c2t_classifier_path:
        return C2TClassifier.load(config.c2t_classifier_path)
    return default or C2TClassifier.joint_prob_prior()


def make_builder(config: TreeConfig, classifier: C2TClassifier | None = None) -> TreeBuilder:
    """The builder for `config.method`; invalid parameters raise ValueError naming the field. `classifier`:
    the C2T classifier when the config names no file (the drafter's own)."""
    method, lookup = config.parsed_method.builder, config.parsed_method.copies
    if lookup and method != LOOKUP and method not in HYBRID_BUILDERS:
        raise ValueError(f"method must be one of {METHODS}, got {config.method!r}")
    if method == LOOKUP:
        return LookupTreeBuilder(budget=config.budget)
    if method == "chain":
        return ChainBuilder(length=config.depth, sampled=config.chain_sampled)
    if method == "static":
        if config.static_paths is not None:
            paths = config.static_paths
        elif config.static_tree == "sequoia":
            if config.acceptance_by_rank is None:
                raise ValueError("acceptance_by_rank is required for static_tree='sequoia'")
            paths = sequoia_tree(config.acceptance_by_rank, config.budget, config.depth)
        else:
            paths = named_tree(config.static_tree, config.depth)
        return StaticTreeBuilder(paths=tuple(paths))
    if method == "eagle2":
        return Eagle2Builder(budget=config.budget, depth=config.depth, top_k=config.top_k, rerank=config.rerank)
    if method == "dyspec":
        return DySpecBuilder(budget=config.budget, max_depth=config.max_depth, prefetch=config.prefetch)
    if method == "dyspec_threshold":
        return DySpecThresholdBuilder(threshold=config.threshold, budget=config.budget, max_depth=config.max_depth)
    if method == "opt_tree":
        return OptTreeBuilder(budget=config.budget, delta=config.delta, max_depth=config.max_depth)
    if method == "c2t":
        chosen = _classifier(config, classifier)
        return C2TBuilder(chosen, beta=chosen.beta if config.beta is None else config.beta, top_k=config.top_k,
                          max_depth=config.depth, budget=config.budget)
    if method == "c2t_chain":
        chosen = _classifier(config, classifier)
        return C2TChainBuilder(chosen, max_length=config.depth, beta=chosen.beta if config.beta is None else config.beta)
    raise ValueError(f"method must be one of {METHODS}, got {config.method!r}")


__all__ = [
    "make_builder", "DraftOracle", "TreeBuilder", "PartialTree", "ChainBuilder", "C2TChainBuilder",
    "StaticTreeBuilder", "Eagle2Builder", "DySpecBuilder", "DySpecThresholdBuilder", "OptTreeBuilder", "C2TBuilder",
    "binary_tree", "named_tree", "sequoia_tree",
]
