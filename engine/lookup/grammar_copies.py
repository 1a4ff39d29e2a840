"""A request's grammar over its copy sources (issue 59 item 2): copies cut where the grammar refuses them, and the
text it forces drafted as copies. Overview: engine/lookup/.

Structured output masks the target's row at every tree node with the grammar's state after that node's path
(engine/grammar/matchers.py), so a copied candidate the grammar refuses there is a node the target gives
probability 0: `GrammarCopies` drops it from the node's candidates, which cuts the copy branch at its first refused
token (the nodes below it are never proposed).

Where the grammar allows one text only (a JSON key and its `": "`, a closing brace, the rest of the one enum value
left), xgrammar's `GrammarMatcher.find_jump_forward_string` gives it (SGLang's and TensorRT-LLM's jump-forward
decoding). Tokenized the model's way, it becomes a chain of copies from the node, a source of its own
(`Origin.FORCED`) calibrated like the others in buckets by how many forced tokens are left (the last is the one
most likely tokenized otherwise by the model, whose token may run on into the free text after it). A forced chain
costs no drafter forward: a hybrid oracle gives its nodes no model row, and the model drafts again from its end
(engine/drafters/hybrid_oracle.py). The budget chooser sees forced chains in the lookup-only plan's gains, as any
copy. Every forced or kept candidate is a deterministic function of the request's context, and the target
verifies it under its own mask: the output never changes.

`GrammarCopies` stands where a `LookupSession` (or an `AheadLookup`) does for the tree builders, the lookup-only
plan and the batched copy chains, and asks a `DraftGrammar` (the drafter's matchers for one step:
engine/grammar/drafts.py) about paths below the step's root.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol, Sequence

from .session import AheadLookup, LookupSession, match_bucket
from .suffix_index import LookupRow, LookupState, Origin


class DraftGrammar(Protocol):
    """A request's grammar at paths below one step's root (a path: the tokens after the root)."""

    def allowed(self, path: Sequence[int], tokens: Sequence[int]) -> frozenset[int]:
        """Which of `tokens` the grammar allows after `path`."""
        ...

    def forced(self, path: Sequence[int]) -> tuple[int, ...]:
        """The tokens of the text the grammar forces after `path` (the model's tokenization, cut at the first
        token the grammar refuses), () where it forces nothing."""
        ...


class GrammarCopies:
    """A lookup session seen through a request's grammar: its states carry what the grammar forces and allows
    there, its rows keep only the allowed candidates, or hold the next forced token."""

    def __init__(self, session: LookupSession | AheadLookup, grammar: DraftGrammar) -> None:
        self.session = session
        self.settings = session.settings
        self.grammar = grammar
        self._root: LookupState | None = None

    def root_state(self) -> LookupState:
        if self._root is None:
            self._root = self._at(self.session.root_state(), ())
        return self._root

    def child_state(self, state: LookupState, token: int, path: Sequence[int]) -> LookupState:
        inner = self.session.child_state(state, token, path)
        if state.forced[1:] and state.forced[0] == token:  # along a forced chain: the rest of it
            return self._at(inner, path, state.forced[1:])
        return self._at(inner, path)

    def row(self, state: LookupState) -> LookupRow | None:
        """The next forced token where the grammar forces text (its calibrated hit rate by the forced tokens
        left), else the match's candidates the grammar allows (None when it allows none)."""
        if state.forced:
            bucket = match_bucket(len(state.forced), Origin.FORCED)
            value = self.session.hit_rate(bucket)
            return LookupRow((state.forced[0],), (value,), value, bucket, len(state.forced))
        row = self.session.row(state)
        if row is None or state.allowed is None or state.allowed.issuperset(row.tokens):
            return row
        kept = [(t, v) for t, v in zip(row.tokens, row.values) if t in state.allowed]
        if not kept:
            return None
        values = tuple(v for _, v in kept)
        return LookupRow(tuple(t for t, _ in kept), values, sum(values), row.bucket, row.length)

    def predict(self, path: tuple[int, ...], row: LookupRow) -> None:
        self.session.predict(path, row)

    def _at(self, inner: LookupState, path: Sequence[int], forced: tuple[int, ...] | None = None) -> LookupState:
        """`inner` with the grammar's view at `path`: the forced tokens (`forced` when known), else the match's
        candidates it allows."""
        if forced is None:
            forced = self.grammar.forced(path)
        if forced:
            return replace(inner, forced=forced, allowed=None)
        row = self.session.row(inner)
        allowed = self.grammar.allowed(path, row.tokens) if row is not None else frozenset()
        return replace(inner, forced=(), allowed=allowed)
