"""The token tree exchanged between drafter, target and router (docs/design.md section 3).

Node 0 is the ROOT: the last emitted token, not yet in the target's KV cache. Nodes 1.. are draft
tokens in topological order (every parent precedes its children). Siblings keep the order in which
they were drawn, which matters for verification of children sampled without replacement
(DySpec Algorithm 3 walks siblings in draw order); every re-indexing here preserves it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

# Row sums of stored draft distributions must be 1 within this tolerance (float32 softmax output).
_SUM_TOL = 1e-3


class ChildDraw(enum.IntEnum):
    """How a node's children were drawn; selects the verification rule (docs/design.md section 5)."""

    TOP_K = 0  # deterministic top-k of q: point-mass rule (accept x w.p. p'(x), zero it, renormalise)
    WITHOUT_REPLACEMENT = 1  # sampled from residual q, earlier siblings removed: DySpec Algorithm 3
    GREEDY = 2  # argmax chain at temperature 0 (deterministic, so point-mass rule at T > 0)


class Source(enum.IntEnum):
    """Which draft source proposed a node (engine/lookup/: hybrid trees). A LOOKUP or BOTH node is a
    deterministic proposal (copied from the request's context): under a WITHOUT_REPLACEMENT parent it is
    verified by the point-mass rule before the sampled siblings, which were drawn from the parent's draft
    row with those tokens removed (docs/design.md section 5; engine/verify.py)."""

    MODEL = 0  # the model drafter alone
    LOOKUP = 1  # copied from the context (the model's top-1 at the parent, if it ran there, was another token)
    BOTH = 2  # copied from the context and the model's top-1 at the parent


class cached_property:  # noqa: N801 - same role and name as functools.cached_property
    """functools.cached_property without its per-instance lock (Python 3.11 takes an RLock on every
    first access; a tree's five cached views cost more in locking than in computing them, and
    verification creates them for every tree). Not thread-safe on first access, like the rest of
    a tree's lazily built state; the value is stored in the instance __dict__."""

    def __init__(self, func) -> None:  # type: ignore[no-untyped-def]
        self.func = func
        self.name = func.__name__
        self.__doc__ = func.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj, objtype=None):  # type: ignore[no-untyped-def]
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.func(obj)
        return value


def _as_long(name: str, value: Tensor | Sequence[int]) -> Tensor:
    tensor = torch.as_tensor(value)
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got dtype {tensor.dtype}")
    return tensor.to(torch.long)


class _DraftProbs:
    """Data descriptor behind `TokenTree.draft_probs` (a dataclass field with default None).

    Builders may hand the rows over as a list of [V] tensors (`TokenTree._trusted`): they keep
    references to the drafter's rows instead of copying them (a budget-64 sampled chain would copy
    64 x 49,152 floats, ~2-4 ms on the CPU). The list is stacked into the documented [E, V] tensor
    on the first read of `draft_probs` (e.g. by the wire encoder); verification reads single rows
    through `TokenTree.draft_row` and never stacks."""

    def __get__(self, obj: object, objtype: type | None = None) -> Tensor | None:
        if obj is None:
            return None  # the dataclass default
        value = obj.__dict__["_draft_probs"]
        if isinstance(value, list):
            value = obj.__dict__["_draft_probs"] = torch.stack(value)
        return value

    def __set__(self, obj: object, value: Tensor | list[Tensor] | None) -> None:
        obj.__dict__["_draft_probs"] = value


@dataclass(frozen=True, eq=False)
class TokenTree:
    """A validated draft tree. Build with `TokenTree.build(...)` (accepts lists) or the constructor
    (tensors of the right dtype); both validate and raise ValueError naming the bad field."""

    tokens: Tensor  # LongTensor [N]; tokens[0] is the root token
    parents: Tensor  # LongTensor [N]; parents[0] == -1, 0 <= parents[i] < i
    child_draw: Tensor  # uint8 [N]; ChildDraw of each node's children
    log_joint: Tensor  # FloatTensor [N]; sum of log q along the root path, 0 at the root
    draft_probs: Tensor | None = _DraftProbs()  # type: ignore[assignment]  # FloatTensor [E, V]; q at each expanded node that needs it
    draft_rows: Tensor | None = None  # LongTensor [N]; node -> row of draft_probs, or -1
    sources: Tensor | None = None  # uint8 [N]; Source of each node (root: MODEL); None: every node is MODEL

    def __post_init__(self) -> None:
        self._validate()

    @classmethod
    def _trusted(
        cls,
        tokens: Tensor,
        parents: Tensor,
        child_draw: Tensor,
        log_joint: Tensor,
        draft_probs: Tensor | list[Tensor] | None,
        draft_rows: Tensor | None,
        sources: Tensor | None = None,
    ) -> "TokenTree":
        """Skip validation for trees that are valid by construction (builders, re-indexing of a
        validated tree): validation costs ~20 small tensor ops, more than building a small tree.
        draft_probs may be a non-empty list of [V] rows, stacked lazily (see `_DraftProbs`)."""
        tree = object.__new__(cls)
        for name, value in (("tokens", tokens), ("parents", parents), ("child_draw", child_draw),
                            ("log_joint", log_joint), ("draft_probs", draft_probs), ("draft_rows", draft_rows),
                            ("sources", sources)):
            object.__setattr__(tree, name, value)
        return tree

    @classmethod
    def build(
        cls,
        tokens: Tensor | Sequence[int],
        parents: Tensor | Sequence[int],
        child_draw: Tensor | Sequence[int] | ChildDraw = ChildDraw.TOP_K,
        log_joint: Tensor | Sequence[float] | None = None,
        draft_probs: Tensor | None = None,
        draft_rows: Tensor | Sequence[int] | None = None,
        sources: Tensor | Sequence[int] | None = None,
    ) -> "TokenTree":
        """Convert plain sequences to tensors and validate. A single ChildDraw applies to all nodes;
        log_joint defaults to zeros (unknown); sources to None (every node from the model drafter)."""
        tokens_t = _as_long("tokens", tokens)
        num = tokens_t.shape[0] if tokens_t.dim() == 1 else -1
        if isinstance(child_draw, (ChildDraw, int)):
            draw_t = torch.full((max(num, 0),), int(child_draw), dtype=torch.uint8)
        else:
            draw_t = _as_long("child_draw", child_draw).to(torch.uint8)
        lj = torch.zeros(max(num, 0)) if log_joint is None else torch.as_tensor(log_joint, dtype=torch.float32)
        rows = None if draft_rows is None else _as_long("draft_rows", draft_rows)
        src = None if sources is None else _as_long("sources", sources)
        if src is not None and src.numel() and bool(((src < 0) | (src > max(Source))).any()):
            raise ValueError("sources must hold Source values")
        src = None if src is None else src.to(torch.uint8)
        return cls(tokens_t, _as_long("parents", parents), draw_t, lj, draft_probs, rows, src)

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        tokens, parents = self.tokens, self.parents
        if tokens.dim() != 1 or tokens.shape[0] < 1 or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be a LongTensor [N] with N >= 1, got {tuple(tokens.shape)} {tokens.dtype}")
        num = tokens.shape[0]
        if bool((tokens < 0).any()):
            raise ValueError("tokens must be >= 0")
        if parents.shape != (num,) or parents.dtype != torch.long:
            raise ValueError(f"parents must be a LongTensor [{num}], got {tuple(parents.shape)} {parents.dtype}")
        if int(parents[0]) != -1:
            raise ValueError("parents[0] must be -1 (node 0 is the root)")
        if num > 1 and bool((parents[1:] < 0).any() | (parents[1:] >= torch.arange(1, num)).any()):
            raise ValueError("parents must satisfy 0 <= parents[i] < i (topological order, no cycles)")
        if self.child_draw.shape != (num,) or self.child_draw.dtype != torch.uint8:
            raise ValueError(f"child_draw must be a uint8 tensor [{num}], got {tuple(self.child_draw.shape)}")
        if bool((self.child_draw > max(ChildDraw)).any()):
            raise ValueError("child_draw holds a value that is not a ChildDraw")
        lj = self.log_joint
        if lj.shape != (num,) or not lj.dtype.is_floating_point:
            raise ValueError(f"log_joint must be a FloatTensor [{num}], got {tuple(lj.shape)} {lj.dtype}")
        if bool(torch.isnan(lj).any() | (lj > 1e-4).any()):
            raise ValueError("log_joint must hold log-probabilities (<= 0, no NaN)")
        src = self.sources
        if src is not None:
            if src.shape != (num,) or src.dtype != torch.uint8:
                raise ValueError(f"sources must be a uint8 tensor [{num}], got {tuple(src.shape)} {src.dtype}")
            if bool((src > max(Source)).any()) or int(src[0]) != Source.MODEL:
                raise ValueError("sources must hold Source values, MODEL at the root")
        self._validate_draft(num)

    def _validate_draft(self, num: int) -> None:
        probs, rows = self.draft_probs, self.draft_rows
        needs_row = (self.child_draw == ChildDraw.WITHOUT_REPLACEMENT) & self.has_children_mask
        if probs is None:
            if rows is not None:
                raise ValueError("draft_rows given without draft_probs")
            if bool(needs_row.any()):
                raise ValueError("draft_probs is required: some node has WITHOUT_REPLACEMENT children")
            return
        if probs.dim() != 2 or not probs.dtype.is_floating_point:
            raise ValueError(f"draft_probs must be a FloatTensor [E, V], got {tuple(probs.shape)} {probs.dtype}")
        if rows is None or rows.shape != (num,) or rows.dtype != torch.long:
            raise ValueError(f"draft_rows must be a LongTensor [{num}] when draft_probs is given")
        if bool(((rows < -1) | (rows >= probs.shape[0])).any()):
            raise ValueError(f"draft_rows must lie in [-1, {probs.shape[0]})")
        if bool((needs_row & (rows < 0)).any()):
            raise ValueError("draft_rows: a node with WITHOUT_REPLACEMENT children has no draft row")
        vocab = probs.shape[1]
        if bool((self.tokens >= vocab).any()):
            raise ValueError(f"tokens must be < vocab size {vocab} of draft_probs")
        if probs.shape[0]:
            # One reduction each: NaN propagates through amin and sum, so this also catches NaN.
            low = probs.amin()
            sums = probs.sum(dim=1)
            if bool(torch.isnan(low)) or float(low) < 0:
                raise ValueError("draft_probs must be non-negative and free of NaN")
            if bool(((sums - 1).abs() > _SUM_TOL).any()):
                raise ValueError("draft_probs rows must sum to 1")
            child = torch.nonzero(needs_row[self.parents.clamp(min=0)] & (self.parents >= 0)).flatten()
            if child.numel() and bool((probs[rows[self.parents[child]], self.tokens[child]] <= 0).any()):
                raise ValueError("tokens: a WITHOUT_REPLACEMENT child has zero draft probability at its parent")

    # ------------------------------------------------------------------ derived views
    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    @property
    def vocab_size(self) -> int | None:
        probs = self.__dict__["_draft_probs"]
        if probs is None:
            return None
        return probs[0].shape[0] if isinstance(probs, list) else probs.shape[1]

    def draft_row(self, node: int) -> Tensor:
        """q [V] at `node` (a node with a draft row), without stacking a lazily kept row list."""
        index = self.draft_row_list[node]  # type: ignore[index]
        if index < 0:
            raise ValueError(f"node {node} has no draft row")
        return self.__dict__["_draft_probs"][index]

    @cached_property
    def parent_list(self) -> list[int]:
        """parents as a Python list (cached)."""
        return self.parents.tolist()

    @cached_property
    def token_list(self) -> list[int]:
        """tokens as a Python list (cached; verification walks it node by node)."""
        return self.tokens.tolist()

    @cached_property
    def child_draw_list(self) -> list[int]:
        return self.child_draw.tolist()

    @cached_property
    def source_list(self) -> list[int] | None:
        """sources as a Python list (cached), None when the tree has none."""
        return None if self.sources is None else self.sources.tolist()

    def count_sources(self, nodes: Sequence[int] | None = None) -> tuple[int, int, int]:
        """(MODEL, LOOKUP, BOTH) counts over `nodes` (default: every draft node, root excluded)."""
        src = self.source_list
        nodes = range(1, self.num_nodes) if nodes is None else nodes
        if src is None:
            return (len(nodes), 0, 0)
        counts = [0, 0, 0]
        for n in nodes:
            counts[src[n]] += 1
        return counts[0], counts[1], counts[2]

    @cached_property
    def draft_row_list(self) -> list[int] | None:
        return None if self.draft_rows is None else self.draft_rows.tolist()

    @cached_property
    def depth(self) -> Tensor:
        """LongTensor [N]: root 0, its children 1, ..."""
        out = [0] * self.num_nodes
        for i, p in enumerate(self.parent_list[1:], start=1):
            out[i] = out[p] + 1
        return torch.tensor(out, dtype=torch.long)

    @cached_property
    def _children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(self.parent_list[1:], start=1):
            kids[p].append(i)
        return kids

    @cached_property
    def has_children_mask(self) -> Tensor:
        """bool [N]: node has at least one child."""
        mask = torch.zeros(self.num_nodes, dtype=torch.bool)
        mask[self.parents[1:]] = True
        return mask

    def children(self, node: int) -> list[int]:
        """Children of `node` in draw order."""
        return self._children[node]

    # ------------------------------------------------------------------ re-indexing
    def reorder(self, order: Tensor | Sequence[int]) -> "TokenTree":
        """New tree whose node i is old node order[i]; order must be a topological permutation that
        starts with the root and keeps siblings in draw order."""
        order_t = _as_long("order", order)
        if order_t.shape != (self.num_nodes,) or not torch.equal(order_t.sort().values, torch.arange(self.num_nodes)):
            raise ValueError("order must be a permutation of all nodes")
        return self._reindex(order_t)

    def select(self, keep_nodes: Tensor | Sequence[int]) -> "TokenTree":
        """Sub-tree of the kept nodes (root implied), re-indexed in the old relative order.

        The kept set must be closed under ancestors. Under a WITHOUT_REPLACEMENT parent it must keep
        a prefix of the siblings: a later sibling was drawn from a residual that excludes the earlier
        ones, so dropping an earlier one would make verification lossy.
        """
        keep = torch.zeros(self.num_nodes, dtype=torch.bool)
        keep[_as_long("keep_nodes", keep_nodes)] = True
        keep[0] = True
        kept_parent_ok = keep[self.parents.clamp(min=0)] | (self.parents < 0)
        if bool((keep & ~kept_parent_ok).any()):
            raise ValueError("keep_nodes must be closed under ancestors")
        for node in torch.nonzero(keep & (self.child_draw == ChildDraw.WITHOUT_REPLACEMENT)).flatten().tolist():
            flags = keep[self._children[node]].tolist()
            if flags and flags != sorted(flags, reverse=True):
                raise ValueError("keep_nodes must keep a prefix of WITHOUT_REPLACEMENT siblings")
        return self._reindex(torch.nonzero(keep).flatten())

    def _reindex(self, order: Tensor) -> "TokenTree":
        new_index = torch.full((self.num_nodes,), -1, dtype=torch.long)
        new_index[order] = torch.arange(order.shape[0])
        old_parents = self.parents[order]
        parents = torch.where(old_parents >= 0, new_index[old_parents.clamp(min=0)], old_parents)
        probs, rows = self.__dict__["_draft_probs"], self.draft_rows
        if probs is not None and rows is not None:
            # Keep only the rows the kept nodes refer to, so the payload shrinks with the tree.
            old_rows = rows[order]
            used = old_rows >= 0
            if isinstance(probs, list):
                kept = [probs[i] for i in old_rows[used].tolist()]
                probs = kept if kept else torch.empty(0, probs[0].shape[0], dtype=probs[0].dtype)
            else:
                probs = probs[old_rows[used]]
            rows = torch.full_like(old_rows, -1)
            rows[used] = torch.arange(int(used.sum()))
        sources = None if self.sources is None else self.sources[order]
        return TokenTree._trusted(self.tokens[order], parents, self.child_draw[order], self.log_joint[order], probs, rows,
                                  sources)


def ancestor_mask(parents: Sequence[int], first: int = 0) -> Tensor:
    """Tree attention, the one place it is built: bool [N - first, N] over a tree given by `parents` (node 0
    the root, parents[0] == -1, 0 <= parents[i] < i). Row r is node first + r and is True at that node and
    at each of its ancestors. `first` > 0 gives only the rows of nodes appended after the first `first`
    ones (a cached model feeds a tree in several forwards: engine/runners/cached_lm.py).

    Walks each node's root path in Python and sets all entries in one indexed write: a tree holds a few
    hundred nodes at most, and per-entry tensor writes cost microseconds each."""
    num = len(parents)
    rows: list[int] = []
    cols: list[int] = []
    for row, node in enumerate(range(first, num)):
        while node >= 0:
            rows.append(row)
            cols.append(node)
            node = parents[node]
    mask = torch.zeros(num - first, num, dtype=torch.bool)
    mask[rows, cols] = True
    return mask
