"""Sampling parameters, the shared logit warp, and vocabulary-scale selection helpers.

The same warp (temperature, then top-k, then top-p, renormalised) is applied to the target and
to the draft distributions, so that verification compares like with like (DESIGN.md section 5).

The selection helpers (`topk_rows`, `global_topk`, `ResidualRow`) exist because tree builders run
on the CPU between drafter forwards: a plain `torch.topk` over a 49k-token row costs ~0.1-0.2 ms
here and a builder needs dozens of them. They split a row into fixed-size blocks, reduce each block
to its maximum or sum (a fast vectorised reduction), and only look inside the few blocks that can
matter. All of them are exact, never approximate.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

# Block length for the two-level selection helpers; common vocabularies (32000, 49152, 128256,
# 151936) are multiples of it. Other sizes fall back to whole-row operations.
BLOCK = 128
# Below this many entries per row the blocked path is not worth its extra ops.
_MIN_BLOCKED = 4 * BLOCK


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters; temperature 0 means greedy decoding."""

    temperature: float = 0.0  # >= 0; 0 selects greedy verification
    top_k: int = 0  # keep the k most likely tokens; 0 disables
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 disables

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def warp_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits [..., V] -> warped probabilities [..., V] (float32, rows sum to 1).

    Temperature, then top-k, then top-p, then renormalise. For greedy parameters the plain
    softmax at temperature 1 is returned: builders still need a ranking distribution, and the
    greedy verifier only looks at the target's argmax.
    """
    logits = logits.float()
    if params.is_greedy:
        return torch.softmax(logits, dim=-1)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass strictly
        # before it is still below top_p (so the most likely token always stays).
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _blocked(rows: Tensor) -> Tensor | None:
    """View rows [R, V] as [R, V // BLOCK, BLOCK] without copying, or None if not applicable."""
    vocab = rows.shape[-1]
    if vocab < _MIN_BLOCKED or vocab % BLOCK or not rows.is_contiguous():
        return None
    return rows.view(rows.shape[0], vocab // BLOCK, BLOCK)


def topk_rows(rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Exact per-row top-k of rows [R, V] -> (values [R, k], indices [R, k]), sorted descending.

    Two-level: the k blocks with the largest maxima contain a top-k set of the row (any block
    outside them is dominated by k block maxima), so only k * BLOCK entries are sorted.
    """
    k = min(k, rows.shape[-1])
    blocks = _blocked(rows)
    if blocks is None or k * BLOCK >= rows.shape[-1] // 2:
        return torch.topk(rows, k, dim=-1)
    num_rows = rows.shape[0]
    block_idx = blocks.amax(dim=2).topk(k, dim=1).indices  # [R, k]
    gathered = blocks.gather(1, block_idx[:, :, None].expand(num_rows, k, BLOCK))
    values, pos = gathered.reshape(num_rows, k * BLOCK).topk(k, dim=1)
    tokens = block_idx.gather(1, pos // BLOCK) * BLOCK + pos % BLOCK
    return values, tokens


def topk_rows_lists(rows: Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """`topk_rows` as Python lists (values, tokens): the same selection ops, but the token ids are
    computed in Python from the block and in-block positions, saving five small tensor ops."""
    k = min(k, rows.shape[-1])
    blocks = _blocked(rows)
    if blocks is None or k * BLOCK >= rows.shape[-1] // 2:
        values, tokens = torch.topk(rows, k, dim=-1)
        return values.tolist(), tokens.tolist()
    num_rows = rows.shape[0]
    block_idx = blocks.amax(dim=2).topk(k, dim=1).indices  # [R, k]
    gathered = blocks.gather(1, block_idx[:, :, None].expand(num_rows, k, BLOCK))
    values, pos = gathered.reshape(num_rows, k * BLOCK).topk(k, dim=1)
    tokens = [
        [bidx[p // BLOCK] * BLOCK + p % BLOCK for p in row_pos]
        for bidx, row_pos in zip(block_idx.tolist(), pos.tolist())
    ]
    return values.tolist(), tokens


def global_topk(rows: Tensor, row_scale: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """Top-n entries of row_scale[r] * rows[r, v] over all (r, v) of rows [R, V].

    Returns (values [m], row_index [m], token [m]) sorted descending, m = min(n, R * V). Used by
    OPT-Tree, whose next layer is the n best children of the whole layer. Same block argument as
    `topk_rows`, applied to the scaled block maxima of all rows at once.
    """
    num_rows, vocab = rows.shape
    n = min(n, num_rows * vocab)
    blocks = _blocked(rows)
    if blocks is None:
        flat = (rows * row_scale[:, None]).reshape(-1)
        values, pos = flat.topk(n)
        return values, pos // vocab, pos % vocab
    nb = vocab // BLOCK
    block_max = blocks.amax(dim=2) * row_scale[:, None]  # [R, nb]
    best = block_max.reshape(-1).topk(min(n, num_rows * nb)).indices  # flat (row, block)
    row_of = best // nb
    gathered = blocks[row_of, best % nb] * row_scale[row_of, None]  # [n, BLOCK]
    values, pos = gathered.reshape(-1).topk(n)
    cand = pos // BLOCK
    tokens = (best[cand] % nb) * BLOCK + pos % BLOCK
    return values, row_of[cand], tokens


class ResidualRow:
    """One draft distribution q [V] from which children are drawn one at a time, without
    replacement: the k-th draw comes from norm(q with the earlier draws removed), the residual of
    DySpec Algorithm 1 lines 7-11 (and Algorithm 2 lines 10-15).

    Nothing is renormalised over the vocabulary: the removed tokens and their mass are kept aside,
    and a draw walks precomputed block sums (sampling) or a lazily grown sorted prefix
    (deterministic descending order), so each draw is O(V / BLOCK + BLOCK) instead of O(V).
    """

    def __init__(self, row: Tensor) -> None:
        self.row = row  # [V] float, the original (warped) draft distribution
        self.removed: dict[int, float] = {}  # drawn token -> q[token]
        self.removed_mass = 0.0
        self._block_sums: list[float] | None = None
        self._sorted: list[tuple[float, int]] = []  # descending (prob, token) prefix
        self._next_rank = 0

    @classmethod
    def for_rows(cls, rows: Tensor, top: int = 0, block_sums: bool = False) -> list["ResidualRow"]:
        """ResidualRows for every row of rows [R, V], with the sorted prefix (`top` > 0) and/or the
        block sums computed by one batched op for all rows instead of one op per row."""
        out = [cls(row) for row in rows]
        if top:
            values, tokens = topk_rows_lists(rows, top)
            for res, vals, toks in zip(out, values, tokens):
                res._sorted = list(zip(vals, toks))
        if block_sums:
            blocks = _blocked(rows)
            sums = (blocks.sum(dim=2) if blocks is not None else rows).tolist()
            for res, row_sums in zip(out, sums):
                res._block_sums = row_sums
        return out

    @property
    def remaining(self) -> float:
        """Mass of q not yet drawn (1 - removed mass, up to float error)."""
        return max(0.0, 1.0 - self.removed_mass)

    def _take(self, token: int, prob: float) -> tuple[int, float]:
        self.remove(token, prob)
        return token, prob

    def remove(self, token: int, prob: float) -> None:
        """Exclude `token` (whose probability is `prob`) from later draws."""
        if token not in self.removed:
            self.removed[token] = prob
            self.removed_mass += prob

    def peek_top(self) -> tuple[int, float] | None:
        """Most likely token not drawn yet, as (token, q[token]), or None if the support is used up."""
        while True:
            if self._next_rank >= len(self._sorted):
                vocab = self.row.shape[0]
                if len(self._sorted) >= vocab:
                    return None
                k = min(vocab, max(8, 4 * len(self._sorted)))
                values, tokens = topk_rows_lists(self.row[None], k)
                self._sorted = list(zip(values[0], tokens[0]))
            prob, token = self._sorted[self._next_rank]
            if prob <= 0.0:
                return None
            if token in self.removed:
                self._next_rank += 1
                continue
            return token, prob

    def take_top(self) -> tuple[int, float] | None:
        """Draw the most likely remaining token deterministically (top-k order of the residual)."""
        top = self.peek_top()
        if top is None:
            return None
        self._next_rank += 1
        return self._take(*top)

    def sample(self, uniform: float) -> tuple[int, float] | None:
        """Draw from norm(residual) by inversion with `uniform` in [0, 1); None if nothing is left."""
        row = self.row
        vocab = row.shape[0]
        if self._block_sums is None:
            blocks = _blocked(row[None])
            sums = blocks[0].sum(dim=1) if blocks is not None else row
            self._block_sums = sums.tolist()
        width = BLOCK if len(self._block_sums) < vocab else 1
        sums = self._block_sums
        if self.removed:
            sums = list(sums)
            for tok, prob in self.removed.items():
                # Per-token sums (width 1) are zeroed exactly so no float residue stays drawable.
                sums[tok // width] = 0.0 if width == 1 else max(sums[tok // width] - prob, 0.0)
        cum = list(itertools.accumulate(sums))
        if not cum or cum[-1] <= 0.0:
            return None
        target = uniform * cum[-1]
        block = min(bisect.bisect_right(cum, target), len(cum) - 1)
        while sums[block] <= 0.0 and block > 0:  # float edge: landed on an empty block
            block -= 1
        if width == 1:
            token, prob = block, self._block_sums[block]
        else:
            start = block * width
            inside = row[start : start + width].tolist()
            for tok in self.removed:
                if start <= tok < start + width:
                    inside[tok - start] = 0.0
            inner = list(itertools.accumulate(inside))
            offset = target - (cum[block - 1] if block else 0.0)
            pos = min(bisect.bisect_right(inner, offset * inner[-1] / max(sums[block], 1e-300)), width - 1)
            while inside[pos] <= 0.0 and pos > 0:
                pos -= 1
            token, prob = start + pos, inside[pos]
        if prob <= 0.0 or token in self.removed:
            return None
        return self._take(token, prob)
