"""The `Drafter` protocol: what the step loop calls on any drafter, declared in one place; and `ModelDrafter`,
what only a drafter whose model runs in this process has.

A drafter turns DraftRequests into TokenTrees (`draft`), hears how each step went (`observe`), may draft the next
step while the target scores this one (`draft_ahead`) and frees a session's state (`release`). A draft call returns
its trees with the call's own facts (`Drafted`): how long it spent in the model (step records, the budget chooser's
cost curve), how many following steps its budget chooser already decided are plain decoding (the engine skips those
calls), and whether run-ahead served it. The three calls name the step's lane (engine/lanes.py): the router steps
each Target replica's sessions as a lane of their own, concurrently (services/router.py), so a drafter keeps each
lane's decisions and last step apart, and a call's facts travel with its trees rather than as "the last call" on
the drafter, which would be another lane's. What the target must return for it is one value (`FeatureNeeds`: an EAGLE
drafter reads the target's features). Every drafter declares all of it, with the defaults of `DrafterBase` where a
fact does not apply, so nobody has to probe with getattr.

The model, its KV cache, its restricted head and its budget choosers are not part of that interface: a remote
drafter has none of them. They live on `ModelDrafter`, and the callers that need them (the Drafter replica, bench,
OPT-Tree's delta, tests) hold one.

Implementations: `LocalDrafter` (an autoregressive drafter model: distilled, EAGLE, EAGLE-3, published heads) and
`ParallelTreeDrafter` (a ParallelSpec drafter model), both `ModelDrafter`s, and the services' `RemoteDrafter`
(Drafter replicas over gRPC).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..budget import BudgetChooser
from ..grammar.spec import Grammar
from ..methods import AUTOREGRESSIVE
from ..requests import LogitsProcessors, StepRecord, SamplingParams
from ..runners.cached_lm import CachedLM
from ..tree import TokenTree
from ..tree_config import TreeConfig


__all__ = ["AUTOREGRESSIVE", "NO_FEATURES", "Drafted", "Drafter", "DrafterBase", "DraftRequest", "FeatureNeeds",
           "ModelDrafter", "root_only"]


@dataclass
class DraftRequest:
    """Draft one tree whose root is `context[-1]`."""

    session_id: str
    context: list[int]  # prompt + emitted tokens; last = root
    sampling: SamplingParams
    tree: TreeConfig  # method and parameters (a chooser may replace the budget)
    seed: int  # seeds this step's sampling without replacement
    accepted_nodes: list[int] | None = None  # previous step's accepted nodes (compaction hint)
    features: torch.Tensor | None = None  # [len(context) - 1, H] target features of context[:-1] (EAGLE)
    cache_scope: str = ""  # the tenant's prefix-cache scope (engine/runners/kv_pages.py)
    # the sequence's penalties and biases: applied to the drafter's rows too, each from its own path, so its trees
    # propose what the penalised target will accept (the output never depends on them: engine/processors.py)
    processors: LogitsProcessors | None = None
    prediction: tuple[int, ...] = ()  # the request's predicted output (engine/lookup/prediction.py); () for none
    # the sequence's grammar: masks the drafter's rows as the target's, each from its own path (engine/grammar/)
    grammar: Grammar | None = None


@dataclass
class Drafted:
    """What one `Drafter.draft` call returns: its trees and the facts of that call."""

    trees: list[TokenTree]  # one per DraftRequest, in order
    # Drafter runner time of the call (forwards, KV upkeep, warping, summaries); the rest is tree construction.
    model_ms: float = 0.0
    forward_ms: float = 0.0  # of which model forwards
    # Steps after this one that its budget chooser already decided are plain decoding: the engine may skip calling
    # draft() for them (same lane, same batch-size bucket) and only report their records.
    hold_steps: int = 0
    run_ahead_hits: int = 0  # of these trees, those drafted ahead while the lane's previous step was scored
    run_ahead_misses: int = 0  # trees drafted ahead for these requests whose context did not come true
    # sessions whose model drafting waited for their catch-up this call (`Drafter.catch_up`)
    catching_up: tuple[str, ...] = ()
    # sessions the model would have drafted for (or caught up) but whose target features the request lacked (a
    # remote router sends a long context's rows only when asked): the caller supplies them with the next call
    features_wanted: tuple[str, ...] = ()
    catch_up_ms: float = 0.0  # the lane's catch-up forwards since its previous call (`Drafter.catch_up`), ms


def root_only(context: list[int]) -> TokenTree:
    """The tree of no drafts: the root alone (one plain decoding step)."""
    return TokenTree.build([context[-1]], [-1])


@dataclass(frozen=True)
class FeatureNeeds:
    """What a drafter needs of the target's features, as one value: the engine has the target return them with its
    scores (`Target.provides_features`), and a Drafter replica sizes its feature store by them."""

    reads: bool = False  # an EAGLE drafter: each DraftRequest must carry the target's features of its context
    # Width of one feature row (0: it reads none; also for a remote drafter, whose replicas size their own stores).
    size: int = 0
    # Target hidden_states indices it fuses (EAGLE-3); None: the final state, or no features at all.
    layers: tuple[int, ...] | None = None


NO_FEATURES = FeatureNeeds()  # a drafter that reads nothing of the target's


class Drafter(Protocol):
    """What the engine, its step records and the services call on any drafter (module docstring)."""

    feature_needs: FeatureNeeds  # what the target must return for it (EAGLE: its features)
    # Steps answered with a tree drafted ahead, and steps whose trees drafted ahead did not match (run-ahead).
    run_ahead_hits: int
    run_ahead_misses: int

    def draft(self, requests: list[DraftRequest], batch_size: int | None = None, lane: str = "") -> Drafted:
        """One tree per request; `batch_size` = sequences in the step's target forward (default: all of
        `requests`; more when a Drafter replica holds only some of a router's batch); `lane`: the batch whose step
        this is (its steps come in order; other lanes' may interleave)."""
        ...

    def observe(self, record: StepRecord, lane: str = "") -> None:
        """A finished step's record, for the budget chooser of `lane` that decided it."""
        ...

    def draft_ahead(self, lane: str = "") -> bool:
        """Draft the next step's trees from the expected outcome of the lane's last one, while the target scores it
        (engine/drafters/run_ahead.py); False when there was nothing to draft ahead."""
        ...

    def catch_up(self, lane: str = "") -> int:
        """Feed the drafter the context the lane's last call left it to catch up on (`Drafted.catching_up`), while
        the target scores that step; returns the sessions caught up."""
        ...

    def wants_features(self, session_id: str, missing_rows: int) -> bool:
        """Whether the session's target features, `missing_rows` of which the caller does not hold yet, should come
        back from the target this step (a remote drafter asks for a long context's only when it would read them)."""
        ...

    def release(self, session_id: str) -> bool:
        """Free the session's state; True if there was any."""
        ...


class DrafterBase:
    """The protocol's defaults: a drafter without features, chooser or run-ahead. Subclasses set what applies to
    them (plain class attributes: immutable defaults that instances shadow)."""

    feature_needs: FeatureNeeds = NO_FEATURES
    run_ahead_hits: int = 0  # steps answered with a tree drafted ahead (engine/drafters/run_ahead.py)
    run_ahead_misses: int = 0  # steps whose trees drafted ahead did not match their context

    def draft(self, requests: list[DraftRequest], batch_size: int | None = None, lane: str = "") -> Drafted:
        raise NotImplementedError

    def observe(self, record: StepRecord, lane: str = "") -> None:
        """Ignored by default: a drafter without a budget chooser learns nothing from step records."""

    def draft_ahead(self, lane: str = "") -> bool:
        """Nothing to draft ahead by default (drafters without run-ahead)."""
        return False

    def catch_up(self, lane: str = "") -> int:
        """Nothing left to catch up on by default (drafters that catch up inline)."""
        return 0

    def wants_features(self, session_id: str, missing_rows: int) -> bool:
        """Always, by default: a drafter in this process reads them where they are, at no transfer cost."""
        return True

    def release(self, session_id: str) -> bool:
        raise NotImplementedError


class ModelDrafter(DrafterBase):
    """A drafter whose model runs in this process (`LocalDrafter`, `ParallelTreeDrafter`): besides the protocol,
    its kind, model, KV cache, restricted head and budget choosers, for the callers that hold one (the Drafter
    replica, bench, OPT-Tree's delta, memory bounds, tests)."""

    kind: str = ""  # the registry's drafter kind ("autoregressive", "parallel")
    lm: CachedLM  # the KV cache holding its sessions (set by the subclass)
    vocab_ids: torch.Tensor | None = None  # target ids of the drafter's restricted head (None: the full vocabulary)
    budget: BudgetChooser | None = None  # the batch-1 hardware-aware budget chooser (None: fixed budgets)

    @property
    def model(self) -> torch.nn.Module:
        """The drafter model."""
        return self.lm.model

    def step_choosers(self) -> dict[str, BudgetChooser]:
        """The batch-1 budget choosers by the context they measure ("": every step, or a hybrid's steps with
        nothing to copy; "copying": a hybrid's steps where the lookup expects to copy); empty without one."""
        return {"": self.budget} if self.budget is not None else {}

    def session_ids(self) -> list[str]:
        """Sessions holding state here (health checks, idle sweeps)."""
        return list(self.lm.sessions)
