"""The copy-from-context source's index: every n-gram of a request's tokens mapped to where it ends, and what
a tree node's match there looks like (`LookupState`) and proposes (`LookupRow`). Overview: engine/lookup/."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

# Ends one output in an index holding several (engine/lookup/shared_outputs.py): never matched, never a
# continuation, so no match crosses from one request's output into the next.
SEPARATOR = -1


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
                if toks[start] == SEPARATOR:  # no n-gram spans or holds a separator
                    break
                key = tuple(toks[start:end + 1])
                hit = ends.get(key)
                if hit is None:
                    ends[key] = [end]
                else:
                    hit.append(end)

    def ends(self, ngram: Sequence[int]) -> list[int]:
        """Where `ngram` (at most max_ngram tokens) ends in the indexed tokens, ascending."""
        return self._ends.get(tuple(ngram), [])

    def longest_match(self, tail: Sequence[int], max_positions: int, max_match: int) -> tuple[int, tuple[int, ...]]:
        """The longest suffix of `tail` (a sequence ending in a query position: the context's last tokens plus a
        tree path) that occurs in the indexed tokens followed by at least one more token: (its length, up to
        max_positions of the most recent positions where it ends), or (0, ()) if not even the last token occurs
        with a continuation. Lengths past max_ngram are measured per occurrence (up to max_match)."""
        toks, ends_of = self.tokens, self._ends
        last = len(toks) - 1  # a match ending here (or before a SEPARATOR) has no continuation
        # Growing n: an n-gram with an occurrence followed by a token has such an occurrence of its (n-1)-suffix,
        # so the search stops at the first n without one (most tree nodes match 0-3 tokens: 1-4 lookups).
        length, found = 0, []
        for n in range(1, min(self.max_ngram, len(tail)) + 1):
            ends = ends_of.get(tuple(tail[len(tail) - n:]))
            valid = ([p for p in ends[-(max_positions + 1):] if p < last and toks[p + 1] != SEPARATOR][-max_positions:]
                     if ends else None)
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


class Origin(enum.IntEnum):
    """Which index a match is in: the request's own tokens, the tenant's recent outputs
    (engine/lookup/shared_outputs.py) or the request's predicted output (engine/lookup/prediction.py); or, for
    FORCED, no index: the text the request's grammar forces next (engine/lookup/grammar_copies.py)."""

    OWN = 0
    SHARED = 1
    PREDICTED = 2
    FORCED = 3


@dataclass(frozen=True)
class LookupState:
    """Where a node's sequence (context + root path) matches indexed tokens: the match length, the end
    positions of its occurrences (each followed by a continuation), the index they are in (None: the
    request's own) and which source that index is; length 0 = no match. A request with a grammar adds what it
    says at the node (engine/lookup/grammar_copies.py): the tokens it forces next, and which of the match's
    candidates it allows."""

    length: int
    positions: tuple[int, ...]
    index: SuffixIndex | None = field(default=None, repr=False)
    origin: Origin = Origin.OWN
    forced: tuple[int, ...] = ()  # the grammar's forced tokens after the node (the first is its candidate)
    allowed: frozenset[int] | None = None  # the match's candidates the grammar allows (None: no grammar)

    @property
    def shared(self) -> bool:
        return self.origin == Origin.SHARED


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
