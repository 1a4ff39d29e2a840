"""Each tree builder's own settings, typed (no torch import, as tree_config.py: the Serve config's and the wire's
processes parse them without a model).

`TreeConfig` (engine/tree_config.py) stays the external format: one flat set of fields for `build_engine`'s
options, the wire and per-request overrides, whichever method they name. A builder reads only its own fields, so each has a frozen
dataclass here holding exactly those, under TreeConfig's names; `TreeConfig.settings` parses a config into its
method's settings once, and engine/builders' `make_builder` is a table from settings type to builder. A value a
builder cannot take raises ValueError naming TreeConfig's field (the builders keep their own checks, on the same
helpers, for a builder made directly or resized by the budget chooser). No field has a default here: TreeConfig
and `tree_config` hold the defaults, once.

The parallel drafter (engine/drafters/parallel_tree_search.py) has no builders: it shapes "static", "chain",
"c2t_chain" and "dyspec_threshold" trees from these settings, and every other method's from TreeConfig's `budget`
and `max_depth` (see Eagle2Settings and C2TSettings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Union

from .methods import LOOKUP

# The named static trees (engine/builders/static.py); "sequoia" is computed from measured acceptance.
STATIC_TREES = ("mc_sim_7b_63", "eagle1_25", "binary", "sequoia")


def check_positive(name: str, value: int | None, allow_none: bool = False) -> None:
    """ValueError naming `name` unless value is an int >= 1 (or None when allowed)."""
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_open_unit(name: str, value: float) -> None:
    """ValueError naming `name` unless 0 < value < 1."""
    if not isinstance(value, (int, float)) or not (0.0 < float(value) < 1.0):
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {value!r}")


def check_non_negative(name: str, value: float) -> None:
    """ValueError naming `name` unless value is a finite number >= 0."""
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


@dataclass(frozen=True)
class LookupTreeSettings:
    """lookup: candidates copied from the request's own tokens alone (engine/lookup/trees.py). Not
    engine/lookup's `LookupSettings`, the index's settings, which the drafter holds whatever the method."""

    budget: int = field(metadata={"help": "draft nodes per tree (root excluded)"})

    def __post_init__(self) -> None:
        check_positive("budget", self.budget)


@dataclass(frozen=True)
class ChainSettings:
    """chain: one path of the drafter's top-1 tokens (sampled at temperature > 0: SpS). Its budget is its length:
    `tree_config("chain", n)` sets `depth` to n, and TreeConfig's `budget` is not read."""

    depth: int = field(metadata={"help": "the chain's length"})
    chain_sampled: bool = field(metadata={"help": "at temperature > 0: sample tokens (SpS) instead of the deterministic top-1"})

    def __post_init__(self) -> None:
        check_positive("depth (the chain's length)", self.depth)


@dataclass(frozen=True)
class StaticSettings:
    """static: a fixed set of rank paths (Medusa / EAGLE-1 choices, binary, Sequoia). `budget` and `depth` size
    only the computed trees: depth for "binary", both for "sequoia"."""

    static_tree: str = field(metadata={"help": f"the named tree, one of {', '.join(STATIC_TREES)}"})
    static_paths: tuple[tuple[int, ...], ...] | None = field(metadata={"help": "explicit rank paths; override static_tree (which is then not checked)"})
    acceptance_by_rank: tuple[float, ...] | None = field(metadata={"help": "static_tree='sequoia': measured acceptance probability of the r-th ranked child"})
    budget: int = field(metadata={"help": "static_tree='sequoia': draft nodes"})
    depth: int = field(metadata={"help": "static_tree='binary' and 'sequoia': the tree's depth"})

    def __post_init__(self) -> None:
        if self.static_paths is not None:
            return
        if self.static_tree not in STATIC_TREES:
            raise ValueError(f"static_tree must be one of {', '.join(STATIC_TREES)}, got {self.static_tree!r}")
        if self.static_tree == "sequoia" and self.acceptance_by_rank is None:
            raise ValueError("acceptance_by_rank is required for static_tree='sequoia'")


@dataclass(frozen=True)
class Eagle2Settings:
    """eagle2: `depth` rounds expanding the `top_k` best nodes by `top_k` children each, reranked to `budget`.

    TreeConfig's `max_depth` is not eagle2's: the builder is bounded by `depth` alone. The parallel drafter's
    best-first tree, which stands in for eagle2 there, is capped by `max_depth` and not by `depth` (measured:
    capping it by depth changes its trees wherever depth is below the drafter's positions), so that stays."""

    budget: int = field(metadata={"help": "N: draft nodes kept by the rerank"})
    depth: int = field(metadata={"help": "expansion rounds"})
    top_k: int = field(metadata={"help": "K: children per expanded node and nodes expanded per round"})
    rerank: bool = field(metadata={"help": "keep the `budget` best nodes; False keeps the whole expanded tree"})

    def __post_init__(self) -> None:
        check_positive("budget", self.budget)
        check_positive("depth", self.depth)
        check_positive("top_k", self.top_k)


@dataclass(frozen=True)
class DySpecSettings:
    """dyspec: the `budget` nodes of largest reach probability, grown best-first from a heap."""

    budget: int = field(metadata={"help": "draft nodes"})
    max_depth: int | None = field(metadata={"help": "optional depth cap (the paper has none)"})
    prefetch: int = field(metadata={"help": "draft rows fetched per drafter call (T > 0: the popped node + best unfetched heap nodes; T = 0: the best unfetched candidates)"})

    def __post_init__(self) -> None:
        check_positive("budget", self.budget)
        check_positive("max_depth", self.max_depth, allow_none=True)
        check_positive("prefetch", self.prefetch)


@dataclass(frozen=True)
class DySpecThresholdSettings:
    """dyspec_threshold: expand while a position's reach probability exceeds `threshold`, up to `budget` nodes."""

    threshold: float = field(metadata={"help": "reach probability a node must exceed, in (0, 1)"})
    budget: int = field(metadata={"help": "cap on draft nodes"})
    max_depth: int | None = field(metadata={"help": "optional depth cap"})

    def __post_init__(self) -> None:
        check_open_unit("threshold", self.threshold)
        check_positive("budget", self.budget)
        check_positive("max_depth", self.max_depth, allow_none=True)


@dataclass(frozen=True)
class OptTreeSettings:
    """opt_tree: per layer, the `budget` nodes maximising the expected accepted length, stopping when it grows by
    at most `delta`."""

    budget: int = field(metadata={"help": "n: draft nodes per layer and in the final tree"})
    delta: float = field(metadata={"help": "stop when E_sub grows by at most delta (>= 0; paper: between mu and 1)"})
    max_depth: int | None = field(metadata={"help": "optional cap on drafter calls"})

    def __post_init__(self) -> None:
        check_positive("budget", self.budget)
        check_positive("max_depth", self.max_depth, allow_none=True)
        check_non_negative("delta", self.delta)


@dataclass(frozen=True)
class C2TSettings:
    """c2t: EAGLE-2-like expansion whose nodes a classifier prunes below confidence `beta`.

    As with eagle2, TreeConfig's `max_depth` is not c2t's (`depth` bounds the builder), and the parallel
    drafter's best-first tree for c2t is capped by `max_depth`, not `depth`."""

    budget: int = field(metadata={"help": "cap on draft nodes"})
    depth: int = field(metadata={"help": "the deepest layer"})
    top_k: int = field(metadata={"help": "K for both uses of Top-K"})
    beta: float | None = field(metadata={"help": "classifier confidence threshold, in (0, 1); None: the classifier's own (C2TClassifier.beta)"})
    c2t_classifier_path: str | None = field(metadata={"help": "safetensors weights; None: the drafter's own classifier, else a joint-probability prior"})

    def __post_init__(self) -> None:
        if self.beta is not None:
            check_open_unit("beta", self.beta)
        check_positive("top_k", self.top_k)
        check_positive("depth", self.depth)
        check_positive("budget", self.budget)


@dataclass(frozen=True)
class C2TChainSettings:
    """c2t_chain: a chain that stops before the first token whose classifier confidence falls under `beta`."""

    depth: int = field(metadata={"help": "the longest chain"})
    beta: float | None = field(metadata={"help": "classifier confidence threshold, in (0, 1); None: the classifier's own"})
    c2t_classifier_path: str | None = field(metadata={"help": "safetensors weights; None: the drafter's own classifier, else a joint-probability prior"})

    def __post_init__(self) -> None:
        check_positive("depth", self.depth)
        if self.beta is not None:
            check_open_unit("beta", self.beta)


BuilderSettings = Union[LookupTreeSettings, ChainSettings, StaticSettings, Eagle2Settings, DySpecSettings,
                        DySpecThresholdSettings, OptTreeSettings, C2TSettings, C2TChainSettings]

# A builder's name (methods.BUILDERS and "lookup") -> its settings.
SETTINGS: dict[str, type[BuilderSettings]] = {
    LOOKUP: LookupTreeSettings, "chain": ChainSettings, "static": StaticSettings, "eagle2": Eagle2Settings,
    "dyspec": DySpecSettings, "dyspec_threshold": DySpecThresholdSettings, "opt_tree": OptTreeSettings,
    "c2t": C2TSettings, "c2t_chain": C2TChainSettings,
}

