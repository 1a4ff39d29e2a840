"""One draft call of an autoregressive drafter as its drafting modes see it, and the interface they share.

`LocalDrafter.draft` (engine/drafters/autoregressive.py) hands each call to exactly one mode, each a module of its
own: `BatchedChains` above batch size 1 (batched_c2t_chains.py), and at batch size 1 the tree drafted ahead for
the step's context (`RunAhead`, ahead_tree.py), else the method's tree: `HybridTree` for a lookup method
(hybrid_tree.py), `ModelTree` for the others (model_tree.py). A mode reads the step (`DraftStep`: its lane, its
requests, the batch size, the sessions whose drafter cache lags) and the drafter's parts (`DraftingParts`: the
model's runner, the lookup sources, the builders, the step planner), and returns the trees (`StepTrees`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..budget import BudgetChooser
from ..builders import make_builder
from ..builders.base import TreeBuilder
from ..c2t_classifier import C2TClassifier
from ..grammar.drafts import StepGrammar
from ..lookup import AheadLookup, LookupSession, LookupSources
from ..lookup.grammar_copies import GrammarCopies
from ..tree import TokenTree
from ..tree_config import TreeConfig
from .base import DraftRequest
from .model_runner import DrafterRunner, SessionOracle
from .planner import StepPlanner


@dataclass
class DraftLane:
    """One lane's drafting state (engine/lanes.py) beside its planner's decisions: what the lane's last batch-1 step
    drafted with (run-ahead drafts the next step's trees from it) and which sessions catch up beside its step."""

    # Run-ahead (engine/drafters/ahead_tree.py): what the last batch-1 step drafted with (request, tree, builder at
    # its budget, its chooser), and the chooser and builder that the trees drafted ahead from it follow.
    last_step: tuple[DraftRequest, TokenTree, TreeBuilder, BudgetChooser | None] | None = None
    ahead_chooser: BudgetChooser | None = None
    ahead_builder: TreeBuilder | None = None
    # Requests of the lane's last draft call whose drafter cache lagged their context (`LocalDrafter.catch_up_beside`):
    # their catch-up forward runs in `catch_up`, beside the target's score of that step.
    catching_up: list[DraftRequest] = field(default_factory=list)
    catch_up_seconds: float = 0.0  # wall time of `catch_up` since the lane's last draft call reported it


@dataclass
class DraftStep:
    """One draft call: the requests a mode drafts for and what it needs to know of the call."""

    lane: str
    state: DraftLane
    requests: list[DraftRequest]  # the call's speculative requests (autoregressive ones get the root alone)
    batch_size: int  # sequences in the step's target forward (>= len(requests) on a Drafter replica)
    lagging: set[str]  # sessions whose model drafting waits for their catch-up this call

    def model_ready(self, r: DraftRequest) -> bool:
        """Whether the model may draft for `r` this step (asked only where the step would have it draft); a request
        whose drafter cache lags is drafted without it, and catches up beside the step (`DraftLane.catching_up`)."""
        if r.session_id in self.lagging:
            self.state.catching_up.append(r)
            return False
        return True

    def remember(self, r: DraftRequest, tree: TokenTree, builder: TreeBuilder, chooser: BudgetChooser | None) -> None:
        """The lane's batch-1 step drafted `tree` for `r` with the model: run-ahead drafts the next step from it."""
        self.state.last_step = (r, tree, builder, chooser)


@dataclass
class StepTrees:
    """A mode's answer: one tree per request of the step (None: the root alone) and the plain steps its plan holds
    after this one."""

    trees: list[TokenTree | None]  # [len(DraftStep.requests)]
    held: int = 0


class DraftMode(Protocol):
    """What every drafting mode does: draft the step's trees."""

    def draft(self, step: DraftStep) -> StepTrees:
        ...


@dataclass
class DraftingParts:
    """What the modes of one drafter share: the model's runner, the lookup sources, the C2T classifier, the builders
    by tree configuration and the step planner."""

    runner: DrafterRunner
    lookups: LookupSources
    classifier: C2TClassifier
    planner: StepPlanner
    head_index: dict[int, int] | None  # target id -> row of the drafter's restricted head (HybridOracle)
    builders: dict[str, TreeBuilder] = field(default_factory=dict)

    def builder(self, config: TreeConfig) -> TreeBuilder:
        """The (cached) builder for `config`; raises ValueError for invalid parameters."""
        key = repr(config)
        if key not in self.builders:
            self.builders[key] = make_builder(config, self.classifier)
        return self.builders[key]

    def begin(self, r: DraftRequest) -> SessionOracle:
        """The model's oracle over `r`'s session this step (its KV cache reconciled with the context)."""
        return self.runner.begin(r.session_id, r.context, r.sampling, r.accepted_nodes, r.features, r.cache_scope,
                                 r.processors, r.grammar)

    def session(self, r: DraftRequest) -> LookupSession:
        """`r`'s lookup session, its index extended by the tokens its context adds."""
        return self.lookups.session(r.session_id, r.context, r.cache_scope, r.sampling.is_greedy, r.prediction)

    def copies(self, r: DraftRequest, lookup: LookupSession | AheadLookup,
               prefix: tuple[int, ...] = ()) -> LookupSession | AheadLookup | GrammarCopies:
        """The request's copy source as its grammar sees it (engine/lookup/grammar_copies.py: copies it refuses cut,
        the text it forces copied), `prefix`: the guessed tokens a tree drafted ahead stands after; the lookup
        itself for a request without a grammar (or a runner without the target's tokenizer)."""
        if r.grammar is None or self.runner.grammars is None:
            return lookup
        return GrammarCopies(lookup, StepGrammar(self.runner.grammars, r.session_id, r.grammar, r.context, prefix))

    @staticmethod
    def generator(r: DraftRequest, offset: int = 0) -> torch.Generator:
        """The step's sampling generator, seeded by the request (`offset` 1: a tree drafted ahead)."""
        return torch.Generator().manual_seed(r.seed + offset)
