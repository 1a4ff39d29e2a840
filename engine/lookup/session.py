"""One request's copy-from-context state across steps (`LookupSession`: its suffix index, the calibration of
its candidates' probabilities, the predictions a step made), the prior pooled over a drafter's requests
(`LookupStats`), the drafter's sessions (`LookupSources`) and the source's settings. Overview: engine/lookup/."""

from __future__ import annotations

import bisect
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from .prediction import PredictedOutput
from .shared_outputs import SharedOutputs
from .suffix_index import NO_MATCH, SEPARATOR, LookupRow, LookupState, Origin, SuffixIndex

# Lower edges of the match-length buckets the calibration keeps, and the probability each starts from that
# the target's next token is one of the candidates (rising with the match length, as prompt lookup's n-gram
# size and SuffixDecoding's max_spec_factor assume).
MATCH_BUCKETS = (1, 2, 3, 4, 6, 10, 16, 32)
PRIOR_HIT = (0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.8)
# The same for matches in other requests' outputs (SharedOutputs), calibrated apart: text another request
# wrote predicts this one less than this request's own context does until measured otherwise.
PRIOR_HIT_SHARED = (0.05, 0.1, 0.15, 0.25, 0.35, 0.45, 0.55, 0.6)
# The request's predicted output (engine/lookup/prediction.py), by the run of output tokens that followed it: a
# client sends one because it expects the answer to follow it, so it starts out trusted, and the more so along
# a long run.
PRIOR_HIT_PREDICTED = (0.5, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9)
# Tokens a request's grammar forces (engine/lookup/grammar_copies.py), by how many of the forced chain are left
# (1: its last token): the grammar allows nothing else, so only the tokenization can differ from the target's,
# and that mostly at the chain's end, where the model's token may run on into the free text after it.
PRIOR_HIT_FORCED = (0.6, 0.85, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9)
PRIORS = PRIOR_HIT + PRIOR_HIT_SHARED + PRIOR_HIT_PREDICTED + PRIOR_HIT_FORCED  # calibration bucket -> prior hit rate


def match_bucket(length: int, origin: Origin = Origin.OWN) -> int:
    """The calibration bucket of a match: by length, each source's buckets after the one before
    (`Origin`: the request's own, the shared outputs', the prediction's, the grammar's forced text)."""
    return max(0, bisect.bisect_right(MATCH_BUCKETS, length) - 1) + len(MATCH_BUCKETS) * int(origin)


@dataclass
class LookupSettings:
    """Knobs of the copy-from-context source (per drafter)."""

    max_ngram: int = field(default=4, metadata={
        "help": "longest n-gram indexed (memory: ~650 bytes per context token at 4, ~1.2 kB at 8); longer matches "
                "are measured at the occurrences of their last max_ngram tokens"})
    max_positions: int = field(default=16, metadata={"help": "most recent occurrences of a match whose continuations are counted"})
    max_match: int = field(default=32, metadata={"help": "match lengths are measured up to this many tokens"})
    max_branches: int = field(default=3, metadata={"help": "continuations of a match kept as candidates (most counted first)"})
    plan_nodes: int = field(default=24, metadata={"help": "nodes of a lookup-only tree considered per step"})
    min_value: float = field(default=0.02, metadata={"help": "lookup-only trees keep nodes whose path probability is at least this"})
    skip_model_above: float = field(default=0.6, metadata={
        "help": "a node whose best lookup candidate is at least this probable gets no model row (nor do its descendants)"})
    session_prior: float = field(default=4.0, metadata={"help": "observations the pooled estimate counts as in a request's calibration"})
    pooled_prior: float = field(default=8.0, metadata={
        "help": "observations the fixed prior hit rates (PRIORS) count as in the pooled calibration"})
    chain_min_joint: float = field(default=0.3, metadata={"help": "batched steps: a lookup chain stops below this path probability"})
    max_sessions: int = field(default=256, metadata={"help": "sessions whose index is kept (least recently used dropped)"})
    copy_context_gain: float = field(default=0.5, metadata={
        "help": "auto budgets: steps whose lookup-only plan expects at least this many accepted tokens are measured "
                "by a budget chooser of their own (what a tree size buys differs where there is something to copy)"})
    shared_tokens: int = field(default=16384, metadata={
        "help": "0: off. Else the outputs of a drafter's recent requests, up to this many tokens per tenant (cache "
                "scope: API token and cache_salt), are indexed too (SuffixDecoding's global tree; ~650 bytes per "
                "token at max_ngram 4): a node drafts from them where their best candidate is more probable than "
                "its own context's. Output is unchanged; a request drafts only from its own tenant's outputs, so "
                "its speed says nothing of another tenant's (a repeated request decoded 4.5x faster with it, "
                "first requests and second turns 1.0x: docs/performance.md section 20). Greedy requests only: a "
                "sampled output depends on the trees it was verified on, and a seed must give the same sample"})
    shared_scopes: int = field(default=16, metadata={
        "help": "tenants whose shared output index is kept (least recently used dropped): at most shared_tokens x "
                "shared_scopes tokens indexed"})
    shared_min_match: int = field(default=2, metadata={
        "help": "shortest match in the shared outputs that is drafted from (a single token recurs everywhere)"})
    prediction_plan_nodes: int = field(default=64, metadata={
        "help": "nodes of a lookup-only tree considered per step for a request with a predicted output (its "
                "chains run long: a rewritten file follows its prediction for hundreds of tokens)"})

    def __post_init__(self) -> None:
        for name in ("max_ngram", "max_positions", "max_match", "max_branches", "plan_nodes", "max_sessions",
                     "shared_min_match", "shared_scopes", "prediction_plan_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"lookup.{name} must be an integer >= 1, got {value!r}")
        if self.max_match < self.max_ngram:
            raise ValueError(f"lookup.max_match ({self.max_match}) must be >= max_ngram ({self.max_ngram})")
        for name in ("min_value", "skip_model_above", "chain_min_joint"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"lookup.{name} must lie in (0, 1], got {value!r}")
        if self.copy_context_gain < 0:
            raise ValueError(f"lookup.copy_context_gain must be >= 0, got {self.copy_context_gain!r}")
        if self.session_prior <= 0 or self.pooled_prior <= 0:
            raise ValueError("lookup.session_prior and pooled_prior must be > 0")
        if not isinstance(self.shared_tokens, int) or self.shared_tokens < 0 or self.shared_tokens == 1:
            raise ValueError(f"lookup.shared_tokens must be 0 (off) or an integer >= 2, got {self.shared_tokens!r}")


class LookupStats:
    """Hit rates per calibration bucket pooled over a drafter's requests: the prior of each new request's
    calibration (starting from PRIORS, counted as `prior` observations)."""

    def __init__(self, prior: float = 8.0) -> None:
        self.prior = prior
        self.hits = [0.0] * len(PRIORS)
        self.trials = [0.0] * len(PRIORS)

    def mean(self, bucket: int) -> float:
        return (self.hits[bucket] + self.prior * PRIORS[bucket]) / (self.trials[bucket] + self.prior)

    def observe(self, bucket: int, hit: bool) -> None:
        self.hits[bucket] += float(hit)
        self.trials[bucket] += 1.0


class LookupSession:
    """One request's index, calibration and last step's predictions (kept by the drafter across steps)."""

    def __init__(self, settings: LookupSettings, pooled: LookupStats, shared: SharedOutputs | None = None,
                 prediction: Sequence[int] = ()) -> None:
        self.settings = settings
        self.pooled = pooled
        self.shared = shared  # other requests' recent outputs (None: off)
        # the request's predicted output (None: it sent none)
        self.prediction = (PredictedOutput(prediction, settings.max_ngram, settings.max_match)
                           if prediction else None)
        self.index = SuffixIndex(settings.max_ngram)
        self.first_context = -1  # context length at the first sync: where this request's output starts
        self.hits = [0.0] * len(PRIORS)
        self.trials = [0.0] * len(PRIORS)
        # path after the root (tuple of tokens) -> (candidate tokens, bucket) of the last step, scored when the
        # next step shows what the target emitted there
        self._predictions: dict[tuple[int, ...], tuple[frozenset[int], int]] = {}
        self._predicted_at = -1  # len(index) when the predictions were made
        self._root_state: LookupState | None = None
        self.observed = 0  # predictions scored so far (tests, stats)

    # ------------------------------------------------------------------ per step
    def sync(self, context: Sequence[int]) -> None:
        """Catch up with `context` (prompt + emitted tokens, the last one the next root): score the previous
        step's predictions on the tokens emitted since, and index the new tokens. A context that does not
        extend what was indexed rebuilds the index."""
        held = len(self.index)
        if self.first_context < 0:
            self.first_context = len(context)
        if held > len(context) or (held and context[held - 1] != self.index.tokens[-1]):
            self.index = SuffixIndex(self.settings.max_ngram)
            self._predictions, held = {}, 0
            self.first_context = min(self.first_context, len(context))
        if self._predictions and self._predicted_at == held:
            emitted = list(context[held:])
            for i, token in enumerate(emitted):  # emitted[:i] is an accepted path (i = 0: the root)
                pred = self._predictions.get(tuple(emitted[:i]))
                if pred is not None:
                    self.observe(pred[1], token in pred[0])
        self._predictions = {}
        if len(context) > held:
            self.index.extend(context[held:])
            self._root_state = None
            if self.prediction is not None:
                self._follow_prediction(held)
        self._predicted_at = len(self.index)

    def _follow_prediction(self, held: int) -> None:
        """Move the prediction's position over the tokens indexed after the first `held` (0: the session
        starts, or was rebuilt: placed afresh)."""
        if held == 0:
            self.prediction.restart(self.tail())
            return
        toks, span = self.index.tokens, self.settings.max_match + 1
        for end in range(held + 1, len(toks) + 1):
            self.prediction.advance(toks[end - 1], toks[max(0, end - span):end])

    @property
    def follows_prediction(self) -> bool:
        """Whether the output stands at a known place in the request's predicted output and drafts from it."""
        return self.root_state().origin == Origin.PREDICTED

    @property
    def plan_nodes(self) -> int:
        """Nodes of a lookup-only tree this request considers per step."""
        s = self.settings
        return s.plan_nodes if self.prediction is None else max(s.plan_nodes, s.prediction_plan_nodes)

    def observe(self, bucket: int, hit: bool) -> None:
        self.hits[bucket] += float(hit)
        self.trials[bucket] += 1.0
        self.pooled.observe(bucket, hit)
        self.observed += 1

    def hit_rate(self, bucket: int) -> float:
        """Calibrated P(the target's next token is a candidate | bucket): this request's Beta posterior."""
        k = self.settings.session_prior
        return (self.hits[bucket] + k * self.pooled.mean(bucket)) / (self.trials[bucket] + k)

    def output(self) -> list[int]:
        """The tokens this request generated so far (from the last token of its first synced context on: the
        prompt's last token or the first generated one; what the shared outputs index when it ends)."""
        return self.index.tokens[max(0, self.first_context - 1):]

    def predict(self, path: tuple[int, ...], row: LookupRow) -> None:
        """Remember a node's candidates, scored at the next `sync` if the node lies on the accepted path."""
        self._predictions[path] = (frozenset(row.tokens), row.bucket)

    def adopt(self, predictions: dict[tuple[int, ...], tuple[frozenset[int], int]]) -> None:
        """Take a tree drafted ahead as this step's (`AheadLookup.predictions`, paths after the current root), in
        place of the predictions made for the context since synced: scored at the next `sync` like its own."""
        self._predictions = dict(predictions)
        self._predicted_at = len(self.index)

    # ------------------------------------------------------------------ matching
    def tail(self, path: Sequence[int] = ()) -> list[int]:
        """The indexed tokens' last max_match + 1, then `path`: enough to measure any match."""
        return self.index.tokens[-(self.settings.max_match + 1):] + list(path)

    def root_state(self) -> LookupState:
        if self._root_state is None:
            self._root_state = self._match(self.tail(), at_root=True)
        return self._root_state

    def state_after(self, path: Sequence[int]) -> LookupState:
        """The state of a node `path` tokens past the root, measured afresh (the tokens are not indexed)."""
        return self._match(self.tail(path))

    def _match(self, tail: Sequence[int], at_root: bool = False) -> LookupState:
        """The state whose best candidate is the most probable under the calibration (SuffixDecoding scores
        its trees' candidates and keeps the better) among: the prediction's position (the tracked one
        `at_root`, else found from `tail`), the longest match of `tail` in this request's tokens and, with
        shared outputs, the longest there (of at least shared_min_match tokens). Ties go to the prediction,
        then to the request's own tokens."""
        s = self.settings
        found = []
        if self.prediction is not None:
            found.append(self.prediction.root_state() if at_root else self.prediction.state(tail))
        length, positions = self.index.longest_match(tail, s.max_positions, s.max_match)
        found.append(LookupState(length, positions) if positions else NO_MATCH)
        if self.shared is not None and length < s.max_match:
            index = self.shared.index
            length, positions = index.longest_match(tail, s.max_positions, s.max_match)
            if positions and length >= s.shared_min_match:
                found.append(LookupState(length, positions, index, Origin.SHARED))
        found = [state for state in found if state.positions]
        if len(found) < 2:  # nothing to weigh (most nodes of a request without shared outputs or a prediction)
            return found[0] if found else NO_MATCH
        best, best_value = NO_MATCH, 0.0
        for state in found:
            if (value := self.row(state).values[0]) > best_value:
                best, best_value = state, value
        return best

    def child_state(self, state: LookupState, token: int, path: Sequence[int]) -> LookupState:
        """The state after appending `token` to a node's sequence in `state` (`path`: the root path including
        `token`): its occurrences that continue with `token` (and have a continuation), or a fresh match when
        none does."""
        toks = (state.index or self.index).tokens
        last = len(toks) - 1
        kept = tuple(p + 1 for p in state.positions
                     if p + 1 < last and toks[p + 1] == token and toks[p + 2] != SEPARATOR)
        if kept:
            return LookupState(min(state.length + 1, self.settings.max_match), kept, state.index, state.origin)
        return self._match(self.tail(path))

    def row(self, state: LookupState) -> LookupRow | None:
        """The candidates of a node in `state`, or None without a match."""
        if not state.positions:
            return None
        toks = (state.index or self.index).tokens
        counts = Counter(toks[p + 1] for p in state.positions)
        bucket = match_bucket(state.length, state.origin)
        scale = self.hit_rate(bucket) / len(state.positions)
        ranked = counts.most_common(self.settings.max_branches)
        values = tuple(scale * c for _, c in ranked)
        return LookupRow(tuple(t for t, _ in ranked), values, sum(values), bucket, state.length)


class AheadLookup:
    """A session's lookup as it would stand after `prefix` (the tokens a guessed accepted path and bonus token add
    past the synced root) for a tree drafted ahead (engine/drafters/run_ahead.py), without indexing them or
    touching the session: the prefix's tokens are matched against the indexed ones (a copy of a span the prefix
    itself starts is missed until the guess comes true). Its nodes' predictions are kept here, keyed by path after
    the ahead tree's root, for `LookupSession.adopt` when the guess comes true."""

    def __init__(self, session: LookupSession, prefix: Sequence[int]) -> None:
        self.session = session
        self.settings = session.settings
        self.prefix = tuple(prefix)
        self.predictions: dict[tuple[int, ...], tuple[frozenset[int], int]] = {}
        self._root_state: LookupState | None = None

    def root_state(self) -> LookupState:
        if self._root_state is None:
            self._root_state = self.session.state_after(self.prefix)
        return self._root_state

    def child_state(self, state: LookupState, token: int, path: Sequence[int]) -> LookupState:
        return self.session.child_state(state, token, self.prefix + tuple(path))

    def row(self, state: LookupState) -> LookupRow | None:
        return self.session.row(state)

    def hit_rate(self, bucket: int) -> float:
        return self.session.hit_rate(bucket)

    def predict(self, path: tuple[int, ...], row: LookupRow) -> None:
        self.predictions[path] = (frozenset(row.tokens), row.bucket)


class LookupSources:
    """A drafter's lookup sessions (LRU-bounded), their pooled calibration and settings, and the shared output
    indexes: one per cache scope (a tenant: engine/requests.py `GenerationRequest.cache_scope`), so a request
    drafts only from outputs of its own tenant, and its speed reveals nothing of another's (the scopes kept are
    LRU-bounded like the sessions)."""

    def __init__(self, settings: LookupSettings | None = None) -> None:
        self.settings = settings or LookupSettings()
        self.pooled = LookupStats(self.settings.pooled_prior)
        self._shared: OrderedDict[str, SharedOutputs] = OrderedDict()
        self._sessions: OrderedDict[str, LookupSession] = OrderedDict()

    def shared(self, scope: str = "") -> SharedOutputs | None:
        """The scope's index of recent outputs (None when the settings keep none)."""
        if not self.settings.shared_tokens:
            return None
        index = self._shared.pop(scope, None)
        if index is None:
            index = SharedOutputs(self.settings.shared_tokens, self.settings.max_ngram)
            while len(self._shared) >= self.settings.shared_scopes:
                self._shared.popitem(last=False)
        self._shared[scope] = index
        return index

    def session(self, session_id: str, context: Sequence[int], scope: str = "", greedy: bool = True,
                prediction: Sequence[int] = ()) -> LookupSession:
        """The session synced with `context` (created on first use, drafting from `scope`'s shared outputs when
        `greedy`: a sampled output depends on the trees it was verified on, so a seeded request must not draft from
        what earlier requests left behind, or the same seed would give another sample; and from the request's
        `prediction` of its output, if it sent one)."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            session = LookupSession(self.settings, self.pooled, self.shared(scope) if greedy else None, prediction)
            while len(self._sessions) >= self.settings.max_sessions:
                self._finish(self._sessions.popitem(last=False)[1])
        self._sessions[session_id] = session
        session.sync(context)
        return session

    def session_ids(self) -> list[str]:
        """The sessions held, least recently used first."""
        return list(self._sessions)

    def get(self, session_id: str) -> LookupSession | None:
        """The session as last synced (no sync, no use recorded), if there is one."""
        return self._sessions.get(session_id)

    def release(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._finish(session)
        return True

    def _finish(self, session: LookupSession) -> None:
        """A session ends (released, or dropped as least recently used): its output joins its scope's shared
        outputs."""
        if session.shared is not None:
            session.shared.add(session.output())

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions
