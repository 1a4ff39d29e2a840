"""A request's predicted output (OpenAI's Predicted Outputs, `prediction: {"type": "content", ...}`) as a copy
source with its own position. Overview: engine/lookup/.

A client that rewrites a file with a few changes knows most of the answer already: the file. OpenAI drafts from
that text; here it joins the request's copy-from-context source as a third index beside the context's own and
the tenant's recent outputs, with one thing the n-gram index cannot know: where in the prediction the output
stands. The n-gram index counts every occurrence of the context's last tokens (a source file repeats
`return`, `self.`, closing brackets everywhere) and proposes the most counted continuations; the prediction is
read in order, so the output's position in it is tracked token by token (`anchor`) and a node's candidate is
the single next predicted token. Where the output leaves the prediction (the edit: a renamed symbol, an added
parameter), the position is found again by matching the output's last tokens in the prediction, preferring the
nearest occurrence ahead of where the output last surely stood (edits move forward through a file), so after
`foo(` became `bar(` the next candidate is what followed `foo(` there, not at the first `(` of the file; a
position found from a single token only moves that mark once the next token confirms it.

The candidates are calibrated like the other sources' (own buckets by the length of the run of output tokens
that followed the prediction), so the budget chooser prices prediction chains by what they earn. Every
candidate is a function of the request and its context: verification, and so the output, never changes.

`prediction_usage` counts OpenAI's usage fields from the finished output.
"""

from __future__ import annotations

import bisect
from difflib import SequenceMatcher
from typing import Sequence

from .suffix_index import NO_MATCH, SEPARATOR, LookupState, Origin, SuffixIndex


class PredictedOutput:
    """The predicted tokens, indexed after a leading SEPARATOR (position 0, so that the first predicted token is
    the continuation of a match ending there), and the output's aligned position in them."""

    def __init__(self, tokens: Sequence[int], max_ngram: int, max_match: int) -> None:
        self.max_match = max_match
        self.index = SuffixIndex(max_ngram)
        self.index.extend((SEPARATOR, *tokens))
        self.anchor = 0  # index position of the output's last token; 0: the output has not left the start
        self.run = 0  # output tokens up to the anchor that followed the prediction in a row
        self.mark = 0  # where the output last surely stood (a lost output is looked for from here on)

    def restart(self, tail: Sequence[int]) -> None:
        """A session (re)starts at a context ending in `tail`: at the prediction's start, unless the tail is found
        in it (a session created after its request's output began, or rebuilt)."""
        length, position = self.locate(tail, after=0, min_length=2)
        self.anchor, self.run, self.mark = (position, length, position) if length else (0, 0, 0)

    def advance(self, token: int, tail: Sequence[int]) -> None:
        """The output grew by `token` (`tail`: the context's last tokens, ending with it)."""
        toks = self.index.tokens
        if self.anchor >= 0 and self.anchor + 1 < len(toks) and toks[self.anchor + 1] == token:
            self.anchor += 1
            self.run += 1
            self.mark = self.anchor
            return
        length, position = self.locate(tail, after=self.mark)
        self.anchor, self.run = (position, length) if length else (-1, 0)
        if length >= 2:  # one token found again is a guess (a bracket recurs everywhere): no move until confirmed
            self.mark = position

    def root_state(self) -> LookupState:
        """The state at the output's current end: the tracked position, its bucket by the aligned run."""
        if self.anchor < 0 or not self._continues(self.anchor):
            return NO_MATCH
        return LookupState(min(self.run, self.max_match), (self.anchor,), self.index, Origin.PREDICTED)

    def state(self, tail: Sequence[int]) -> LookupState:
        """A tree node's state found afresh from its sequence's last tokens (a node off the predicted path)."""
        length, position = self.locate(tail, after=max(self.mark, 0))
        if not length:
            return NO_MATCH
        return LookupState(min(length, self.max_match), (position,), self.index, Origin.PREDICTED)

    def locate(self, tail: Sequence[int], after: int, min_length: int = 1) -> tuple[int, int]:
        """(length, end position) of the longest suffix of `tail` found in the prediction with a continuation,
        at its first occurrence after `after` (else its last before), measured back up to max_match; (0, -1)
        when not even the last token (or fewer than `min_length` tokens) is found."""
        toks = self.index.tokens
        for n in range(min(self.index.max_ngram, len(tail)), min_length - 1, -1):
            ends = [p for p in self.index.ends(tail[len(tail) - n:]) if self._continues(p)]
            if not ends:
                continue
            i = bisect.bisect_right(ends, after)
            position = ends[i] if i < len(ends) else ends[-1]
            length = n
            while (length < self.max_match and length < len(tail) and position - length > 0
                   and tail[len(tail) - 1 - length] == toks[position - length]):
                length += 1
            return length, position
        return 0, -1

    def _continues(self, position: int) -> bool:
        return position + 1 < len(self.index.tokens)


def prediction_usage(prediction: Sequence[int], output: Sequence[int]) -> tuple[int, int]:
    """OpenAI's `accepted_prediction_tokens` and `rejected_prediction_tokens`: the predicted tokens that appear in
    the output (in order: the matching blocks of a diff of the two token sequences) and the rest of them. A
    function of the output alone, so it is the same whatever the speculation drafted."""
    if not prediction:
        return 0, 0
    matcher = SequenceMatcher(None, list(prediction), list(output), autojunk=False)
    accepted = sum(block.size for block in matcher.get_matching_blocks())
    return accepted, len(prediction) - accepted
