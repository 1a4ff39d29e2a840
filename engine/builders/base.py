"""Protocols shared by the tree builders, and the append-only partial tree they grow.

A model-backed `DraftOracle` caches the drafter's KV for nodes it has already seen, so builders
only ever append nodes while they query it (re-indexing happens once, at the end, in
`PartialTree.finish`, by the rule of `TokenTree.select`), and ask for all frontier nodes of a layer in
one call where the algorithm allows it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from ..c2t_classifier import top_entropy
from ..lookup.suffix_index import LookupRow
from ..lookup.trees import LookupPlan
from ..requests import SamplingParams
from ..sampling import sample_row, topk_rows
from ..tree import ChildDraw, TokenTree, select_nodes


@dataclass
class RowSummary:
    """The part of a batch of draft rows that top-k builders read: their largest entries, and the
    C2T entropy feature when asked. An oracle that can compute it next to its forward (on the
    drafter's own head, before any scatter to the full vocabulary: `DraftOracle.summarize`) saves
    the builder a pass over every full row; `PartialTree.top` computes it from the rows otherwise."""

    values: Tensor  # [n, k] the k largest draft probabilities of each row, descending
    tokens: Tensor  # [n, k] their token ids (ties in any order)
    entropy: Tensor | None = None  # [n] entropy of each row's top-1000 probabilities (C2T eq. 2-3)


# The optional fast paths' signatures (see `DraftOracle`); each takes the partial tree as `probs` does.
Summarize = Callable[[Sequence[int], Sequence[int], Sequence[int], int, bool], RowSummary]
Sample = Callable[[Sequence[int], Sequence[int], int, float], "tuple[Tensor, int | None, float, float]"]


@runtime_checkable
class LookupSource(Protocol):
    """Copy-from-context candidates next to a model drafter's rows (a hybrid oracle: engine/lookup/ HybridOracle),
    as one capability: an oracle has all of it (`DraftOracle.lookup`) or none. Each node query takes the partial
    tree's own lists as `DraftOracle.probs` does. Builders consult it the same way: greedy and top-k ones read the
    oracle's merged rows and never touch it; sampled ones make a node's candidates deterministic children (their
    Source from `source_of`, verified by the point-mass rule) and sample the model's children from
    `model_probs` without those tokens, only where `model_backed`."""

    def candidates(self, tokens: Sequence[int], parents: Sequence[int], node: int) -> LookupRow | None:
        """The node's candidates (tokens, calibrated probabilities, descending), None where it has none."""
        ...

    def model_backed(self, tokens: Sequence[int], parents: Sequence[int], node: int) -> bool:
        """Whether the model drafter gives the node a row (not below confident lookup nodes, nor on lookup-only
        steps)."""
        ...

    def model_probs(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int]) -> Tensor:
        """[k, V] the model drafter's own rows of model-backed nodes, no lookup mass mixed in."""
        ...

    def source_of(self, parent: int, token: int) -> int:
        """The tree.Source of a child `token` of `parent` (a node the source has seen)."""
        ...

    def plan(self, root_token: int, max_nodes: int, min_value: float) -> LookupPlan:
        """The lookup-only tree of the step (method "lookup")."""
        ...


class DraftOracle(Protocol):
    """Next-token draft distributions for nodes of a partial tree, and optional capabilities.

    `probs` is required. The optional capabilities are declared attributes, None where an oracle has
    none: an oracle subclasses DraftOracle to inherit those None defaults, and overrides the ones it
    offers (builders read them as attributes, never probe for them).

    Fast paths (a model oracle: engine/drafters/model_runner.py SessionOracle):
      summarize(tokens, parents, node_ids, k, entropy) -> RowSummary: must equal summarising the rows
        `probs` would return: values/tokens = their top-k (values exact and descending), entropy =
        `top_entropy` of them.
      sample(tokens, parents, node, uniform) -> (row, token, q[token], row sum): the row `probs` returns
        for `node` [V] and `sample_row(row, uniform)`, a draw by inversion, made on the drafter's own head
        right after the softmax, while the row is hot (on a GPU: on the device).
    Copy-from-context candidates (a hybrid oracle: engine/lookup/ HybridOracle):
      lookup -> LookupSource: its `probs` and `summarize` then give the merged rows, and sampled builders
        draw from `lookup.model_probs` instead of `sample`.
    """

    vocab_size: int
    summarize: Summarize | None = None
    sample: Sample | None = None
    lookup: LookupSource | None = None

    def probs(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int]) -> Tensor:
        """tokens/parents: [n_so_far], the append-only partial tree (node 0 = root);
        node_ids: [k] nodes whose next-token distributions are wanted (one drafter forward);
        returns [k, vocab] warped draft probabilities (warp_probs with the request's SamplingParams).

        The three inputs are the builder's own lists, valid for the duration of the call only (read,
        never kept or changed). Plain sequences, not tensors: builders call the oracle right after
        drafter forwards have streamed the weights through every cache, when each torch call on the
        builder's side costs ~8 us instead of ~1 (this project's 2-core Xeon), and a model oracle
        wants Python ints anyway (cache slots, KV bookkeeping). The returned tensor must not be
        overwritten afterwards: builders keep references to its rows (no copy) in the finished
        TokenTree for verification (`PartialTree.finish`)."""
        ...


@runtime_checkable
class TreeBuilder(Protocol):
    # The field the hardware-aware chooser sets to its step budget (engine/budget.py): "budget" (draft nodes),
    # "length" (a fixed chain), or None for shapes it does not size (a static tree, C2T's classifier-cut chain).
    size_field: ClassVar[str | None]

    def build(self, root_token: int, oracle: DraftOracle, sampling: SamplingParams, generator: torch.Generator) -> TokenTree:
        ...


# Kept draft rows must sum to 1 within this tolerance (float32 softmax output).
_ROW_SUM_TOL = 1e-3
_TOP_K, _WITHOUT_REPLACEMENT = int(ChildDraw.TOP_K), int(ChildDraw.WITHOUT_REPLACEMENT)


def safe_log(prob: float) -> float:
    return math.log(prob) if prob > 0.0 else float("-inf")


class PartialTree:
    """Append-only tree under construction; `finish` validates it into a TokenTree."""

    def __init__(self, root_token: int, oracle: DraftOracle) -> None:
        if not isinstance(root_token, int) or root_token < 0 or root_token >= oracle.vocab_size:
            raise ValueError(f"root_token must lie in [0, {oracle.vocab_size}), got {root_token!r}")
        self.oracle = oracle
        self._summarize = oracle.summarize
        # Copy-from-context candidates (engine/lookup/ HybridOracle), None for a model-only oracle. Sampled
        # children then come from the model's own rows (`query_model`), never from the merged rows' `sample`.
        self.lookup: LookupSource | None = oracle.lookup
        self._sample = oracle.sample if self.lookup is None else None
        self.tokens: list[int] = [root_token]
        self.parents: list[int] = [-1]
        self.log_joint: list[float] = [0.0]
        self.draw: list[int] = [_TOP_K]
        self.sources: list[int] = [0]  # Source set by the builder (`add_copy`); see `finish`
        self.rows: dict[int, Tensor] = {}  # node -> draft row kept for verification
        self._unchecked: list[int] = []  # nodes whose kept row has not been checked to sum to 1

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, log_q: float, source: int = 0) -> int:
        """Append a child of `parent`; returns its node index. `source` (a tree.Source): who proposed it;
        builders set it only for deterministic lookup children of a WITHOUT_REPLACEMENT parent (`finish`
        labels the others)."""
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.log_joint.append(self.log_joint[parent] + log_q)
        self.draw.append(_TOP_K)  # overwritten by set_draw if it gets children
        self.sources.append(source)
        return len(self.tokens) - 1

    # ------------------------------------------------------------------ copy-from-context (`self.lookup` set)
    def candidates(self, node: int) -> LookupRow | None:
        """`node`'s copy-from-context candidates (`LookupSource.candidates`); only with a lookup source."""
        return self.lookup.candidates(self.tokens, self.parents, node)

    def model_backed(self, node: int) -> bool:
        """Whether the model drafter gives `node` a draft row (always, without a lookup source)."""
        return self.lookup is None or self.lookup.model_backed(self.tokens, self.parents, node)

    def query_model(self, node_ids: Sequence[int]) -> Tensor:
        """The model drafter's own rows [k, V] (no lookup mass mixed in): what sampled builders draw from;
        `query` without a lookup source."""
        if self.lookup is None:
            return self.query(node_ids)
        out = self.lookup.model_probs(self.tokens, self.parents, node_ids)
        if out.shape != (len(node_ids), self.oracle.vocab_size):
            raise ValueError(f"oracle model_probs must have shape [{len(node_ids)}, {self.oracle.vocab_size}]")
        return out

    def add_copy(self, parent: int, token: int, prob: float) -> int:
        """Append a lookup candidate (`token`, calibrated probability `prob`) of `parent` as a deterministic
        child labelled by `LookupSource.source_of`: sampled builders add these before sampling `parent`'s
        model children, and the verifier tests them by the point-mass rule first; returns its index."""
        return self.add(parent, token, safe_log(prob), source=self.lookup.source_of(parent, token))

    def add_many(self, parent: int, tokens: Sequence[int], log_qs: Sequence[float]) -> int:
        """Append children of `parent` in order (same as `add` for each); returns the first new
        node index (the others follow consecutively)."""
        return self.extend([parent] * len(tokens), tokens, log_qs)

    def extend(self, parents: Sequence[int], tokens: Sequence[int], log_qs: Sequence[float]) -> int:
        """Append nodes with the given parents (existing nodes) in order; returns the first new node
        index. A whole layer in one call: list extends instead of one `add` per node."""
        first = len(self.tokens)
        joint = self.log_joint
        self.tokens.extend(tokens)
        self.parents.extend(parents)
        joint.extend([joint[p] + lq for p, lq in zip(parents, log_qs)])
        self.draw.extend([_TOP_K] * len(tokens))
        self.sources.extend([0] * len(tokens))
        return first

    def query(self, node_ids: Sequence[int]) -> Tensor:
        """One oracle call for `node_ids` -> [k, V] draft probabilities. The oracle reads the partial
        tree's own lists, for the duration of the call."""
        out = self.oracle.probs(self.tokens, self.parents, node_ids)
        count, vocab = len(node_ids), self.oracle.vocab_size
        if out.dim() != 2 or out.shape != (count, vocab):
            raise ValueError(f"oracle probs must have shape [{count}, {vocab}], got {tuple(out.shape)}")
        return out

    def add_sampled_child(self, node: int, uniform: float) -> int | None:
        """Draw one child of `node` by inversion of its draft row with `uniform` (the oracle's own `sample`
        where it has one, else `sample_row` on the row: the model's own row, with a lookup source), record how
        it was drawn (WITHOUT_REPLACEMENT, the row kept for verification) and append it; returns the child's
        index, or None (nothing added) if the row holds no mass. One call per token of a sampled chain, which
        runs right after a drafter forward, when every Python call costs several microseconds: the steps are
        written out here."""
        if self._sample is None:
            row = self.query_model([node])[0]
            token, prob, total = sample_row(row, uniform)
        else:
            out = self._sample(self.tokens, self.parents, node, uniform)
            if len(out) != 4 or out[0].shape != (self.oracle.vocab_size,):
                raise ValueError(f"oracle sample must return a [{self.oracle.vocab_size}] row and one draw")
            row, token, prob, total = out
        if token is None:
            return None
        if not abs(total - 1.0) <= _ROW_SUM_TOL:  # also catches NaN
            raise ValueError("oracle probs: a draft row used for verification is NaN or does not sum to 1")
        self.draw[node] = _WITHOUT_REPLACEMENT
        self.rows.setdefault(node, row)
        self.tokens.append(int(token))
        self.parents.append(node)
        self.log_joint.append(self.log_joint[node] + (math.log(prob) if prob > 0.0 else -math.inf))
        self.draw.append(_TOP_K)
        self.sources.append(0)
        return len(self.tokens) - 1

    def top(self, node_ids: Sequence[int], k: int, entropy: bool = False) -> RowSummary:
        """The top-k (and optionally the C2T entropy) of `node_ids`' draft rows, in one oracle call:
        from the oracle's own `summarize` where it has one, else from the full rows."""
        count, k = len(node_ids), min(k, self.oracle.vocab_size)
        if self._summarize is None:
            rows = self.query(node_ids)
            values, tokens = topk_rows(rows, k)
            return RowSummary(values, tokens, top_entropy(rows) if entropy else None)
        out = self._summarize(self.tokens, self.parents, node_ids, k, entropy)
        if out.values.shape != (count, k) or out.tokens.shape != (count, k):
            raise ValueError(f"oracle summary must hold [{count}, {k}] values and tokens, got "
                             f"{tuple(out.values.shape)} and {tuple(out.tokens.shape)}")
        if entropy and (out.entropy is None or out.entropy.shape != (count,)):
            raise ValueError(f"oracle summary must hold a [{count}] entropy")
        # topk ranks NaN first: a NaN row shows here (numpy: a torch reduction costs ~10x more here)
        if not math.isfinite(float(out.values.numpy().sum())):
            raise ValueError("oracle probs: a draft row is NaN or infinite")
        return out

    def set_draw(self, node: int, draw: ChildDraw, row: Tensor | None = None, total: float | None = None) -> None:
        """Record how `node`'s children are drawn, and the distribution they came from if the
        verification rule needs it (WITHOUT_REPLACEMENT). Only a reference to `row` is kept (no
        copy). `total`, if known (ResidualRow.total), is the row's sum: it is checked here in
        Python instead of by a reduction over the row in `finish`."""
        self.draw[node] = int(draw)
        if row is not None and node not in self.rows:
            self.rows[node] = row
            if total is None:
                self._unchecked.append(node)
            elif not abs(total - 1.0) <= _ROW_SUM_TOL:  # also catches NaN
                raise ValueError("oracle probs: a draft row used for verification is NaN or does not sum to 1")

    def finish(self, keep: Sequence[int] | Tensor | None = None) -> TokenTree:
        """Validate into a TokenTree; `keep` (optional) selects a sub-tree, re-indexed (`tree.select_nodes`,
        on the builder's lists: no full tree is built first).

        Kept draft rows are handed to the tree as a list of references, stacked only if someone
        reads `TokenTree.draft_probs` (verification reads single rows), so finishing costs no
        copy of [E, V] floats."""
        num = len(self.tokens)
        probs: list[Tensor] | None = None
        row_of = [-1] * num
        if self.rows:
            if self._unchecked:
                sums = torch.stack([self.rows[n].sum() for n in self._unchecked])
                # Only these rows feed verification; NaN fails the comparison too.
                if not bool(((sums.double() - 1).abs() <= _ROW_SUM_TOL).all()):
                    raise ValueError("oracle probs: a draft row used for verification is NaN or does not sum to 1")
                self._unchecked = []
            nodes = sorted(self.rows)
            probs = [self.rows[n] if self.rows[n].dtype == torch.float32 else self.rows[n].float() for n in nodes]
            for index, node in enumerate(nodes):
                row_of[node] = index
        tokens, parents, draw, log_joint = self.tokens, self.parents, self.draw, self.log_joint
        sources = self._final_sources()
        if keep is not None:
            order, parents = select_nodes(parents, keep.tolist() if isinstance(keep, Tensor) else keep, draw)
            tokens, draw = [tokens[old] for old in order], [draw[old] for old in order]
            log_joint, row_of = [log_joint[old] for old in order], [row_of[old] for old in order]
            if sources is not None:
                sources = [sources[old] for old in order]
                sources = sources if any(sources) else None
            if probs is not None:
                used = [r for r in row_of if r >= 0]
                probs = [probs[r] for r in used] or None
                renumber = {r: i for i, r in enumerate(used)}
                row_of = [renumber.get(r, -1) for r in row_of]
        # Valid by construction (append-only, parents precede children): skip re-validation.
        # numpy converts the lists several times faster than torch.tensor(list).
        return TokenTree._trusted(
            torch.from_numpy(np.array(tokens, dtype=np.int64)),
            torch.from_numpy(np.array(parents, dtype=np.int64)),
            torch.from_numpy(np.array(draw, dtype=np.uint8)),
            torch.from_numpy(np.array(log_joint, dtype=np.float32)),
            probs,
            torch.from_numpy(np.array(row_of, dtype=np.int64)) if probs is not None else None,
            torch.from_numpy(np.array(sources, dtype=np.uint8)) if sources is not None else None,
        )

    def _final_sources(self) -> list[int] | None:
        """Each node's Source, or None if every node is the model's. A lookup source labels the children of
        deterministic parents (a token among the parent's lookup candidates is LOOKUP or BOTH); children of
        WITHOUT_REPLACEMENT parents keep the builder's labels (`add(..., source)`): there a lookup child was
        proposed before the sampled ones and is verified differently, whatever its token."""
        labels = self.sources
        if self.lookup is not None:
            source_of = self.lookup.source_of
            labels = list(labels)
            draw, parents, tokens = self.draw, self.parents, self.tokens
            for node in range(1, len(tokens)):
                parent = parents[node]
                if draw[parent] != _WITHOUT_REPLACEMENT:
                    labels[node] = source_of(parent, tokens[node])
        return labels if any(labels) else None


class UniformStream:
    """Uniform draws in [0, 1) fetched from the generator in chunks (one RNG call per chunk)."""

    def __init__(self, generator: torch.Generator, chunk: int = 64) -> None:
        self.generator = generator
        self.chunk = max(1, chunk)
        self._buffer: list[float] = []

    def next(self) -> float:
        if not self._buffer:
            self._buffer = torch.rand(self.chunk, generator=self.generator, dtype=torch.float64).tolist()
        return self._buffer.pop()
