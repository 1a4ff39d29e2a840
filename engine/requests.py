"""Request, result and per-step record types of in-process generation (shared by engine and services)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from .tree_config import TreeConfig


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters; temperature 0 means greedy decoding."""

    temperature: float = 0.0  # >= 0; 0 selects greedy verification
    top_k: int = 0  # keep the k most likely tokens; 0 disables
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 disables

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS = "eos"  # a stop token: one of the model's EOS ids or of the request's stop_token_ids (the last token)
    STOP_STRING = "stop_string"


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to decode; `prompt_ids` are final (chat template already applied)."""

    prompt_ids: list[int]
    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None  # None: a random seed
    tree: TreeConfig | None = None  # per-request override of the engine's tree method
    stop_token_ids: tuple[int, ...] = ()  # stop tokens beside the model's EOS ids (vLLM's stop_token_ids)


@dataclass
class StepRecord:
    """One speculation step of one sequence."""

    tree_size: int  # draft nodes sent to the target (root excluded): "candidate tokens"
    accepted: int  # draft tokens accepted
    emitted: int  # tokens emitted: accepted + the bonus/recovered token
    batch_size: int  # sequences in the step's target forward
    draft_ms: float  # drafting wall time of the whole batch step
    draft_model_ms: float  # of which the drafter runner: forwards, KV upkeep, warping (the rest is tree construction)
    score_ms: float  # target forward wall time of the whole batch step
    verify_ms: float  # verification time per sequence
    draft_forward_ms: float = 0.0  # of draft_model_ms, the drafter's model forwards alone
    # Hybrid trees (engine/lookup/): of `tree_size` / `accepted`, the nodes the lookup source proposed (copied
    # from the context), split into those the model's top-1 at the parent was not (LOOKUP) and was (BOTH); the
    # rest came from the model drafter alone.
    tree_size_lookup: int = 0
    accepted_lookup: int = 0
    accepted_both: int = 0
    run_ahead_hit: bool = False  # the tree was drafted ahead while the previous step was scored


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens (the stop token included when one ended it)
    text: str  # decoded text, special tokens, the stop token and stop string removed
    finish_reason: FinishReason
    steps: list[StepRecord]
    prompt_tokens: int
    wall_time_s: float

    @property
    def mean_accepted_length(self) -> float:
        """MAL: tokens emitted per target forward, bonus included (docs/design.md section 7)."""
        return sum(s.emitted for s in self.steps) / max(1, len(self.steps))

    @property
    def mean_tree_size(self) -> float:
        return sum(s.tree_size for s in self.steps) / max(1, len(self.steps))

    def accepted_by_source(self) -> dict[str, int]:
        """Accepted draft tokens by the source that proposed them: "model" (the drafter alone), "lookup" (copied
        from the context, not the model's top-1) and "both" (copied, and the model's top-1)."""
        lookup = sum(s.accepted_lookup for s in self.steps)
        both = sum(s.accepted_both for s in self.steps)
        return {"model": sum(s.accepted for s in self.steps) - lookup - both, "lookup": lookup, "both": both}

    @property
    def mean_tree_size_lookup(self) -> float:
        """Lookup candidates (LOOKUP and BOTH nodes) per step."""
        return sum(s.tree_size_lookup for s in self.steps) / max(1, len(self.steps))

    def mean_step_ms(self) -> tuple[float, float, float]:
        """Mean (drafting, target scoring, verification) milliseconds per step of this request."""
        n = max(1, len(self.steps))
        return (sum(s.draft_ms for s in self.steps) / n, sum(s.score_ms for s in self.steps) / n,
                sum(s.verify_ms for s in self.steps) / n)
