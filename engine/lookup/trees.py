"""Trees and chains of copy-from-context candidates: the lookup-only tree of a step (`plan_lookup`, method
"lookup"), the copy chain of batched steps and its merge with a model chain. Overview: engine/lookup/."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from ..tree import ChildDraw, Source, TokenTree
from .grammar_copies import GrammarCopies
from .session import AheadLookup, LookupSession

# What the lookup-only plan and the copy chains read: a request's session, or the same seen through its grammar
CopySource = LookupSession | AheadLookup | GrammarCopies


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


def plan_lookup(session: CopySource, root_token: int, max_nodes: int, min_value: float) -> LookupPlan:
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

    size_field: ClassVar[str | None] = "budget"

    budget: int = 16
    min_value: float = 0.02

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or self.budget < 1:
            raise ValueError(f"budget must be an integer >= 1, got {self.budget!r}")

    def build(self, root_token: int, oracle, sampling, generator) -> TokenTree:  # type: ignore[no-untyped-def]
        if oracle.lookup is None:
            raise ValueError("the lookup method drafts from a HybridOracle (copy-from-context candidates)")
        return oracle.lookup.plan(root_token, self.budget, self.min_value).tree(self.budget, sampling.is_greedy)


def lookup_chain(session: CopySource, max_length: int, min_joint: float) -> tuple[list[int], list[float]]:
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
