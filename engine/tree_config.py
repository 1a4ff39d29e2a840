"""`TreeConfig`: how a drafter shapes its tree (no torch import: the typed service config, requests and the wire
format read it; engine/builders' `make_builder` validates it into a builder)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Literal, Union

from .methods import DEFAULT_METHOD, METHODS, Method

AUTO_BUDGET = "auto"
# A tree budget as a user or a config states it: a fixed number of draft nodes (a chain's length), or "auto", the
# drafter's hardware-aware chooser picks each step's (engine/budget.py). `TreeConfig` holds it as `budget` and
# `budget_auto`; the wire as `budget_tokens`, 0 meaning "auto" (services/wire.py).
TreeBudget = Union[int, Literal["auto"]]


def parse_budget(value: int | str, what: str = "budget", maximum: int | None = None) -> TreeBudget:
    """`value` ("auto", an integer, or an integer's digits) as a TreeBudget: ValueError naming `what` unless it is
    "auto" or an integer in 1..maximum (no maximum: >= 1)."""
    if value == AUTO_BUDGET:
        return AUTO_BUDGET
    number = value if isinstance(value, int) and not isinstance(value, bool) else \
        int(value) if isinstance(value, str) and value.isdigit() else None
    if number is None or number < 1 or (maximum is not None and number > maximum):
        allowed = f"an integer in 1..{maximum}" if maximum is not None else "an integer >= 1"
        raise ValueError(f"{what}: must be '{AUTO_BUDGET}' or {allowed}, got {value!r}")
    return number


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

    @cached_property
    def parsed_method(self) -> Method:
        """`method` parsed once per config (on first read): make_builder and the drafters read this, not the name.
        Not a field, so the CLI options, the wire and equality see `method` alone; a config keeps the method it
        was made with (`dataclasses.replace` makes a new config, which parses its own)."""
        return Method.parse(self.method)


# Every budget a hardware-aware chooser may pick for a step (engine/budget.py); 0 = a plain decoding step. The
# largest bounds an auto budget's tree (KV slots a session must keep free for it: the Serve config's check).
CANDIDATE_BUDGETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# C2T's own defaults (paper section 5.1: K = 15, up to 10 layers). The confidence threshold beta is the
# classifier's own (C2TClassifier.beta, chosen per drafter; see c2t.json next to each shipped classifier).
C2T_DEFAULTS = {"depth": 10, "top_k": 15}


def tree_config(method: str, budget: TreeBudget, **overrides) -> TreeConfig:
    """TreeConfig for `method`; an integer budget is fixed (for a chain: its length), "auto" leaves it
    to the drafter's hardware-aware chooser."""
    budget = parse_budget(budget)
    base = Method.parse(method).builder  # "c2t+lookup" shapes its tree as "c2t" does
    if base == "c2t":
        overrides = {**C2T_DEFAULTS, **overrides}
    config = TreeConfig(method=method, **overrides)
    if isinstance(budget, int):
        config = replace(config, budget=budget, depth=budget if base == "chain" else config.depth)
    else:
        config = replace(config, budget_auto=True)
    return config
