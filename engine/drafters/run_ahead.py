"""Run-ahead drafting: while the target scores step t, the drafter drafts step t+1 from the outcomes it expects.

PEARL (Liu et al., 2025, "PEARL: Parallel Speculative Decoding with Adaptive Draft Length", section 3,
"post-verify") and SpecActor / SwiftSpec overlap drafting with verification by drafting the next step before
the current one is verified. Here, after step t's tree is returned, the drafter guesses the outcome of its
verification: the accepted path is its own most likely path through the tree (node by node the child of
highest path probability, to a leaf) or that path without its last node (`GUESSES`), and the bonus token one
of its own most likely tokens after it (`BONUS_CANDIDATES`; at a node short of the leaf, not one of the tree's
children there: at temperature 0 the target's token there was none of them). For each guess it drafts, ahead,
the tree step t+1 would start from. When the context of step t+1 is one of the guessed ones, that tree is
returned at once: a hit costs max(draft, score) instead of their sum; a miss drafts as usual. Verification is
unchanged, so the output is too: any tree verifies losslessly, and a tree drafted ahead is used only for the
exact context it assumed (docs/design.md section 9). Greedy requests at batch size 1 only: a sampled step's
outcome is a draw, and batched steps draft chains sized for the batch.

The ahead trees are grown with the step's own builder at the budget the chooser decided for step t (a hit step
is credited to that budget) through `OffsetOracle`s over one drafter step rooted at step t's root: the guessed
path is fed as a chain of tree nodes, each reading its parent's predicted feature as every tree node does (an
EAGLE drafter has no target features of guessed tokens yet), and each ahead tree hangs below the chain node it
guesses, on node ids of its own. A hybrid method's ahead trees mix in the copies its lookup finds after the
guessed tokens (`AheadLookup`: the session's matches measured with the guessed tokens appended, its predictions kept
with the tree and made the session's on a hit), so a hit's tree is drawn from both sources as a drafted step's is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from torch import Tensor

from ..builders.base import DraftOracle, RowSummary
from ..tree import TokenTree
from .model_runner import SessionOracle


GUESSES = 2  # accepted lengths guessed per step: the whole likely path, and the path without its last node
BONUS_CANDIDATES = 2  # bonus tokens guessed per accepted length: the drafter's most likely ones there
TREE_SPAN = 128  # node ids each ahead tree may use under the shared oracle (a tree holds budget + 1 <= 65)


def likely_path(tree: TokenTree) -> list[int]:
    """Tree nodes (root excluded) of the drafter's most likely path: from the root, the child of highest
    path probability (`log_joint`) until a leaf."""
    path, node = [], 0
    joints = tree.log_joint.tolist()
    while True:
        children = tree.children(node)
        if not children:
            return path
        node = max(children, key=lambda c: joints[c])
        path.append(node)


class OffsetOracle(DraftOracle):
    """A builder's oracle for a tree hung below a chain of known nodes, in a step whose root is the chain's first
    token (`inner`). The chain is nodes 0..K of the combined tree (each the child of the one
    before); the builder's root is node `base`, a child of chain node `attach`, and builder node i is node
    base + i. Trees built under one inner oracle take disjoint bases, so their nodes never share an id (the
    inner oracle keeps each node's KV slot and rows by id); the ids between are unused."""

    def __init__(self, inner: SessionOracle, chain_tokens: Sequence[int], attach: int, base: int):
        if not 0 <= attach < len(chain_tokens) <= base:
            raise ValueError(f"attach {attach} must be a chain node and base {base} past the chain")
        self.inner = inner
        self.chain_tokens = list(chain_tokens)
        self.attach, self.base = attach, base
        self.vocab_size = inner.vocab_size

    def _combined(self, tokens: Sequence[int], parents: Sequence[int], nodes: Sequence[int]):
        filler = self.base - len(self.chain_tokens)
        all_tokens = self.chain_tokens + [0] * filler + list(tokens)
        all_parents = ([-1] + list(range(len(self.chain_tokens) - 1)) + [-1] * filler + [self.attach]
                       + [self.base + p for p in parents[1:]])
        return all_tokens, all_parents, [self.base + n for n in nodes]

    def probs(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int]) -> Tensor:
        return self.inner.probs(*self._combined(tokens, parents, node_ids))

    def summarize(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int], k: int,
                  entropy: bool) -> RowSummary:
        return self.inner.summarize(*self._combined(tokens, parents, node_ids), k, entropy)

    def sample(self, tokens: Sequence[int], parents: Sequence[int], node: int, uniform: float):
        all_tokens, all_parents, (combined,) = self._combined(tokens, parents, [node])
        return self.inner.sample(all_tokens, all_parents, combined, uniform)

    # What a HybridOracle mixing lookup candidates into the rows reads from a SessionOracle (its fast path).
    def head_rows(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int]) -> Tensor:
        return self.inner.head_rows(*self._combined(tokens, parents, node_ids))

    def summarize_head(self, head_rows: Tensor, k: int, entropy: bool) -> RowSummary:
        return self.inner.summarize_head(head_rows, k, entropy)

    def target_ids(self, head_index: Tensor) -> Tensor:
        return self.inner.target_ids(head_index)


@dataclass
class AheadTree:
    """A tree drafted ahead for one session, rooted at a guessed bonus token."""

    context: list[int]  # step t's context, the guessed accepted path and the guessed bonus (`tree`'s root)
    tree: TokenTree
    # A hybrid tree's lookup predictions (AheadLookup.predictions, by path after `tree`'s root): the session's own
    # when the guess comes true. None: a tree of the model's drafts alone.
    predictions: dict[tuple[int, ...], tuple[frozenset[int], int]] | None = None


@dataclass
class RunAheadStore:
    """The ahead trees by session (one per guessed accepted length), and how often the next step matched one."""

    trees: dict[str, list[AheadTree]] = field(default_factory=dict)
    hits: int = 0  # steps whose tree came from run-ahead
    misses: int = 0  # steps that had ahead trees of which none matched (drafted as usual)

    def put(self, session_id: str, ahead: AheadTree) -> None:
        self.trees.setdefault(session_id, []).append(ahead)

    def take(self, session_id: str, context: list[int]) -> AheadTree | None:
        """The tree drafted ahead for exactly this context (step t's, the accepted path and the bonus token), if
        any; forgets the session's ahead trees either way."""
        aheads = self.trees.pop(session_id, None)
        if not aheads:
            return None
        ahead = next((a for a in aheads if a.context == context), None)
        if ahead is None:
            self.misses += 1
        else:
            self.hits += 1
        return ahead

    def drop(self, session_id: str) -> None:
        self.trees.pop(session_id, None)

    @property
    def hit_rate(self) -> float:
        tried = self.hits + self.misses
        return self.hits / tried if tried else 0.0
