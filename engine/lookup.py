"""Copy-from-context drafting: a draft source with no model, and the hybrid oracle that merges its candidates
with a model drafter's distributions in one dynamic token tree.

Answers often copy their prompt (summaries, extraction, retrieval-augmented answers, code edits) or repeat
themselves. Prompt lookup decoding (Saxena 2023; transformers' `PromptLookupCandidateGenerator`, vLLM's n-gram
proposer) drafts by matching the sequence's last n-gram in the context and copying what followed;
SuffixDecoding (Oliaro et al. 2024, arXiv:2411.04975; ArcticInference's suffix trees) matches the longest
suffix, counts every continuation of the match and expands the most probable ones into a tree. Here:

- `SuffixIndex`: every n-gram (n <= max_ngram) of the request's tokens (prompt + output) maps to the positions
  where it ends, extended in O(max_ngram) per appended token, never rescanned. A match longer than max_ngram
  is measured by extending it backwards at each occurrence, and a tree path that keeps copying carries its
  occurrences along (`LookupState`: the end positions of the longest match, shifted by one per copied token),
  so match lengths are exact along copy chains. Continuations of the longest match, counted over its
  occurrences (SuffixDecoding's counts), are the node's candidates (`LookupRow`).
- Probabilities: a candidate's probability is P(the target's next token is one of the candidates | match
  length) times its share of the counts. That probability is calibrated online per request from what the
  target actually emitted after each node of an accepted path (a Beta posterior per match-length bucket),
  with a prior pooled over the drafter's earlier requests (`LookupStats`), itself starting from a fixed
  prior. Builders then weigh lookup candidates against model drafts on one scale.
- `HybridOracle`: a DraftOracle whose rows are the mixture (1 - w) q + c, q the model drafter's row and c the
  lookup candidates' probabilities (w = sum c): the top-k builders (EAGLE-2, OPT-Tree, C2T, DySpec at T = 0,
  chains) rank merged candidates with no change (shared prefixes are merged by construction: a token both
  sources propose is one child). Nodes whose continuation the lookup knows confidently, and everything below
  them, get no model row at all (the drafter forward is skipped there). Sampled builders (DySpec, SpS chains
  at T > 0) add lookup candidates as deterministic children first and sample the model's children from q
  without those tokens; the verifier applies the point-mass rule to the former (engine/verify.py).
- `LookupPlan`: the lookup-only tree, best-first by path probability (SuffixDecoding's tree expansion), whose
  cumulative values are the expected accepted tokens the hardware-aware chooser prices a step without the
  model drafter by (engine/budget.py).

Every lookup candidate is a deterministic function of the context, so verification stays lossless.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from treeserve.engine.builders.base import RowSummary
from treeserve.engine.c2t_classifier import top_entropy
from treeserve.engine.sampling import topk_rows
from treeserve.engine.tree import ChildDraw, Source, TokenTree

# Lower edges of the match-length buckets the calibration keeps, and the probability each starts from that
# the target's next token is one of the candidates (rising with the match length, as prompt lookup's n-gram
# size and SuffixDecoding's max_spec_factor assume).
MATCH_BUCKETS = (1, 2, 3, 4, 6, 10, 16, 32)
PRIOR_HIT = (0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.8)


def match_bucket(length: int) -> int:
    return max(0, bisect.bisect_right(MATCH_BUCKETS, length) - 1)


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
    pooled_prior: float = field(default=8.0, metadata={"help": "observations PRIOR_HIT counts as in the pooled calibration"})
    chain_min_joint: float = field(default=0.3, metadata={"help": "batched steps: a lookup chain stops below this path probability"})
    max_sessions: int = field(default=256, metadata={"help": "sessions whose index is kept (least recently used dropped)"})

    def __post_init__(self) -> None:
        for name in ("max_ngram", "max_positions", "max_match", "max_branches", "plan_nodes", "max_sessions"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"lookup.{name} must be an integer >= 1, got {value!r}")
        if self.max_match < self.max_ngram:
            raise ValueError(f"lookup.max_match ({self.max_match}) must be >= max_ngram ({self.max_ngram})")
        for name in ("min_value", "skip_model_above", "chain_min_joint"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"lookup.{name} must lie in (0, 1], got {value!r}")
        if self.session_prior <= 0 or self.pooled_prior <= 0:
            raise ValueError("lookup.session_prior and pooled_prior must be > 0")


class SuffixIndex:
    """The n-grams of a growing token sequence, each mapped to the positions where it ends (ascending)."""

    def __init__(self, max_ngram: int = 4) -> None:
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens: each adds its position under the <= max_ngram n-grams ending there."""
        toks, ends, size = self.tokens, self._ends, self.max_ngram
        for token in tokens:
            toks.append(int(token))
            end = len(toks) - 1
            for start in range(end, max(-1, end - size), -1):
                key = tuple(toks[start:end + 1])
                hit = ends.get(key)
                if hit is None:
                    ends[key] = [end]
                else:
                    hit.append(end)

    def longest_match(self, tail: Sequence[int], max_positions: int, max_match: int) -> tuple[int, tuple[int, ...]]:
        """The longest suffix of `tail` (a sequence ending in a query position: the context's last tokens plus a
        tree path) that occurs in the indexed tokens followed by at least one more token: (its length, up to
        max_positions of the most recent positions where it ends), or (0, ()) if not even the last token occurs
        with a continuation. Lengths past max_ngram are measured per occurrence (up to max_match)."""
        toks, ends_of = self.tokens, self._ends
        last = len(toks) - 1  # a match ending here has no continuation
        # Growing n: an n-gram with an occurrence followed by a token has such an occurrence of its (n-1)-suffix,
        # so the search stops at the first n without one (most tree nodes match 0-3 tokens: 1-4 lookups).
        length, found = 0, []
        for n in range(1, min(self.max_ngram, len(tail)) + 1):
            ends = ends_of.get(tuple(tail[len(tail) - n:]))
            valid = [p for p in ends[-(max_positions + 1):] if p < last][-max_positions:] if ends else None
            if not valid:
                break
            length, found = n, valid
        if length < self.max_ngram:
            return length, tuple(found)
        best, keep = 0, []
        for p in found:  # every occurrence matches max_ngram tokens: measure how far back each goes
            n = length
            while n < max_match and n < len(tail) and p - n >= 0 and tail[len(tail) - 1 - n] == toks[p - n]:
                n += 1
            if n > best:
                best, keep = n, [p]
            elif n == best:
                keep.append(p)
        return best, tuple(keep)


@dataclass(frozen=True)
class LookupState:
    """Where a node's sequence (context + root path) matches the indexed tokens: the match length and the end
    positions of its occurrences (each followed by a continuation); length 0 = no match."""

    length: int
    positions: tuple[int, ...]


@dataclass(frozen=True)
class LookupRow:
    """A node's copy-from-context candidates: tokens by descending probability, their calibrated probabilities
    (`values`), their sum `total` (= w) and the match-length bucket that calibrated them."""

    tokens: tuple[int, ...]
    values: tuple[float, ...]
    total: float
    bucket: int
    length: int


NO_MATCH = LookupState(0, ())


class LookupStats:
    """Hit rates per match-length bucket pooled over a drafter's requests: the prior of each new request's
    calibration (starting from PRIOR_HIT, counted as `prior` observations)."""

    def __init__(self, prior: float = 8.0) -> None:
        self.prior = prior
        self.hits = [0.0] * len(MATCH_BUCKETS)
        self.trials = [0.0] * len(MATCH_BUCKETS)

    def mean(self, bucket: int) -> float:
        return (self.hits[bucket] + self.prior * PRIOR_HIT[bucket]) / (self.trials[bucket] + self.prior)

    def observe(self, bucket: int, hit: bool) -> None:
        self.hits[bucket] += float(hit)
        self.trials[bucket] += 1.0


class LookupSession:
    """One request's index, calibration and last step's predictions (kept by the drafter across steps)."""

    def __init__(self, settings: LookupSettings, pooled: LookupStats) -> None:
        self.settings = settings
        self.pooled = pooled
        self.index = SuffixIndex(settings.max_ngram)
        self.hits = [0.0] * len(MATCH_BUCKETS)
        self.trials = [0.0] * len(MATCH_BUCKETS)
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
        if held > len(context) or (held and context[held - 1] != self.index.tokens[-1]):
            self.index = SuffixIndex(self.settings.max_ngram)
            self._predictions, held = {}, 0
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
        self._predicted_at = len(self.index)

    def observe(self, bucket: int, hit: bool) -> None:
        self.hits[bucket] += float(hit)
        self.trials[bucket] += 1.0
        self.pooled.observe(bucket, hit)
        self.observed += 1

    def hit_rate(self, bucket: int) -> float:
        """Calibrated P(the target's next token is a candidate | bucket): this request's Beta posterior."""
        k = self.settings.session_prior
        return (self.hits[bucket] + k * self.pooled.mean(bucket)) / (self.trials[bucket] + k)

    def predict(self, path: tuple[int, ...], row: LookupRow) -> None:
        """Remember a node's candidates, scored at the next `sync` if the node lies on the accepted path."""
        self._predictions[path] = (frozenset(row.tokens), row.bucket)

    # ------------------------------------------------------------------ matching
    def tail(self, path: Sequence[int] = ()) -> list[int]:
        """The indexed tokens' last max_match + 1, then `path`: enough to measure any match."""
        return self.index.tokens[-(self.settings.max_match + 1):] + list(path)

    def root_state(self) -> LookupState:
        if self._root_state is None:
            s = self.settings
            self._root_state = LookupState(*self.index.longest_match(self.tail(), s.max_positions, s.max_match))
        return self._root_state

    def child_state(self, state: LookupState, token: int, path: Sequence[int]) -> LookupState:
        """The state after appending `token` to a node's sequence in `state` (`path`: the root path including
        `token`): its occurrences that continue with `token`, or a fresh match when none does."""
        toks = self.index.tokens
        last = len(toks) - 1
        kept = tuple(p + 1 for p in state.positions if toks[p + 1] == token and p + 1 < last)
        if kept:
            return LookupState(min(state.length + 1, self.settings.max_match), kept)
        s = self.settings
        length, positions = self.index.longest_match(self.tail(path), s.max_positions, s.max_match)
        return LookupState(length, positions) if positions else NO_MATCH

    def row(self, state: LookupState) -> LookupRow | None:
        """The candidates of a node in `state`, or None without a match."""
        if not state.positions:
            return None
        toks = self.index.tokens
        counts = Counter(toks[p + 1] for p in state.positions)
        bucket = match_bucket(state.length)
        scale = self.hit_rate(bucket) / len(state.positions)
        ranked = counts.most_common(self.settings.max_branches)
        values = tuple(scale * c for _, c in ranked)
        return LookupRow(tuple(t for t, _ in ranked), values, sum(values), bucket, state.length)


class LookupSources:
    """A drafter's lookup sessions (LRU-bounded), their pooled calibration and settings."""

    def __init__(self, settings: LookupSettings | None = None) -> None:
        self.settings = settings or LookupSettings()
        self.pooled = LookupStats(self.settings.pooled_prior)
        self._sessions: OrderedDict[str, LookupSession] = OrderedDict()

    def session(self, session_id: str, context: Sequence[int]) -> LookupSession:
        """The session synced with `context` (created on first use)."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            session = LookupSession(self.settings, self.pooled)
            while len(self._sessions) >= self.settings.max_sessions:
                self._sessions.popitem(last=False)
        self._sessions[session_id] = session
        session.sync(context)
        return session

    def release(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions


# ---------------------------------------------------------------------------------------------- lookup-only
@dataclass
class LookupPlan:
    """The lookup-only tree of one step, best-first by path probability (values never grow along a path, so
    every prefix of the order is a tree, and the best n-node tree of this source: SuffixDecoding's expansion).
    Node 0 is the root."""

    tokens: list[int]
    parents: list[int]
    values: list[float]  # path probability of each node (root 1.0)

    @property
    def size(self) -> int:
        """Draft nodes planned (root excluded)."""
        return len(self.tokens) - 1

    def gains(self) -> list[float]:
        """gains[n - 1]: expected accepted tokens of the first n draft nodes (the sum of their path
        probabilities, OPT-Tree's E(A))."""
        out, total = [], 0.0
        for value in self.values[1:]:
            total += value
            out.append(total)
        return out

    def tree(self, nodes: int, greedy: bool) -> TokenTree:
        """The first `nodes` draft nodes as a TokenTree: deterministic children (point-mass rule), every one a
        LOOKUP node."""
        n = min(nodes, self.size) + 1
        draw = ChildDraw.GREEDY if greedy else ChildDraw.TOP_K
        joint = [0.0] + [math.log(v) for v in self.values[1:n]]
        return TokenTree._trusted(
            torch.tensor(self.tokens[:n], dtype=torch.long), torch.tensor(self.parents[:n], dtype=torch.long),
            torch.full((n,), int(draw), dtype=torch.uint8), torch.tensor(joint, dtype=torch.float32), None, None,
            torch.tensor([0] + [int(Source.LOOKUP)] * (n - 1), dtype=torch.uint8) if n > 1 else None)


def plan_lookup(session: LookupSession, root_token: int, max_nodes: int, min_value: float) -> LookupPlan:
    """Best-first lookup-only tree of up to `max_nodes` draft nodes with path probability >= min_value; every
    expanded node's candidates are remembered for calibration."""
    tokens, parents, values = [root_token], [-1], [1.0]
    states = [session.root_state()]
    paths: list[tuple[int, ...]] = [()]
    heap: list[tuple[float, int, int, int]] = []  # (-value, seq, parent, token)
    seq = 0

    def expand(node: int) -> None:
        nonlocal seq
        row = session.row(states[node])
        if row is None:
            return
        session.predict(paths[node], row)
        for token, c in zip(row.tokens, row.values):
            value = values[node] * c
            if value >= min_value:
                seq += 1
                heapq.heappush(heap, (-value, seq, node, token))

    expand(0)
    while heap and len(tokens) <= max_nodes:
        neg, _, parent, token = heapq.heappop(heap)
        path = paths[parent] + (token,)
        tokens.append(token)
        parents.append(parent)
        values.append(-neg)
        paths.append(path)
        states.append(session.child_state(states[parent], token, path))
        expand(len(tokens) - 1)
    return LookupPlan(tokens, parents, values)


@dataclass
class LookupTreeBuilder:
    """Method "lookup": drafts copy-from-context candidates only (no model drafter forward): the `budget` most
    probable nodes of the lookup-only plan (`plan_lookup`); needs a HybridOracle (the LocalDrafter makes one)."""

    budget: int = 16
    min_value: float = 0.02

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or self.budget < 1:
            raise ValueError(f"budget must be an integer >= 1, got {self.budget!r}")

    def build(self, root_token: int, oracle, sampling, generator) -> TokenTree:  # type: ignore[no-untyped-def]
        plan_of = getattr(oracle, "plan", None)
        if plan_of is None:
            raise ValueError("the lookup method drafts from a HybridOracle (copy-from-context candidates)")
        return plan_of(root_token, self.budget, self.min_value).tree(self.budget, sampling.is_greedy)


# ---------------------------------------------------------------------------------------------- hybrid oracle
class _Node:
    __slots__ = ("state", "row", "path", "model", "top1")

    def __init__(self, state: LookupState, row: LookupRow | None, path: tuple[int, ...], model: bool) -> None:
        self.state, self.row, self.path, self.model = state, row, path, model
        self.top1 = -1  # the model's most probable next token, once its row was read


class HybridOracle:
    """DraftOracle (with `summarize`) over a model oracle and a LookupSession: rows are (1 - w) q + c where the
    node has lookup candidates c (w = sum c), q alone where it has none, c alone where the model gives no row
    (`model_backed` False: the model is off this step, or an ancestor or the node itself has a lookup candidate
    at least `skip_model_above` probable). Also `lookup`, `model_backed`, `model_probs` (sampled builders),
    `source_of` (PartialTree labels children) and `plan` (lookup-only trees)."""

    def __init__(self, model, session: LookupSession, vocab_size: int, model_enabled: bool = True,
                 head_index: dict[int, int] | None = None) -> None:
        self.model = model  # a DraftOracle, or None for lookup-only drafting
        self.session = session
        self.settings = session.settings
        self.vocab_size = vocab_size
        self.model_enabled = model_enabled and model is not None
        self._head_index = head_index  # target id -> row of the model's head (a SessionOracle with vocab_ids)
        self._nodes: dict[int, _Node] = {}

    # ------------------------------------------------------------------ lookup side
    def _node(self, tokens: Sequence[int], parents: Sequence[int], node: int) -> _Node:
        info = self._nodes.get(node)
        if info is not None:
            return info
        pending = []
        while node not in self._nodes and node > 0:
            pending.append(node)
            node = parents[node]
        if 0 not in self._nodes:
            state = self.session.root_state()
            self._nodes[0] = self._make(state, (), self.model_enabled, root=True)
        for n in reversed(pending):
            parent = self._nodes[parents[n]]
            path = parent.path + (tokens[n],)
            state = self.session.child_state(parent.state, tokens[n], path)
            self._nodes[n] = self._make(state, path, parent.model)
        return self._nodes[pending[0] if pending else 0]

    def _make(self, state: LookupState, path: tuple[int, ...], model: bool, root: bool = False) -> _Node:
        row = self.session.row(state)
        if row is not None:
            self.session.predict(path, row)
            if not root and row.values[0] >= self.settings.skip_model_above:
                model = False
        return _Node(state, row, path, model)

    def lookup(self, tokens: Sequence[int], parents: Sequence[int], node: int) -> LookupRow | None:
        return self._node(tokens, parents, node).row

    def model_backed(self, tokens: Sequence[int], parents: Sequence[int], node: int) -> bool:
        return self._node(tokens, parents, node).model

    def source_of(self, parent: int, token: int) -> int:
        """Source of a child `token` of `parent` (a node this oracle has seen)."""
        info = self._nodes.get(parent)
        if info is None or info.row is None or token not in info.row.tokens:
            return int(Source.MODEL)
        return int(Source.BOTH) if info.top1 == token else int(Source.LOOKUP)

    def plan(self, root_token: int, max_nodes: int, min_value: float) -> LookupPlan:
        return plan_lookup(self.session, root_token, max_nodes, min_value)

    # ------------------------------------------------------------------ rows
    def _split(self, tokens, parents, node_ids) -> tuple[list[_Node], list[int]]:  # type: ignore[no-untyped-def]
        infos = [self._node(tokens, parents, n) for n in node_ids]
        return infos, [n for n, info in zip(node_ids, infos) if info.model]

    def model_probs(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int]) -> Tensor:
        """The model drafter's own rows [k, V] (model-backed nodes only)."""
        infos, backed = self._split(tokens, parents, node_ids)
        if len(backed) != len(node_ids):
            raise ValueError("model_probs: a node without a model row (lookup-only)")
        rows = self.model.probs(tokens, parents, node_ids)
        for info, row in zip(infos, rows):
            info.top1 = int(row.argmax())
        return rows

    def probs(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int]) -> Tensor:
        """Mixed rows [k, V] (see the class docstring); a lookup-only row sums to w < 1."""
        infos, backed = self._split(tokens, parents, node_ids)
        model_rows = dict(zip(backed, self.model_probs(tokens, parents, backed).unbind(0))) if backed else {}
        out = []
        for node, info in zip(node_ids, infos):
            row = model_rows.get(node)
            if row is None:
                mixed = torch.zeros(self.vocab_size)
            elif info.row is None:
                out.append(row)
                continue
            else:
                mixed = row.float() * (1.0 - info.row.total)
            if info.row is not None:
                mixed[list(info.row.tokens)] += torch.tensor(info.row.values, dtype=mixed.dtype)
            out.append(mixed)
        return torch.stack(out)

    def summarize(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int], k: int,
                  entropy: bool) -> RowSummary:
        """Top-k (and the C2T entropy) of the mixed rows, summarised on the model's head where it has one."""
        infos, backed = self._split(tokens, parents, node_ids)
        count = len(node_ids)
        values = torch.zeros(count, k)
        toks = torch.zeros(count, k, dtype=torch.long)
        ent = torch.zeros(count) if entropy else None
        model_summary = self._model_summary(tokens, parents, backed, k, entropy) if backed else None
        j = 0
        for i, info in enumerate(infos):
            if info.model:
                values[i], toks[i] = model_summary.values[j], model_summary.tokens[j]
                if ent is not None:
                    ent[i] = model_summary.entropy[j]
                j += 1
            elif info.row is not None:
                m = min(k, len(info.row.tokens))
                values[i, :m] = torch.tensor(info.row.values[:m])
                toks[i, :m] = torch.tensor(info.row.tokens[:m])
                if ent is not None:
                    ent[i] = -sum(c * math.log(c) for c in info.row.values if c > 0)
        return RowSummary(values, toks, ent)

    def _model_summary(self, tokens, parents, nodes: list[int], k: int, entropy: bool) -> RowSummary:  # type: ignore[no-untyped-def]
        infos = [self._nodes[n] for n in nodes]
        fast = self._head_rows(tokens, parents, nodes)
        if fast is None:  # any oracle: mix the full rows, summarise them
            mixed = self.probs(tokens, parents, nodes)
            vals, toks = topk_rows(mixed, k)
            return RowSummary(vals, toks, top_entropy(mixed) if entropy else None)
        head, runner = fast
        index = self._head_index
        extras: dict[int, list[tuple[float, int]]] = {}
        for i, info in enumerate(infos):
            if info.row is None:
                continue
            head[i].mul_(1.0 - info.row.total)
            for token, c in zip(info.row.tokens, info.row.values):
                j = token if index is None else index.get(token, -1)
                if j >= 0:
                    head[i, j] += c
                else:  # outside the drafter's head: q = 0 there, the mixed value is c
                    extras.setdefault(i, []).append((c, token))
        width = k + max((len(e) for e in extras.values()), default=0)
        summary = runner.summarize(head, width, entropy)
        if not extras:
            return summary if width == k else RowSummary(summary.values[:, :k], summary.tokens[:, :k], summary.entropy)
        vals, toks = summary.values[:, :k].clone(), summary.tokens[:, :k].clone()
        ent = summary.entropy
        for i, extra in extras.items():
            merged = sorted(list(zip(summary.values[i].tolist(), summary.tokens[i].tolist())) + extra,
                            key=lambda vt: -vt[0])[:k]
            vals[i] = torch.tensor([v for v, _ in merged])
            toks[i] = torch.tensor([t for _, t in merged])
            if ent is not None:  # their terms join the head's top-1000 entropy (exact up to that cut)
                ent[i] += -sum(c * math.log(c) for c, _ in extra if c > 0)
        return RowSummary(vals, toks, ent)

    def _head_rows(self, tokens, parents, nodes: list[int]):  # type: ignore[no-untyped-def]
        """([n, V_draft] copies of the model's head rows, its runner) for a SessionOracle, else None; records
        each node's model top-1 (for BOTH labels)."""
        from treeserve.engine.drafters.model_runner import SessionOracle

        model = self.model
        if not isinstance(model, SessionOracle):
            return None
        model._feed(tokens, parents, nodes)
        head = torch.stack([model.rows[n] for n in nodes])
        top1 = head.argmax(dim=1)
        ids = model.runner.vocab_ids
        if ids is not None:
            top1 = ids[top1.cpu()]
        for n, t in zip(nodes, top1.tolist()):
            self._nodes[n].top1 = t
        return head, model.runner


def head_index(vocab_ids: Tensor | None) -> dict[int, int] | None:
    """Target token id -> row of a restricted drafter head (`vocab_ids`), None for a full head."""
    return None if vocab_ids is None else {int(t): i for i, t in enumerate(vocab_ids.tolist())}


# ---------------------------------------------------------------------------------------------- chains
def lookup_chain(session: LookupSession, max_length: int, min_joint: float) -> tuple[list[int], list[float]]:
    """The most probable copy chain from the root (top candidate at each node) while its path probability stays
    >= min_joint: (tokens, path probabilities). Batched steps draft it for free next to the model's chain."""
    state = session.root_state()
    path: tuple[int, ...] = ()
    tokens, joints, joint = [], [], 1.0
    while len(tokens) < max_length:
        row = session.row(state)
        if row is None:
            break
        session.predict(path, row)
        joint *= row.values[0]
        if joint < min_joint:
            break
        token = row.tokens[0]
        tokens.append(token)
        joints.append(joint)
        path = path + (token,)
        state = session.child_state(state, token, path)
    return tokens, joints


def merge_chains(root: int, model: Sequence[int], model_log_joint: Sequence[float], lookup: Sequence[int],
                 lookup_joint: Sequence[float], greedy: bool) -> TokenTree:
    """One tree holding a model chain and a lookup chain from the same root, their common prefix shared (a
    shared node is BOTH). Deterministic children everywhere (point-mass rule; GREEDY at temperature 0)."""
    tokens, parents, log_joint, sources = [root], [-1], [0.0], [0]
    shared = 0
    while shared < min(len(model), len(lookup)) and model[shared] == lookup[shared]:
        shared += 1
    for i in range(len(model)):
        tokens.append(model[i])
        parents.append(len(tokens) - 2)
        log_joint.append(float(model_log_joint[i]))
        sources.append(int(Source.BOTH) if i < shared else int(Source.MODEL))
    branch = shared  # node index of the last shared token (0: the root)
    for i in range(shared, len(lookup)):
        tokens.append(lookup[i])
        parents.append(branch)
        log_joint.append(math.log(lookup_joint[i]))
        sources.append(int(Source.LOOKUP))
        branch = len(tokens) - 1
    draw = ChildDraw.GREEDY if greedy else ChildDraw.TOP_K
    return TokenTree.build(tokens, parents, draw, log_joint, sources=sources if any(sources) else None)
