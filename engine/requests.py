"""Request, result and per-step record types of in-process generation (shared by engine and services)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from .grammar.spec import Grammar
from .lanes import batch_size_bucket
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


# Bounds of the penalty fields: OpenAI's for presence / frequency and logit_bias; a repetition penalty is a
# positive factor (transformers' and vLLM's), bounded so that a typo cannot send every logit to 0 or infinity.
PENALTY_RANGE = 2.0
LOGIT_BIAS_RANGE = 100.0
REPETITION_RANGE = (0.01, 100.0)


@dataclass(frozen=True)
class LogitsProcessors:
    """Penalties and biases applied to the target's logits at every tree node before the warp, each node from its
    own path (engine/processors.py; docs/design.md section 5). The first five fields are the request's; the
    engine fills `prompt_tokens` and `stop_ids` when the sequence starts (`SpeculativeEngine.start`).

    Semantics as vLLM's: presence and frequency (OpenAI's) count the generated tokens only, the repetition penalty
    (transformers' `RepetitionPenaltyLogitsProcessor`) every token of prompt and output; applied in the order
    logit_bias, min_tokens, repetition, frequency, presence."""

    presence_penalty: float = 0.0  # subtracted once from the logit of every token the output holds
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # tokens of prompt and output: logit / p when > 0, logit * p when < 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), ids distinct
    min_tokens: int = 0  # the stop tokens (stop_ids) are held back until this many tokens were generated
    prompt_tokens: int = 0  # context[:prompt_tokens] is the prompt: presence / frequency count what follows
    stop_ids: tuple[int, ...] = ()  # what min_tokens holds back: the sequence's stop tokens

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -PENALTY_RANGE <= value <= PENALTY_RANGE):
                raise ValueError(f"{name} must lie in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], got {value}")
        low, high = REPETITION_RANGE
        if not (math.isfinite(self.repetition_penalty) and low <= self.repetition_penalty <= high):
            raise ValueError(f"repetition_penalty must lie in [{low:g}, {high:g}] (1 disables it), got "
                             f"{self.repetition_penalty}")
        tokens = [t for t, _ in self.logit_bias]
        if len(set(tokens)) != len(tokens) or any(t < 0 for t in tokens):
            raise ValueError("logit_bias: token ids must be distinct and >= 0")
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE):
                raise ValueError(f"logit_bias: the bias of token {token} must lie in [-{LOGIT_BIAS_RANGE:g}, "
                                 f"{LOGIT_BIAS_RANGE:g}], got {bias}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")

    @property
    def active(self) -> bool:
        """Whether any field changes a logit (an inactive set costs the target nothing)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or (self.min_tokens and self.stop_ids))


MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target's own distribution (raw: before penalties, biases,
    temperature, top-k and top-p, as vLLM's default `raw_logprobs`), and the `top` most likely tokens' (id,
    log-probability), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    processors: LogitsProcessors = LogitsProcessors()  # penalties, biases, min_tokens (engine/processors.py)
    grammar: Grammar | None = None  # structured output: the output follows it, then a stop token (engine/grammar/)
    ignore_eos: bool = False  # the model's EOS ids do not stop it (stop_token_ids still do)
    # None: no log-probabilities; k in 0..MAX_TOP_LOGPROBS: each emitted token's and its k most likely alternatives'
    logprobs: int | None = None
    # the log-probabilities of the distribution each token was drawn from (after penalties, biases, temperature,
    # top-k, top-p; vLLM's processed_logprobs) instead of the raw model's
    processed_logprobs: bool = False
    # Prefix-cache scope: KV of a prefix is shared only between requests of one scope (the services derive it
    # from the API token and the request's cache_salt; engine/runners/kv_pages.py)
    cache_scope: str = ""
    # The client's prediction of the output (OpenAI's Predicted Outputs), tokenised: drafted from like the context,
    # in order (engine/lookup/prediction.py); it never changes the output. () for none
    prediction: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")


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
    catch_up: bool = False  # the model drafted nothing: the drafter caught up on the context beside this step
    catch_up_ms: float = 0.0  # this sequence's share of the drafter's catch-up forwards reported with this step
    fed_prompt: bool = False  # the step fed a prompt (this sequence's or an arrival's): plain for every sequence
    # The drafter did not follow this sequence's context this step (a remote one that has not asked for its long
    # context's features): its model drafts nothing for it and catches up only once its plan would draft again.
    parked: bool = False


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens (the stop token included when one ended it)
    text: str  # decoded text, special tokens, the stop token and stop string removed
    finish_reason: FinishReason
    steps: list[StepRecord]
    prompt_tokens: int
    wall_time_s: float
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry when the request asked for them
    cached_tokens: int = 0  # prompt tokens whose KV the target took from its prefix cache (OpenAI's usage field)
    # With a prediction (OpenAI's usage fields, engine/lookup/prediction.py `prediction_usage`): its tokens that
    # appear in the output, in order, and the rest of them
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

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

    def load_switches(self) -> tuple[int, int]:
        """How this request's drafting followed the load: (rises, steps to switch). A rise: a step whose batch-size
        bucket (engine/lanes.py) is above the previous step's while the request's last step drafted; its steps to
        switch: the steps from there on that still drafted before the first plain one (steps that fed a prompt are
        plain for every sequence and count neither way; a fall of the load ends the count)."""
        rises = switching = 0
        counting = drafting = False
        bucket = None
        for s in self.steps:
            b = batch_size_bucket(s.batch_size)
            if bucket is not None and b != bucket:
                counting = b > bucket and drafting
                rises += counting
            bucket = b
            if s.fed_prompt:
                continue
            drafting = s.tree_size > 0
            counting = counting and drafting
            switching += counting
        return rises, switching

    def mean_step_ms(self) -> tuple[float, float, float]:
        """Mean (drafting, target scoring, verification) milliseconds per step of this request."""
        n = max(1, len(self.steps))
        return (sum(s.draft_ms for s in self.steps) / n, sum(s.score_ms for s in self.steps) / n,
                sum(s.verify_ms for s in self.steps) / n)
