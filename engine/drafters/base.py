"""The `Drafter` protocol: what the engine and the services may read from a drafter, declared in one place.

A drafter turns DraftRequests into TokenTrees (`draft`), hears how each step went (`observe`) and frees a
session's state (`release`). Around those calls the engine and the services read a few facts: how long the
last call spent in the model (step records, the budget chooser's cost curve), how many following steps its
budget chooser already decided are plain decoding (the engine skips those calls), whether it reads the
target's features (EAGLE: the target must return them), and the model, KV cache and chooser behind it (hardware
profile, memory bound, bench). Every drafter declares all of them, with the defaults of `DrafterBase` where a
fact does not apply (a remote drafter has no local model), so nobody has to probe with getattr.

Implementations: `LocalDrafter` (an autoregressive drafter model: distilled, EAGLE, EAGLE-3, published heads),
`ParallelTreeDrafter` (a ParallelSpec drafter model) and the services' `RemoteDrafter` (Drafter replicas over
gRPC).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..methods import AUTOREGRESSIVE
from ..requests import StepRecord, SamplingParams
from ..tree import TokenTree
from ..tree_config import TreeConfig

if TYPE_CHECKING:  # type names only: the runners import torch models this module does not need
    from ..budget import BudgetChooser
    from ..runners.cached_lm import CachedLM

__all__ = ["AUTOREGRESSIVE", "Drafter", "DrafterBase", "DraftRequest", "batch_size_bucket", "root_only"]


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


def root_only(context: list[int]) -> TokenTree:
    """The tree of no drafts: the root alone (one plain decoding step)."""
    return TokenTree.build([context[-1]], [-1])


def batch_size_bucket(batch_size: int) -> int:
    """The power of two at or above `batch_size`: batched steps share one budget chooser (and its plain
    decoding holds) per bucket, so requests joining or leaving a batch do not reset what was measured."""
    return 1 << (batch_size - 1).bit_length()


class Drafter(Protocol):
    """Everything the engine and the services use of a drafter (module docstring)."""

    kind: str  # the registry's drafter kind ("autoregressive", "parallel"), or "remote" for replicas
    # Drafter runner time of the last draft() call (forwards, KV upkeep, warping); the rest is tree construction.
    last_model_ms: float
    last_forward_ms: float  # of which model forwards
    # Steps after the last draft() call that its budget chooser already decided are plain decoding: the engine
    # may skip calling draft() for them (same batch-size bucket) and only report their records.
    hold_steps: int
    # An EAGLE drafter: each DraftRequest must carry the target's features of its context, so the target
    # must return them (the target's `provides_features`).
    reads_target_features: bool
    target_feature_size: int  # width of one feature row the drafter reads (0 when it reads none)
    # Target hidden_states indices the drafter fuses (EAGLE-3); None: the final state, or no features at all.
    feature_layers: tuple[int, ...] | None
    vocab_ids: torch.Tensor | None  # target ids of the drafter's restricted head (None: the full vocabulary)
    model: torch.nn.Module | None  # the drafter model (None for a remote drafter)
    lm: CachedLM | None  # the KV cache holding its sessions (None for a remote drafter)
    budget: BudgetChooser | None  # the batch-1 hardware-aware budget chooser (None: fixed budgets)
    # Steps answered with a tree drafted ahead, and steps whose trees drafted ahead did not match (run-ahead).
    run_ahead_hits: int
    run_ahead_misses: int

    def draft(self, requests: list[DraftRequest], batch_size: int | None = None) -> list[TokenTree]:
        """One tree per request; `batch_size` = sequences in the step's target forward (default: all of
        `requests`; more when a Drafter replica holds only some of a router's batch)."""
        ...

    def observe(self, record: StepRecord) -> None:
        """A finished step's record, for the budget chooser that decided it."""
        ...

    def step_choosers(self) -> dict[str, BudgetChooser]:
        """The batch-1 budget choosers by the context they measure ("": every step, or a hybrid's steps with
        nothing to copy; "copying": a hybrid's steps where the lookup expects to copy); empty without one."""
        ...

    def draft_ahead(self) -> bool:
        """Draft the next step's trees from the expected outcome of the last one, while the target scores it
        (engine/drafters/run_ahead.py); False when there was nothing to draft ahead."""
        ...

    def release(self, session_id: str) -> bool:
        """Free the session's state; True if there was any."""
        ...

    def session_ids(self) -> list[str]:
        """Sessions holding state here (health checks, idle sweeps)."""
        ...


class DrafterBase:
    """The protocol's defaults: a drafter without a local model, features or chooser. Subclasses set what
    applies to them (plain class attributes: immutable defaults that instances shadow)."""

    kind: str = ""
    last_model_ms: float = 0.0
    last_forward_ms: float = 0.0
    hold_steps: int = 0
    reads_target_features: bool = False
    target_feature_size: int = 0
    feature_layers: tuple[int, ...] | None = None
    vocab_ids: torch.Tensor | None = None
    model: torch.nn.Module | None = None
    lm: CachedLM | None = None
    budget: BudgetChooser | None = None
    run_ahead_hits: int = 0  # steps answered with a tree drafted ahead (engine/drafters/run_ahead.py)
    run_ahead_misses: int = 0  # steps whose trees drafted ahead did not match their context

    def draft(self, requests: list[DraftRequest], batch_size: int | None = None) -> list[TokenTree]:
        raise NotImplementedError

    def observe(self, record: StepRecord) -> None:
        """Ignored by default: a drafter without a budget chooser learns nothing from step records."""

    def step_choosers(self) -> dict[str, BudgetChooser]:
        return {"": self.budget} if self.budget is not None else {}

    def draft_ahead(self) -> bool:
        """Nothing to draft ahead by default (drafters without run-ahead)."""
        return False

    def release(self, session_id: str) -> bool:
        raise NotImplementedError

    def session_ids(self) -> list[str]:
        return list(self.lm.sessions) if self.lm is not None else []
