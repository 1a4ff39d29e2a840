"""The grammar's mask at every tree node, each from that node's own matcher state (docs/design.md section 5).

A node's row is the target's next-token distribution after its path (the context, then its ancestors below the
root and itself), so its mask is the grammar matcher's after that path: what plain constrained decoding would
have masked there. As SGLang does for EAGLE trees, one matcher per session is kept at the sequence's output so far
(the root's state), and xgrammar's `traverse_draft_tree` walks the tree depth first from it, accepting a node's
token, filling its row of the bitmask, and rolling back on the way up (nodes whose token the grammar refuses are
not entered: their rows, never reached by verification, stay unmasked). The masked logits then go to the argmax or
the warp, so both verification rules see the masked target distribution and the output is that of decoding with
the mask one token at a time (the `generate` of xgrammar's transformers logits processor, greedy).

Context, not state (docs/design.md section 9): the matcher follows the context each Score item carries. A session
whose matcher accepted tokens the context no longer holds is rolled back to their common prefix, one that lacks
a matcher (a replica that never saw it) gets a new one fed the output; a token the grammar refuses is an error.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor

from ..tree import TokenTree
from .compiler import GrammarCompiler, xgrammar
from .spec import Grammar

if TYPE_CHECKING:
    import xgrammar as xgr

_BITS = torch.arange(32, dtype=torch.int32)


@dataclass
class _Session:
    key: tuple  # the grammar's key and stop ids the matcher was built for
    matcher: "xgr.GrammarMatcher"
    accepted: list[int]  # output tokens the matcher has accepted, in order


class GrammarSessions:
    """One grammar matcher per session, kept at the session's output; the per-node masks of its trees."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()  # sessions come and go from the step thread and the idle sweep

    def tree_masks(self, session_id: str, grammar: Grammar, context: list[int], tree: TokenTree) -> Tensor:
        """Bitmask [N, ceil(V / 32)] int32 of `tree`'s nodes (bit t of row i: token t may follow node i's path),
        the matcher first brought to context[grammar.prompt_tokens:] (whose last token is the root)."""
        matcher = self._matcher_at(session_id, grammar, context[grammar.prompt_tokens:])
        num = tree.num_nodes
        first_child, next_sibling = tree_links(tree.parent_list)
        masks = torch.full((num, (self.compiler.vocab_size + 31) // 32), -1, dtype=torch.int32)  # xgrammar's shape
        matcher.traverse_draft_tree(torch.tensor(first_child, dtype=torch.int64),
                                    torch.tensor(next_sibling, dtype=torch.int64),
                                    tree.tokens.to(torch.int64).cpu(), masks)
        return masks

    def path_masks(self, session_id: str, grammar: Grammar, context: list[int], paths: list[list[int]]) -> Tensor:
        """Bitmask [M, ceil(V / 32)] int32 of rows known by their paths below the root (row i after context +
        paths[i]): a drafter's rows, fed a few nodes at a time (engine/drafters/model_runner.py). A path the
        grammar refuses leaves its row unmasked (the target will refuse its token; the row is never verified)."""
        matcher = self._matcher_at(session_id, grammar, context[grammar.prompt_tokens:])
        masks = torch.full((len(paths), (self.compiler.vocab_size + 31) // 32), -1, dtype=torch.int32)
        for row, path in enumerate(paths):
            accepted = _accept(matcher, path)
            if accepted == len(path) and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(masks, row)
            if accepted:
                matcher.rollback(accepted)
        return masks

    def allowed(self, session_id: str, grammar: Grammar, context: list[int], path: Sequence[int],
                tokens: Sequence[int]) -> frozenset[int]:
        """Which of `tokens` the grammar allows after context + `path` (none after a path it refuses): a copy
        source's candidates checked one by one (xgrammar's accept_token, then rollback)."""
        matcher = self._matcher_at(session_id, grammar, context[grammar.prompt_tokens:])
        depth = _accept(matcher, path)
        ok = set()
        if depth == len(path) and not matcher.is_terminated():
            for token in tokens:
                if matcher.accept_token(token):
                    ok.add(token)
                    matcher.rollback(1)
        if depth:
            matcher.rollback(depth)
        return frozenset(ok)

    def forced(self, session_id: str, grammar: Grammar, context: list[int], path: Sequence[int],
               max_tokens: int) -> tuple[int, ...]:
        """The text the grammar forces after context + `path` (xgrammar's jump-forward string), as at most
        `max_tokens` tokens of the tokenizer's own encoding of it, cut at the first the grammar refuses (a
        tokenization the matcher does not follow); () where it forces nothing."""
        matcher = self._matcher_at(session_id, grammar, context[grammar.prompt_tokens:])
        depth = _accept(matcher, path)
        tokens: list[int] = []
        if depth == len(path) and not matcher.is_terminated():
            text = matcher.find_jump_forward_string()
            if text:
                encoded = self.compiler.tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
                for token in encoded:
                    if not matcher.accept_token(token):
                        break
                    tokens.append(token)
        if depth + len(tokens):
            matcher.rollback(depth + len(tokens))
        return tuple(tokens)

    def release(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._sessions)

    def _matcher_at(self, session_id: str, grammar: Grammar, output: list[int]) -> "xgr.GrammarMatcher":
        key = (grammar.key, grammar.stop_ids)
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None or session.key != key:
            compiled = self.compiler.compile(grammar)
            session = _Session(key, xgrammar().GrammarMatcher(compiled, override_stop_tokens=list(grammar.stop_ids)),
                               [])
            with self._lock:
                self._sessions[session_id] = session
        held = session.accepted
        # Most calls find the matcher where they need it (a drafter asks about many nodes of one step): one list
        # comparison instead of a Python loop over the output
        if len(held) <= len(output) and output[:len(held)] == held:
            common = len(held)
        else:
            common = 0
            limit = min(len(held), len(output))
            while common < limit and held[common] == output[common]:
                common += 1
        if common < len(held):
            session.matcher.rollback(len(held) - common)
            del held[common:]
        for position in range(common, len(output)):
            token = output[position]
            if not session.matcher.accept_token(token):
                with self._lock:
                    self._sessions.pop(session_id, None)
                raise ValueError(f"session {session_id}: output token {token} at position {position} does not "
                                 f"follow the request's {grammar.kind.value} grammar")
            held.append(token)
        return session.matcher


def _accept(matcher: "xgr.GrammarMatcher", path: Sequence[int]) -> int:
    """Feed `path` to the matcher up to the first token it refuses (or its end); returns how many it accepted (the
    caller rolls them back)."""
    accepted = 0
    for token in path:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        accepted += 1
    return accepted


def tree_links(parents: list[int]) -> tuple[list[int], list[int]]:
    """(first child, next sibling) of every node, -1 for none: xgrammar's tree layout (SGLang's
    retrieve_next_token / retrieve_next_sibling). Siblings keep the tree's order."""
    num = len(parents)
    first, sibling, last = [-1] * num, [-1] * num, [-1] * num
    for node in range(1, num):
        parent = parents[node]
        if first[parent] < 0:
            first[parent] = node
        else:
            sibling[last[parent]] = node
        last[parent] = node
    return first, sibling


def allowed_tokens(masks: Tensor, vocab: int) -> Tensor:
    """Bool [N, vocab] from bitmasks [N, W] (rows `usable` first): ids past the bitmask's 32 W are padding, never
    allowed."""
    masks = usable(masks)
    bits = ((masks[:, :, None] >> _BITS.to(masks.device)) & 1).bool().reshape(masks.shape[0], -1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    return torch.cat([bits, bits.new_zeros(masks.shape[0], vocab - bits.shape[1])], dim=1)


def usable(masks: Tensor) -> Tensor:
    """`masks` with every row that allows nothing (a node past a completed grammar's stop token, after which nothing
    is emitted) allowing everything instead, so that its row remains a distribution."""
    empty = (masks == 0).all(dim=1)
    if not bool(empty.any()):
        return masks
    masks = masks.clone()
    masks[empty] = -1
    return masks


def apply_masks(logits: Tensor, masks: Tensor) -> Tensor:
    """logits [N, V] with every token a node's mask forbids at -inf (a new float32 tensor, as the processors').
    On the CPU xgrammar's own kernel; elsewhere the bits are unpacked with torch (xgrammar's GPU kernels need
    triton, which is not installed with it here)."""
    out = logits.float().clone()
    masks = usable(masks)
    if out.device.type == "cpu":
        xgrammar().apply_token_bitmask_inplace(out, masks, backend="cpu")
        return out
    return out.masked_fill_(~allowed_tokens(masks.to(out.device), out.shape[-1]), float("-inf"))
