"""A request's grammar as a drafter's copy sources see it during one step (engine/lookup/grammar_copies.py's
`DraftGrammar`): which copied candidates it allows below the step's root, and which tokens it forces there.

The drafter keeps one matcher per session at the session's output (`GrammarSessions`, the same that masks its
model rows), so each question is a walk from that state: accept the node's path, ask, roll back (xgrammar's
accept_token / find_jump_forward_string / rollback, as its tree traversal does for the target's masks). A node's
forced tokens are kept for the step: a builder reads a node's candidates several times.
"""

from __future__ import annotations

from typing import Sequence

from .matchers import GrammarSessions
from .spec import Grammar

# Forced text drafted per node at most: a long constant (a schema's `const` string, a tool call's fixed head) is
# copied over several steps rather than tokenized whole at each one; no tree holds more than this along a chain.
MAX_FORCED_TOKENS = 24


class StepGrammar:
    """`DraftGrammar` for one session's step: paths are below the root, context[-1] and, for a tree drafted ahead
    (engine/drafters/run_ahead.py), the guessed tokens `prefix` after it (a guess the grammar refuses leaves
    nothing allowed or forced: that tree is never used)."""

    def __init__(self, sessions: GrammarSessions, session_id: str, grammar: Grammar, context: list[int],
                 prefix: tuple[int, ...] = ()) -> None:
        self.sessions = sessions
        self.session_id = session_id
        self.grammar = grammar
        self.context = context
        self.prefix = prefix
        self._forced: dict[tuple[int, ...], tuple[int, ...]] = {}

    def allowed(self, path: Sequence[int], tokens: Sequence[int]) -> frozenset[int]:
        if not tokens:
            return frozenset()
        return self.sessions.allowed(self.session_id, self.grammar, self.context, self.prefix + tuple(path), tokens)

    def forced(self, path: Sequence[int]) -> tuple[int, ...]:
        key = tuple(path)
        found = self._forced.get(key)
        if found is None:
            found = self.sessions.forced(self.session_id, self.grammar, self.context, self.prefix + key,
                                         MAX_FORCED_TOKENS)
            self._forced[key] = found
        return found
