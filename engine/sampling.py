"""Sampling parameters, the shared logit warp, and vocabulary-scale selection helpers.

The same warp (temperature, then top-k, then top-p, renormalised) is applied to the target and
to the draft distributions, so that verification compares like with like (docs/design.md section 5).

The selection helpers (`topk_rows`, `ResidualRow`) exist because tree builders run
on the CPU between drafter forwards: a plain `torch.topk` over a 49k-token row costs ~0.1-0.2 ms
here and a builder needs dozens of them. They split a row into groups, reduce each group to its
maximum or sum in one vectorised pass, and only look inside the few groups that can matter: top-k
uses strided column groups (`GROUP` rows of a [GROUP, V / GROUP] view, whose column maximum is a
plain elementwise max), sampling uses contiguous blocks of `BLOCK` tokens (whose sums give an
inverse-CDF order). All of them are exact, never approximate. After the one pass per row, work is
on small tensors and Python floats, so a builder's cost is one pass per expanded node plus a few
small ops, not a Python loop over the vocabulary.
"""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from .requests import SamplingParams

# Block length for the two-level selection helpers; common vocabularies (32000, 49152, 128256,
# 151936) are multiples of it. Other sizes fall back to whole-row operations.
BLOCK = 128
# Below this many entries per row the blocked path is not worth its extra ops.
_MIN_BLOCKED = 4 * BLOCK
# Rows of the strided [GROUP, V // GROUP] view used by ResidualRow's top-k (columns = groups).
GROUP = 32


def warp_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits [..., V] -> warped probabilities [..., V] (float32, rows sum to 1).

    Temperature, then top-k, then top-p, then renormalise. For greedy parameters the plain
    softmax at temperature 1 is returned: builders still need a ranking distribution, and the
    greedy verifier only looks at the target's argmax.
    """
    logits = logits.float()
    if params.is_greedy:
        return torch.softmax(logits, dim=-1)
    logits = logits / params.temperature  # a new tensor: masked in place below
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits.masked_fill_(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p_(probs, params.top_p)
    return probs


# The sorted prefix (top-k) the top-p warp tries before sorting a row: the nucleus of a peaked row (most rows of a
# trained model at temperature <= 1) lies in its first few hundred tokens, and the top-256 of 65 x 128256 rows
# take ~25 ms on one thread where torch.sort of the rows takes ~0.9 s.
TOP_P_PREFIX = 256


def _top_p_(probs: Tensor, top_p: float) -> Tensor:
    """The top-p cut of probability rows [..., V], renormalised, in place: the smallest prefix of each row sorted
    descending whose mass reaches top_p, i.e. a token stays if the mass strictly before it is still below top_p
    (so the most likely token always stays; ties at the cut are broken either way, as by a sort).

    Exactly what sorting every row with torch.sort gives (bitwise, but for which of equal tokens at the cut stay),
    for a fraction of the cost on large vocabularies. A row's top-k (`TOP_P_PREFIX`) is tried first: it decides the
    row when the cut falls inside it, i.e. when its last entry is already dropped (or is 0: fewer than k tokens
    have mass). Its masses-before are bitwise those of the full sort: torch's CPU cumsum adds in order, and the
    top-k values are the sorted row's first k whatever their ties. Every later token is dropped too, and the kept
    tokens are a prefix: a token's mass-before (running sum minus its own mass) is at least that of any token
    before it, as the running sum only grows and its own mass is no larger. The other rows are cut at a value
    found from their values alone (`_top_p_by_value`). Off the CPU (where cumsum need not add in order, and
    sorting is cheap) every row is sorted, as before (and so are rows that carry gradients). Writes into `probs`
    (warp_probs' own softmax output) to spare fresh allocations of the rows' size."""
    vocab = probs.shape[-1]
    rows = probs.reshape(-1, vocab)
    if probs.device.type != "cpu" or rows.shape[0] == 0 or probs.requires_grad:
        return _top_p_sorted(rows, top_p).reshape(probs.shape)
    todo = torch.arange(rows.shape[0])
    if 2 * TOP_P_PREFIX <= vocab:
        values, index = topk_rows(rows, TOP_P_PREFIX)
        keep = (torch.cumsum(values, dim=-1) - values) < top_p
        decided = ~keep[:, -1] | (values[:, -1] == 0)
        if bool(decided.any()):
            done = todo[decided]
            rows.index_fill_(0, done, 0.0)
            rows[done[:, None], index[decided]] = values[decided].masked_fill(~keep[decided], 0.0)
            todo = todo[~decided]
    if len(todo):
        rows[todo] = _top_p_by_value(rows[todo], top_p)
    rows.div_(rows.sum(dim=-1, keepdim=True))
    return rows.reshape(probs.shape)  # `probs` itself where `rows` is a view of it


def _top_p_by_value(rows: Tensor, top_p: float) -> Tensor:
    """CPU rows [R, V] with every token the top-p rule drops set to 0 (not renormalised), as `_top_p_masked` gives
    them, from the rows' sorted values alone: numpy sorts float32 values ~10x faster than torch.sort sorts them
    with their indices. The kept prefix is n tokens (the sorted masses-before below top_p: the same cumsum over
    the same values); they are the tokens above the first dropped value c, and where the prefix ends inside a
    run of tokens equal to c, as many of those as it holds (the first by id)."""
    vocab = rows.shape[-1]
    ordered = torch.from_numpy(np.ascontiguousarray(np.sort(rows.numpy(), axis=-1)[:, ::-1]))
    n = ((torch.cumsum(ordered, dim=-1) - ordered) < top_p).sum(-1).clamp(min=1)  # the first mass-before is 0
    cut = ordered.gather(1, n.clamp(max=vocab - 1)[:, None])
    cut[n == vocab] = -1.0  # every token stays
    out = rows.masked_fill(rows <= cut, 0.0)
    last = ordered.gather(1, (n - 1)[:, None])
    for r in ((last == cut)[:, 0] & (n < vocab)).nonzero()[:, 0].tolist():  # the cut splits a run of equal tokens
        value = float(cut[r])
        ties = (rows[r] == value).nonzero()[:, 0]
        out[r, ties[:int(n[r]) - int((rows[r] > value).sum())]] = value
    return out


def _top_p_masked(rows: Tensor, top_p: float) -> Tensor:
    """Rows [R, V] with every token the top-p rule drops set to 0 (not renormalised), by sorting each row whole."""
    sorted_probs, order = torch.sort(rows, dim=-1, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return rows.masked_fill(drop, 0.0)


def _top_p_sorted(rows: Tensor, top_p: float) -> Tensor:
    masked = _top_p_masked(rows, top_p)
    return masked / masked.sum(dim=-1, keepdim=True)


def _blocked(rows: Tensor) -> Tensor | None:
    """View rows [R, V] as [R, V // BLOCK, BLOCK] without copying, or None if not applicable."""
    vocab = rows.shape[-1]
    if vocab < _MIN_BLOCKED or vocab % BLOCK or not rows.is_contiguous():
        return None
    return rows.view(rows.shape[0], vocab // BLOCK, BLOCK)


def _grid(rows: Tensor, k: int) -> Tensor | None:
    """rows [R, V] viewed as [R, GROUP, V // GROUP] without copying (column c of a row = tokens
    c, c + V/GROUP, ...), or None where the strided two-level top-k does not apply or pay."""
    vocab = rows.shape[-1]
    if vocab < _MIN_BLOCKED or vocab % GROUP or not rows.is_contiguous() or k >= vocab // GROUP // 2:
        return None
    return rows.view(rows.shape[0], GROUP, vocab // GROUP)


def _grid_topk(grid: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """(values [R, k], positions [R, k] in the gathered [GROUP, k] candidates, columns [R, k]).

    The k columns with the largest maxima contain a top-k set of the row (any entry of another
    column is dominated by k distinct column maxima), so only GROUP * k entries are ranked. The
    column maximum is an elementwise max over the GROUP slices of the row: the cheapest full pass
    on one core (~30% cheaper than maxima of contiguous blocks)."""
    num_rows = grid.shape[0]
    cols = grid.amax(dim=1).topk(k, dim=1).indices  # [R, k]
    cand = grid.gather(2, cols[:, None, :].expand(num_rows, GROUP, k))  # [R, GROUP, k]
    values, pos = cand.reshape(num_rows, GROUP * k).topk(k, dim=1)
    return values, pos, cols


def topk_rows(rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Exact per-row top-k of rows [R, V] -> (values [R, k], indices [R, k]), sorted descending,
    by a two-level selection over strided column groups (`_grid_topk`)."""
    k = min(k, rows.shape[-1])
    grid = _grid(rows, k)
    if grid is None:
        return torch.topk(rows, k, dim=-1)
    values, pos, cols = _grid_topk(grid, k)
    tokens = (pos // k) * grid.shape[2] + cols.gather(1, pos % k)
    return values, tokens


def sample_row(row: Tensor, uniform: float) -> tuple[int | None, float, float]:
    """One draw from row / sum(row) by inversion with `uniform` in [0, 1): (token, q[token], sum(row)),
    token None when the row holds no mass. For a single draw per row (an SpS chain) this skips
    ResidualRow's per-block Python bookkeeping: float32 sums of BLOCK-token blocks (one vectorised
    pass), their float64 cumulative sum to pick the block, then one block's float64 cumulative sum,
    the precision of ResidualRow's draws. A NaN row is a ValueError."""
    blocks = _blocked(row[None])
    if blocks is None:
        sums, width = row.double(), 1  # [V] small or unaligned rows: every token is its own block
    else:
        sums, width = blocks[0].sum(dim=1).double(), BLOCK  # [V // BLOCK]
    cum = sums.cumsum(0)
    total = float(cum[-1])
    if math.isnan(total):
        raise ValueError("oracle probs: a draft row is NaN")
    if not total > 0.0:
        return None, 0.0, total
    target = uniform * total
    block = min(int(torch.searchsorted(cum, target, right=True)), sums.numel() - 1)
    while float(sums[block]) <= 0.0 and block > 0:  # float edge at the top end: the last block with mass
        block -= 1
    token = block
    if width > 1:
        first = block * width
        inner = row[first:first + width].cumsum(0, dtype=torch.float64)
        # The offset into the block, rescaled to its own cumulative sum (which may round differently).
        offset = (target - (float(cum[block - 1]) if block else 0.0)) * float(inner[-1]) / float(sums[block])
        token = first + min(int(torch.searchsorted(inner, offset, right=True)), width - 1)
        while float(row[token]) <= 0.0 and token > first:
            token -= 1
    return token, float(row[token]), total


class ResidualRow:
    """One draft distribution q [V] from which children are drawn one at a time, without
    replacement: the k-th draw comes from norm(q with the earlier draws removed), the residual of
    DySpec Algorithm 1 lines 7-11 (and Algorithm 2 lines 10-15).

    Nothing is renormalised over the vocabulary: the residual is kept as a running subtraction on
    per-block sums of the single original row (a removed token's mass is subtracted from its
    block's sum, and its group of ~sqrt(V / BLOCK) blocks re-added), and a draw walks the group
    sums, one group's block sums, then one block (sampling), or a lazily grown sorted prefix
    (deterministic descending order). A draw therefore costs O(sqrt(V / BLOCK) + BLOCK)
    Python-level work however many tokens were removed before it, and one vectorised pass over
    the row in all (block sums or block maxima, computed on first use).
    """

    def __init__(self, row: Tensor | None, fetch_row: Callable[[], Tensor] | None = None) -> None:
        self._row = row  # [V] float, the original (warped) draft distribution; None until fetched
        self._fetch_row = fetch_row  # gives the row when it is first needed (see `from_top`)
        self.removed: dict[int, float] = {}  # drawn token -> q[token]
        self.removed_mass = 0.0
        self._block_sums: list[float] | None = None  # residual block sums (removed mass subtracted)
        self._width = 0  # tokens per entry of _block_sums (BLOCK, or 1 for unblocked rows)
        self._removed_in: dict[int, list[int]] = {}  # block -> removed tokens in it
        # Blocks grouped by ~sqrt(#blocks): a draw walks the group sums, then one group's blocks, then
        # one block, so no pass over all block sums follows each removal (384 blocks at V = 49,152).
        self._group = 1  # blocks per group
        self._group_sums: list[float] = []  # each group's block sums, re-added after a removal
        self._cum: list[float] | None = None  # prefix sums of _group_sums; None when stale
        self._flat: np.ndarray | None = None  # the row as a numpy view (CPU), for cheap block slices
        self.total: float | None = None  # sum of the original row, once the block sums exist
        self._sorted: list[tuple[float, int]] = []  # descending (prob, token) prefix
        self._next_rank = 0
        self._block_max: Tensor | None = None  # [V // GROUP] column maxima, kept to grow _sorted

    @property
    def row(self) -> Tensor:
        if self._row is None:
            assert self._fetch_row is not None
            self._row = self._fetch_row()
        return self._row

    @classmethod
    def from_top(cls, values: list[float], tokens: list[int], fetch_row: Callable[[], Tensor]) -> "ResidualRow":
        """A row known by its largest entries (descending), for deterministic draws (`take_top`):
        the full row is fetched only if the draws go past them."""
        res = cls(None, fetch_row)
        res._sorted = list(zip(values, tokens))
        return res

    @classmethod
    def for_rows(cls, rows: Tensor, block_sums: bool = False) -> list["ResidualRow"]:
        """ResidualRows for every row of rows [R, V], with the block sums computed by one batched op
        for all rows instead of one op per row when asked. Otherwise each row does its own pass
        lazily on first use (rows never drawn from cost nothing); rows known by their top entries
        are built with `from_top`."""
        out = [cls(row) for row in rows.unbind(0)]
        if block_sums:
            blocks = _blocked(rows)
            acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
            sums = (blocks.sum(dim=2, dtype=acc) if blocks is not None else rows).tolist()
            for res, row_sums in zip(out, sums):
                res._set_block_sums(row_sums)
        return out

    def _set_block_sums(self, sums: list[float]) -> None:
        row = self.row
        self._width = BLOCK if len(sums) < row.shape[0] else 1
        self._block_sums = sums
        self.total = math.fsum(sums) if len(sums) > 1 else (sums[0] if sums else 0.0)
        group = self._group = max(1, math.isqrt(len(sums)))
        self._group_sums = [sum(sums[i:i + group]) for i in range(0, len(sums), group)]
        self._cum = None
        if row.device.type == "cpu" and row.is_contiguous():
            self._flat = row.numpy()
        for tok, prob in self.removed.items():
            self._subtract(tok, prob)

    def _ensure_block_sums(self) -> list[float]:
        if self._block_sums is None:
            row = self.row
            vocab = row.shape[0]
            if vocab < _MIN_BLOCKED or vocab % BLOCK or not row.is_contiguous():
                self._set_block_sums(row.tolist())
            else:
                # float64 rows keep their precision; half-precision rows are summed in float32.
                acc = torch.float64 if row.dtype == torch.float64 else torch.float32
                self._set_block_sums(row.view(vocab // BLOCK, BLOCK).sum(dim=1, dtype=acc).tolist())
        return self._block_sums  # type: ignore[return-value]

    def _subtract(self, token: int, prob: float) -> None:
        sums, width = self._block_sums, self._width
        assert sums is not None
        block = token // width
        if width == 1:
            sums[block] = 0.0  # zeroed exactly so no float residue stays drawable
        else:
            gone = self._removed_in.setdefault(block, [])
            gone.append(token)
            sums[block] = 0.0 if len(gone) >= width else max(sums[block] - prob, 0.0)
        self._readd_group(block // self._group)

    def _readd_group(self, group: int) -> None:
        """Recompute a group's sum from its blocks (re-added, not decremented: no float drift)."""
        start = group * self._group
        self._group_sums[group] = sum(self._block_sums[start:start + self._group])  # type: ignore[index]
        self._cum = None

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
            if self._block_sums is not None:
                self._subtract(token, prob)

    def _grow_sorted(self) -> bool:
        """Extend the sorted prefix (8 entries, then x4). Returns False when the whole vocabulary is
        already sorted.

        Exact two-level selection over strided groups: the row viewed as [GROUP, V // GROUP], each
        column is a group of GROUP tokens. The k columns with the largest maxima contain a top-k
        set (any other column's entries are dominated by k distinct column maxima), so after one
        vectorised column-maximum pass (kept for later growth) only GROUP * k entries are
        examined. Columns rather than contiguous blocks because the column-wise maximum is a plain
        elementwise max over rows, the cheapest full pass torch offers on one core."""
        row = self.row
        vocab = row.shape[0]
        have = len(self._sorted)
        if have >= vocab:
            return False
        k = min(vocab, max(8, 4 * have))
        width = vocab // GROUP
        if vocab < _MIN_BLOCKED or vocab % GROUP or not row.is_contiguous() or k >= width // 2:
            values, tokens = torch.topk(row, k)
            self._sorted = list(zip(values.tolist(), tokens.tolist()))
        else:
            grid = row.view(GROUP, width)
            if self._block_max is None:
                self._block_max = grid.amax(dim=0)
            cols = self._block_max.topk(k).indices
            values, pos = grid.index_select(1, cols).view(-1).topk(k)
            col_list = cols.tolist()
            self._sorted = [(v, (p // k) * width + col_list[p % k]) for v, p in zip(values.tolist(), pos.tolist())]
        # Rescan from the top: with ties a regrown prefix may order equal values differently, and
        # removed tokens are skipped anyway, so no token is lost or repeated.
        self._next_rank = 0
        return True

    def peek_top(self) -> tuple[int, float] | None:
        """Most likely token not drawn yet, as (token, q[token]), or None if the support is used up."""
        while True:
            if self._next_rank >= len(self._sorted) and not self._grow_sorted():
                return None
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

    def _walk_block(self, block: int, offset: float) -> tuple[int, float] | None:
        """(token, probability) at `offset` in [0, running sum of `block`) of a blocked row, the offset rescaled
        to the float64 sum of the block's remaining entries (which may round differently from the running
        sum); None when the block holds no mass (float residue of a block whose tokens were all drawn).

        The running sum is one numpy call: np.add.accumulate adds in order, as itertools.accumulate over
        the same floats does (the same draws), without making a Python float per token (~40% of a draw).
        Ufunc and array methods: numpy's function wrappers (np.cumsum, np.searchsorted) cost as much again
        as the work on 128 entries."""
        width, flat = self._width, self._flat
        start = block * width
        if flat is not None:
            inside = flat[start : start + width]
        else:
            inside = self.row[start : start + width].double().cpu().numpy()
        gone = self._removed_in.get(block)
        if gone:
            inside = inside.astype(np.float64)
            inside[np.array(gone) - start] = 0.0
        inner = np.add.accumulate(inside, dtype=np.float64)
        block_sum = float(inner[-1])
        if block_sum <= 0.0:
            return None
        at = offset * block_sum / max(self._block_sums[block], 1e-300)  # type: ignore[index]
        pos = min(int(inner.searchsorted(at, side="right")), width - 1)
        while inside[pos] <= 0.0 and pos > 0:
            pos -= 1
        return start + pos, float(inside[pos])

    def sample(self, uniform: float) -> tuple[int, float] | None:
        """Draw from norm(residual) by inversion with `uniform` in [0, 1); None if nothing is left."""
        sums = self._ensure_block_sums()
        width, group_size, groups = self._width, self._group, self._group_sums
        while True:
            cum = self._cum
            if cum is None:
                cum = self._cum = list(itertools.accumulate(groups))
            if not cum or cum[-1] <= 0.0:
                return None
            target = uniform * cum[-1]
            group = min(bisect.bisect_right(cum, target), len(cum) - 1)
            while groups[group] <= 0.0 and group > 0:  # float edge: landed on an empty group
                group -= 1
            # The group's blocks, then the block's tokens: offsets rescaled to the sums actually
            # walked (a group sum is the sum of its blocks, a block's sum a running subtraction).
            first = group * group_size
            in_group = list(itertools.accumulate(sums[first:first + group_size]))
            offset = (target - (cum[group - 1] if group else 0.0)) * in_group[-1] / max(groups[group], 1e-300)
            pos = min(bisect.bisect_right(in_group, offset), len(in_group) - 1)
            while sums[first + pos] <= 0.0 and pos > 0:
                pos -= 1
            block = first + pos
            if sums[block] <= 0.0:  # float residue of a group whose mass is all drawn
                groups[group] = 0.0
                self._cum = None
                continue
            if width == 1:
                token, prob = block, sums[block]
                break
            offset -= in_group[pos - 1] if pos else 0.0
            picked = self._walk_block(block, offset)
            if picked is None:
                # Float residue of a block whose mass is all drawn: drop it and draw again.
                sums[block] = 0.0
                self._readd_group(group)
                continue
            token, prob = picked
            break
        if prob <= 0.0 or token in self.removed:
            return None
        return self._take(token, prob)
