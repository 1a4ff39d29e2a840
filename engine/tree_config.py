"""`TreeConfig`: how a drafter shapes its tree (no torch import: the typed service config, requests and the wire
format read it). It is the external format, one flat set of fields whichever method it names; `settings` parses it
into its builder's own typed settings (engine/tree_settings.py), which engine/builders' `make_builder` builds."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Literal, Union

from .methods import DEFAULT_METHOD, HYBRID_BUILDERS, LOOKUP, METHODS, Method
from .tree_settings import SETTINGS, BuilderSettings

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
    """How the drafter shapes its tree. Each field's meaning for a builder is in that builder's settings
    (engine/tree_settings.py), which `settings` validates."""

    method: str = field(default=DEFAULT_METHOD, metadata={"help": f"tree method, one of {', '.join(METHODS)}"})
    budget: int = field(default=64, metadata={"help": "draft nodes per tree (root excluded); cap for threshold methods; not chain's (its depth)"})
    budget_auto: bool = field(default=False, metadata={"help": "the drafter's hardware-aware chooser picks each step's budget (if it has one); False: `budget` is fixed"})
    depth: int = field(default=6, metadata={"help": "chain, c2t_chain: length; eagle2: expansion rounds; c2t: deepest layer; static: binary / sequoia depth"})
    top_k: int = field(default=10, metadata={"help": "eagle2, c2t: K"})
    threshold: float = field(default=0.05, metadata={"help": "dyspec_threshold: reach probability to expand, in (0, 1)"})
    delta: float = field(default=0.2, metadata={"help": "opt_tree: stop when E_sub grows by at most delta (>= 0)"})
    beta: float | None = field(default=None, metadata={"help": "c2t, c2t_chain: classifier confidence threshold, in (0, 1); None: the classifier's own"})
    prefetch: int = field(default=16, metadata={"help": "dyspec: draft rows fetched per drafter call"})
    max_depth: int | None = field(default=None, metadata={"help": "dyspec, dyspec_threshold, opt_tree: optional depth cap; the parallel drafter caps all its best-first trees by it (eagle2's and c2t's too)"})
    chain_sampled: bool = field(default=True, metadata={"help": "chain at temperature > 0: sample tokens (SpS) instead of deterministic top-1"})
    rerank: bool = field(default=True, metadata={"help": "eagle2: keep the `budget` best nodes; False keeps the whole expanded tree"})
    static_tree: str = field(default="mc_sim_7b_63", metadata={"help": "static: 'mc_sim_7b_63', 'eagle1_25', 'binary' (uses depth) or 'sequoia'"})
    static_paths: tuple[tuple[int, ...], ...] | None = field(default=None, metadata={"help": "static: explicit rank paths; overrides static_tree"})
    acceptance_by_rank: tuple[float, ...] | None = field(default=None, metadata={"help": "static_tree='sequoia': measured acceptance probability of the r-th ranked child"})
    c2t_classifier_path: str | None = field(default=None, metadata={"help": "c2t, c2t_chain: safetensors weights; None uses the drafter's own classifier (make_builder's `classifier`), else a joint-probability prior"})

    @cached_property
    def parsed_method(self) -> Method:
        """`method` parsed once per config (on first read): make_builder and the drafters read this, not the name.
        Not a field, so the CLI options, the wire and equality see `method` alone; a config keeps the method it
        was made with (`dataclasses.replace` makes a new config, which parses its own)."""
        return Method.parse(self.method)

    @cached_property
    def settings(self) -> BuilderSettings:
        """This config's builder's own settings (engine/tree_settings.py), parsed on first read and kept as
        `parsed_method` is: its fields, read from this config by name. ValueError naming the field for a value the
        builder cannot take, and naming `method` for a method no builder shapes ("autoregressive", an unknown
        name, "<builder>+lookup" for a builder copies cannot join)."""
        method = self.parsed_method
        cls = SETTINGS.get(method.builder)
        if cls is None or (method.copies and method.builder != LOOKUP and method.builder not in HYBRID_BUILDERS):
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})


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
