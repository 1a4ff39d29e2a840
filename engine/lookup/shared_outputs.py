"""The cross-request source of copy-from-context drafting: an index of a drafter's recent outputs, bounded in
tokens. Overview: engine/lookup/.

SuffixDecoding (Oliaro et al. 2024, arXiv:2411.04975; ArcticInference's implementation) keeps two suffix
trees: a per-request one over the ongoing request and a "global" one over previously generated outputs,
because agentic and repetitive workloads (the same SQL shapes, the same JSON schema, the same boilerplate
answer) repeat across requests what no single prompt holds. This is the global one, kept as the same n-gram
index as a request's own (`SuffixIndex`): finished outputs are appended with a `SEPARATOR` between them, and
when the tokens held pass the cap the oldest outputs are dropped and the index rebuilt from the rest (down to
3/4 of the cap, so a rebuild is paid once per cap/4 new tokens). Memory is about that of a request's index per token held
(~650 bytes at max_ngram 4).

Off by default (`LookupSettings.shared_tokens` 0): drafts never change what the target emits (verification is
lossless), but how fast a request decodes may reveal whether another request recently produced the same
text, which a multi-tenant deployment may not want.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from .suffix_index import SEPARATOR, SuffixIndex


class SharedOutputs:
    """Recent outputs of one drafter's requests (at most `max_tokens`, separators included), indexed."""

    def __init__(self, max_tokens: int, max_ngram: int) -> None:
        if max_tokens < 2:
            raise ValueError(f"the shared output index needs max_tokens >= 2, got {max_tokens}")
        self.max_tokens = max_tokens
        self.max_ngram = max_ngram
        self.index = SuffixIndex(max_ngram)
        self._outputs: deque[list[int]] = deque()
        self._held = 0  # tokens in the index, separators included
        self.rebuilds = 0

    def __len__(self) -> int:
        return self._held

    @property
    def outputs(self) -> int:
        return len(self._outputs)

    def add(self, tokens: Sequence[int]) -> None:
        """Index one finished output (its last max_tokens - 1 tokens); outputs of fewer than 2 tokens teach
        nothing and are skipped."""
        output = [int(t) for t in tokens][-(self.max_tokens - 1):]
        if len(output) < 2:
            return
        self._outputs.append(output)
        self._held += len(output) + 1
        if self._held <= self.max_tokens:
            self.index.extend(output + [SEPARATOR])
            return
        while self._held > self.max_tokens * 3 // 4 and len(self._outputs) > 1:
            self._held -= len(self._outputs.popleft()) + 1
        # A new index object: match states taken from the old one stay consistent (LookupState.index).
        self.index = SuffixIndex(self.max_ngram)
        for kept in self._outputs:
            self.index.extend(kept + [SEPARATOR])
        self.rebuilds += 1
