"""The token tree exchanged between drafter, target and router (docs/design.md section 3).

Node 0 is the ROOT: the last emitted token, not yet in the target's KV cache. Nodes 1.. are draft
tokens in topological order (every parent precedes its children). Siblings keep the order in which
they were drawn, which matters for verification of children sampled without replacement
(DySpec Algorithm 3 walks siblings in draw order); every re-indexing here preserves it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np
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
    if isinstance(value, Tensor):
        tensor = value
    else:
        # Plain sequences (the wire decode's lists) through numpy: several times faster than torch.as_tensor.
        array = np.asarray(value)
        if array.dtype.kind not in "iub":
            raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
        tensor = torch.from_numpy(array)
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got dtype {tensor.dtype}")
    return tensor.to(torch.long)


def _host(tensor: Tensor) -> np.ndarray:
    """A tensor's values as a numpy array (a view for a CPU tensor). A tree's per-node tensors hold a few
    hundred entries at most: numpy's reductions on them cost ~1 us, torch's ~3-5 us each."""
    return tensor.numpy() if tensor.device.type == "cpu" else tensor.cpu().numpy()


def _float_host(tensor: Tensor) -> np.ndarray:
    """A floating tensor's values as float32 or float64 numpy (numpy has no bfloat16; float64 holds it exactly)."""
    return _host(tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.double())


# Largest ChildDraw / Source value (validation compares with them per tree; max() over an enum costs ~1 us).
_MAX_DRAW = max(ChildDraw)
_MAX_SOURCE = max(Source)
_WITHOUT_REPLACEMENT = int(ChildDraw.WITHOUT_REPLACEMENT)


def _doubling_rounds(parents: np.ndarray) -> Iterator[np.ndarray]:
    """Pointer doubling over a tree given by parents [N] (parents[0] == -1, 0 <= parents[i] < i): yields, for
    distances s = 1, 2, 4, ..., int64 [N + 1], every node's ancestor at distance s, or N past the root. Index N is a
    sentinel whose own ancestor is itself; the rounds stop once no node has an ancestor at distance s, or at
    distance N, so malformed parents cannot loop forever. log2(depth) + 1 rounds of whole-tree numpy ops."""
    num = parents.shape[0]
    up = np.empty(num + 1, dtype=np.int64)
    up[:num] = parents
    up[:num][parents < 0] = num
    up[num] = num
    span = 1
    while span < num and bool((up[:num] < num).any()):
        yield up
        up = up[up]
        span *= 2


def _ancestor_table(parents: np.ndarray) -> np.ndarray:
    """int64 [N, W] for a tree given by parents [N] (parents[0] == -1, 0 <= parents[i] < i): entry [i, j] is
    node i's ancestor at distance j (column 0: i itself), or N past the root. W is the smallest power of two
    above the tree's depth.

    Pointer doubling (`_doubling_rounds`): with the columns for distances [0, s) and every node's ancestor at
    distance s known, one gather gives the columns [s, 2 s). So log2(depth) + 1 rounds of whole-tree numpy ops
    replace a Python walk of every root path (O(sum of depths) steps: ~0.1 ms for a 64-node tree, 0.6 ms for a
    64-node chain, 80 ms for a 768-node chain)."""
    num = parents.shape[0]
    table = np.arange(num + 1, dtype=np.int64)[:, None]  # distances [0, s)
    for up in _doubling_rounds(parents):
        table = np.concatenate((table, up[table]), axis=1)
    return table[:num]


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
            draw_t = torch.from_numpy(np.full(max(num, 0), int(child_draw), dtype=np.uint8))
        else:
            draw_t = _as_long("child_draw", child_draw).to(torch.uint8)
        if log_joint is None:
            lj = torch.zeros(max(num, 0))
        elif isinstance(log_joint, Tensor):
            lj = log_joint.to(torch.float32)
        else:  # numpy rounds float64 to float32 as torch.as_tensor does, several times faster on a list
            lj = torch.from_numpy(np.asarray(log_joint, dtype=np.float32))
        rows = None if draft_rows is None else _as_long("draft_rows", draft_rows)
        src = None if sources is None else _as_long("sources", sources)
        if src is not None and src.numel():
            values = _host(src)
            if values.min() < 0 or values.max() > _MAX_SOURCE:
                raise ValueError("sources must hold Source values")
        src = None if src is None else src.to(torch.uint8)
        return cls(tokens_t, _as_long("parents", parents), draw_t, lj, draft_probs, rows, src)

    # ------------------------------------------------------------------ validation
    # On numpy views of the per-node tensors (`_host`); only the [E, V] draft rows are reduced by torch.
    def _validate(self) -> None:
        tokens, parents = self.tokens, self.parents
        if tokens.dim() != 1 or tokens.shape[0] < 1 or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be a LongTensor [N] with N >= 1, got {tuple(tokens.shape)} {tokens.dtype}")
        num = tokens.shape[0]
        if _host(tokens).min() < 0:
            raise ValueError("tokens must be >= 0")
        if parents.shape != (num,) or parents.dtype != torch.long:
            raise ValueError(f"parents must be a LongTensor [{num}], got {tuple(parents.shape)} {parents.dtype}")
        par = _host(parents)
        if par[0] != -1:
            raise ValueError("parents[0] must be -1 (node 0 is the root)")
        if num > 1 and bool(((par[1:] < 0) | (par[1:] >= np.arange(1, num))).any()):
            raise ValueError("parents must satisfy 0 <= parents[i] < i (topological order, no cycles)")
        if self.child_draw.shape != (num,) or self.child_draw.dtype != torch.uint8:
            raise ValueError(f"child_draw must be a uint8 tensor [{num}], got {tuple(self.child_draw.shape)}")
        if _host(self.child_draw).max() > _MAX_DRAW:
            raise ValueError("child_draw holds a value that is not a ChildDraw")
        lj = self.log_joint
        if lj.shape != (num,) or not lj.dtype.is_floating_point:
            raise ValueError(f"log_joint must be a FloatTensor [{num}], got {tuple(lj.shape)} {lj.dtype}")
        if not bool((_float_host(lj) <= 1e-4).all()):  # NaN fails the comparison too
            raise ValueError("log_joint must hold log-probabilities (<= 0, no NaN)")
        src = self.sources
        if src is not None:
            if src.shape != (num,) or src.dtype != torch.uint8:
                raise ValueError(f"sources must be a uint8 tensor [{num}], got {tuple(src.shape)} {src.dtype}")
            values = _host(src)
            if values.max() > _MAX_SOURCE or values[0] != Source.MODEL:
                raise ValueError("sources must hold Source values, MODEL at the root")
        self._validate_draft(num)

    def _validate_draft(self, num: int) -> None:
        probs, rows = self.draft_probs, self.draft_rows
        needs_row = (_host(self.child_draw) == ChildDraw.WITHOUT_REPLACEMENT) & self._has_children
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
        row_of = _host(rows)
        if bool(((row_of < -1) | (row_of >= probs.shape[0])).any()):
            raise ValueError(f"draft_rows must lie in [-1, {probs.shape[0]})")
        if bool((needs_row & (row_of < 0)).any()):
            raise ValueError("draft_rows: a node with WITHOUT_REPLACEMENT children has no draft row")
        vocab = probs.shape[1]
        tokens = _host(self.tokens)
        if tokens.max() >= vocab:
            raise ValueError(f"tokens must be < vocab size {vocab} of draft_probs")
        if probs.shape[0]:
            # One reduction each: NaN propagates through amin and sum, so this also catches NaN.
            low = probs.amin()
            sums = probs.sum(dim=1)
            if bool(torch.isnan(low)) or float(low) < 0:
                raise ValueError("draft_probs must be non-negative and free of NaN")
            if bool(((sums - 1).abs() > _SUM_TOL).any()):
                raise ValueError("draft_probs rows must sum to 1")
            par = _host(self.parents)
            child = np.nonzero(needs_row[np.maximum(par, 0)] & (par >= 0))[0]
            if child.size:
                at_parent = probs[torch.from_numpy(row_of[par[child]]), torch.from_numpy(tokens[child])]
                if bool((at_parent <= 0).any()):
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

    @cached_property
    def needs_draft_rows(self) -> bool:
        """Whether verification reads draft probabilities: some node has WITHOUT_REPLACEMENT children."""
        return bool(((_host(self.child_draw) == ChildDraw.WITHOUT_REPLACEMENT) & self._has_children).any())

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
        """LongTensor [N]: root 0, its children 1, ... By pointer doubling (`_doubling_rounds`): with dist[i] the
        number of edges from node i up to its ancestor at distance s, jump[i] (or the sentinel N past the root,
        where dist[i] is i's depth), dist[i] += dist[jump[i]] doubles the reach."""
        parents = _host(self.parents)
        num = parents.shape[0]
        dist = np.zeros(num + 1, dtype=np.int64)
        dist[:num] = parents >= 0
        for jump in _doubling_rounds(parents):
            dist += dist[jump]
        return torch.from_numpy(dist[:num])

    @cached_property
    def _children(self) -> list[list[int]]:
        # A Python pass: at builder sizes (~64 nodes) it beats a numpy stable sort by parent plus offsets.
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(self.parent_list[1:], start=1):
            kids[p].append(i)
        return kids

    @cached_property
    def _has_children(self) -> np.ndarray:
        mask = np.zeros(self.num_nodes, dtype=bool)
        mask[_host(self.parents)[1:]] = True
        return mask

    @cached_property
    def has_children_mask(self) -> Tensor:
        """bool [N]: node has at least one child."""
        return torch.from_numpy(self._has_children)

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
        """Sub-tree of the kept nodes (root implied), re-indexed in the old relative order; the kept set's rules
        are `select_nodes`'."""
        keep = _as_long("keep_nodes", keep_nodes).reshape(-1).tolist()
        order, parents = select_nodes(self.parent_list, keep, self.child_draw_list)
        return self._reindex(torch.tensor(order, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def _reindex(self, order: Tensor, parents: Tensor | None = None) -> "TokenTree":
        """The tree of nodes `order` (a topological order of some nodes, the root first); `parents`: their
        parents re-indexed, if the caller has them."""
        if parents is None:
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


def select_nodes(parents: Sequence[int], keep: Iterable[int],
                 child_draw: Sequence[int]) -> tuple[list[int], list[int]]:
    """Which nodes a sub-tree keeps, the one statement of it (`TokenTree.select`, and builders'
    `PartialTree.finish` on their own lists): the kept nodes `keep` plus the root, as (their old ids in ascending
    order, their parents re-indexed to positions in that order), for a tree given by `parents` and `child_draw`
    (ChildDraw values).

    The kept set must be closed under ancestors, so the order is topological and keeps siblings in draw order.
    Under a WITHOUT_REPLACEMENT parent it must keep a prefix of the siblings: a later sibling was drawn from a
    residual that excludes the earlier ones, so dropping an earlier one would make verification lossy.

    On Python lists: for builder-sized trees (tens to hundreds of nodes) a few comprehensions beat the ~15
    tensor ops of a mask-based selection, and builders hold lists anyway."""
    num = len(parents)
    order = sorted({int(k) for k in keep} | {0})
    if order[-1] >= num or order[0] < 0:
        raise ValueError(f"keep_nodes must lie in [0, {num})")
    new_index = {old: new for new, old in enumerate(order)}
    kept_parents = [-1] + [new_index.get(parents[old], -2) for old in order[1:]]
    if -2 in kept_parents:
        raise ValueError("keep_nodes must be closed under ancestors")
    if _WITHOUT_REPLACEMENT in child_draw:
        cut: set[int] = set()  # WITHOUT_REPLACEMENT parents with a dropped child
        for node in range(1, num):
            parent = parents[node]
            if child_draw[parent] == _WITHOUT_REPLACEMENT:
                if node not in new_index:
                    cut.add(parent)
                elif parent in cut:
                    raise ValueError("keep_nodes must keep a prefix of WITHOUT_REPLACEMENT siblings")
    return order, kept_parents


def ancestor_mask(parents: Sequence[int] | Tensor, first: int = 0) -> Tensor:
    """Tree attention, the one place it is built: bool [N - first, N] over a tree given by `parents` (node 0
    the root, parents[0] == -1, 0 <= parents[i] < i). Row r is node first + r and is True at that node and
    at each of its ancestors. `first` > 0 gives only the rows of nodes appended after the first `first`
    ones (a cached model feeds a tree in several forwards: engine/runners/cached_lm.py).

    Every row is set in one indexed write from the ancestor table (`_ancestor_table`, pointer doubling in
    numpy); the past-the-root entries point at the row's own node, True anyway."""
    par = np.asarray(parents, dtype=np.int64)
    num = par.shape[0]
    table = _ancestor_table(par)[first:]
    own = np.arange(first, num, dtype=np.int64)[:, None]
    table = np.where(table < num, table, own)
    mask = np.zeros((num - first, num), dtype=bool)
    mask[np.arange(num - first)[:, None], table] = True
    return torch.from_numpy(mask)
