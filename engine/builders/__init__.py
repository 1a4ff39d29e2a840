"""Tree builders and the registry that makes one from a `TreeConfig`.

Budget always counts DRAFT nodes (the root, i.e. the last emitted token, excluded).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from treeserve.engine.builders.base import DraftOracle, PartialTree, TreeBuilder
from treeserve.engine.builders.c2t import C2TBuilder
from treeserve.engine.builders.chain import C2TChainBuilder, ChainBuilder
from treeserve.engine.builders.dyspec import DySpecBuilder, DySpecThresholdBuilder
from treeserve.engine.builders.eagle2 import Eagle2Builder
from treeserve.engine.builders.opt_tree import OptTreeBuilder
from treeserve.engine.builders.static import StaticTreeBuilder, binary_tree, named_tree, sequoia_tree
from treeserve.engine.c2t_classifier import C2TClassifier
from treeserve.engine.methods import (  # the names of every tree method (torch-free, engine/methods.py)
    BUILDERS,
    DEFAULT_METHOD,
    HYBRID_BUILDERS,
    LOOKUP,
    LOOKUP_SUFFIX,
    METHODS,
    split_method,
    uses_lookup,
)


@dataclass
class TreeConfig:
    """How the drafter shapes its tree; validated by `make_builder`."""

    method: str = field(default=DEFAULT_METHOD, metadata={"help": f"tree method, one of {', '.join(METHODS)}"})
    budget: int = field(default=64, metadata={"help": "draft nodes per tree (root excluded); cap for threshold methods"})
    budget_auto: bool = field(default=False, metadata={"help": "the drafter's hardware-aware chooser picks each step's budget (if it has one); False: `budget` is fixed"})
    depth: int = field(default=6, metadata={"help": "chain length / EAGLE-2 expansion rounds / max depth for c2t(_chain), binary static tree"})
    top_k: int = field(default=10, metadata={"help": "EAGLE-2 K (children per node, nodes expanded per layer); C2T K for both Top-K uses"})
    threshold: float = field(default=0.05, metadata={"help": "dyspec_threshold: expand while a position's reach probability exceeds this, in (0, 1)"})
    delta: float = field(default=0.2, metadata={"help": "opt_tree: stop when E_sub grows by at most delta (>= 0; paper: between mu and 1)"})
    beta: float | None = field(default=None, metadata={"help": "c2t / c2t_chain: classifier confidence threshold, in (0, 1); None uses the classifier's own (C2TClassifier.beta)"})
    prefetch: int = field(default=16, metadata={"help": "dyspec: draft rows fetched per drafter call (T > 0: the popped node + best unfetched heap nodes; T = 0: the best unfetched candidates)"})
    max_depth: int | None = field(default=None, metadata={"help": "optional depth cap for dyspec, dyspec_threshold and opt_tree"})
    chain_sampled: bool = field(default=True, metadata={"help": "chain at temperature > 0: sample tokens (SpS) instead of deterministic top-1"})
    rerank: bool = field(default=True, metadata={"help": "eagle2: keep the `budget` best nodes; False keeps the whole expanded tree"})
    static_tree: str = field(default="mc_sim_7b_63", metadata={"help": "static: 'mc_sim_7b_63', 'eagle1_25', 'binary' (uses depth) or 'sequoia'"})
    static_paths: tuple[tuple[int, ...], ...] | None = field(default=None, metadata={"help": "static: explicit rank paths; overrides static_tree"})
    acceptance_by_rank: tuple[float, ...] | None = field(default=None, metadata={"help": "static_tree='sequoia': measured acceptance probability of the r-th ranked child"})
    c2t_classifier_path: str | None = field(default=None, metadata={"help": "c2t / c2t_chain: safetensors weights; None uses the drafter's own classifier (make_builder's `classifier`), else a joint-probability prior"})


def _classifier(config: TreeConfig, default: C2TClassifier | None) -> C2TClassifier:
    if config.c2t_classifier_path:
        return C2TClassifier.load(config.c2t_classifier_path)
    return default or C2TClassifier.joint_prob_prior()


def make_builder(config: TreeConfig, classifier: C2TClassifier | None = None) -> TreeBuilder:
    """The builder for `config.method`; invalid parameters raise ValueError naming the field. `classifier`:
    the C2T classifier when the config names no file (the drafter's own)."""
    method, lookup = split_method(config.method)
    if lookup and method != LOOKUP and method not in HYBRID_BUILDERS:
        raise ValueError(f"method must be one of {METHODS}, got {config.method!r}")
    if method == LOOKUP:
        from treeserve.engine.lookup import LookupTreeBuilder

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
    "METHODS", "BUILDERS", "LOOKUP", "LOOKUP_SUFFIX", "HYBRID_BUILDERS", "DEFAULT_METHOD", "split_method",
    "uses_lookup", "TreeConfig", "make_builder", "DraftOracle", "TreeBuilder", "PartialTree",
    "ChainBuilder", "C2TChainBuilder", "StaticTreeBuilder", "Eagle2Builder", "DySpecBuilder",
    "DySpecThresholdBuilder", "OptTreeBuilder", "C2TBuilder", "binary_tree", "named_tree", "sequoia_tree",
]
