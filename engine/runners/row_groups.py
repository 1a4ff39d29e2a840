"""Which of one step's rows share a forward (docs/design.md section 6): CachedLM's split of a batch by width.

A batched forward computes every row at the widest row's width: its inputs are padded to [rows, width]. So one
arriving prompt pads every decoding row to its length (7 decoding rows of 1-3 tokens and a 60-token prompt
computed 8 x 60 = 480 positions for 67 real ones), and prompts prefilled together pad to the longest (16 dev
prompts: 4,576 positions for 1,408). Splitting the rows into several forwards removes padding but pays each
extra forward's fixed cost (weights read once per forward, per-layer host work, the LM head's launch, ...).

Cost model, in positions (one row x one token computed):

    cost(forward) = forward_overhead + rows x widest row's fed tokens
    cost(step)    = sum over its forwards

`forward_overhead` is the fixed cost of one forward expressed in positions: the intercept over the slope of a
straight line through a forward's time against the positions it computes, as `treeserve profile --batch 8`
measures it (T(n nodes) for 8 rows of n nodes each = 8n positions). On the 2-core CPU VM with SmolLM2-135M in
float32 that line gives 30-60 positions depending on which points are fitted (all of n = 1..64: 39); 48 was
measured there earlier and is the default. A larger value splits less (a very large one never splits for
padding: only the pool's capacity splits).

The cheapest split puts rows of similar width together: rows are sorted by width and cut into contiguous
groups by dynamic programming over the sorted order (O(distinct widths^2); none at all when the whole batch's
padding costs no more than one forward, as in a decoding step of equal-sized trees). Two constraints:

- a bounded pool (`capacity` = max_context_tokens): a forward's rows are laid out at max(slots) + max(fed)
  slots, which must fit a pool row (engine/runners/cached_lm.py); each row alone always fits (checked before);
- the static step (`largest_bucket` = its largest token bucket): it stays one forward, padded to a bucket and
  replayed as a CUDA graph, except that rows wider than the largest token bucket (prefills) run as one forward
  of their own at their exact shape: otherwise one long prompt would push every decoding row off its bucket and
  graph into an eager forward of the prompt's width. The positions cost model does not apply there (a GPU
  forward's fixed cost is launch and host time, far more than 48 positions), so nothing else is split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# Fixed cost of one more forward, in positions (see the module docstring: `treeserve profile --batch 8`).
DEFAULT_FORWARD_OVERHEAD = 48.0


@dataclass(frozen=True)
class RowShape:
    """What one row of a step occupies: the tokens it feeds and the KV slots it already holds."""

    fed: int  # extension + new tree nodes fed by this step
    slots: int = 0  # valid KV slots before the step


def forward_cost(rows: int, width: int, forward_overhead: float) -> float:
    """Positions one forward of `rows` rows padded to `width` tokens costs, its fixed overhead included."""
    return forward_overhead + rows * width


def row_groups(rows: Sequence[RowShape], forward_overhead: float = DEFAULT_FORWARD_OVERHEAD,
               capacity: int | None = None, largest_bucket: int | None = None) -> list[list[int]]:
    """Row indices per forward, each group in increasing width, groups in increasing width.

    Eager (`largest_bucket` None): the split of the rows sorted by width into contiguous groups of least total
    `forward_cost`, every group fitting `capacity` slots (max(slots) + max(fed) <= capacity) when given.
    Static step (`largest_bucket` set): one forward, and one more for the rows wider than `largest_bucket`."""
    if forward_overhead < 0:
        raise ValueError(f"forward_overhead must be >= 0, got {forward_overhead}")
    order = sorted(range(len(rows)), key=lambda i: (rows[i].fed, rows[i].slots))
    if largest_bucket is not None:
        bucketed = [i for i in order if rows[i].fed <= largest_bucket]
        wider = [i for i in order if rows[i].fed > largest_bucket]
        return [g for g in (bucketed, wider) if g] or [order]
    if capacity is not None:
        for i, row in enumerate(rows):
            if row.slots + row.fed > capacity:
                raise ValueError(f"row {i} alone needs {row.slots + row.fed} slots, over capacity {capacity}")
    if len(rows) <= 1 or _one_forward_is_cheapest(rows, forward_overhead, capacity):
        return [order]
    return _cheapest_split(order, rows, forward_overhead, capacity)


def _one_forward_is_cheapest(rows: Sequence[RowShape], forward_overhead: float, capacity: int | None) -> bool:
    """One forward fits, and its padding costs no more than one more forward: any split pays at least one more
    overhead and saves at most that padding."""
    widest = max(r.fed for r in rows)
    if capacity is not None and max(r.slots for r in rows) + widest > capacity:
        return False
    return len(rows) * widest - sum(r.fed for r in rows) <= forward_overhead


def _cheapest_split(order: list[int], rows: Sequence[RowShape], forward_overhead: float,
                    capacity: int | None) -> list[list[int]]:
    """Dynamic programming over `order` (rows by increasing width), cutting only where the width changes: rows
    of one width belong in one group (moving those of a group's head into the previous group, which ends at
    that width, never costs more, and still fits the pool, since each row alone fits). best[r] is the least
    cost of the rows before run r; the last group (runs start..end) is padded to run end - 1's width."""
    runs: list[tuple[int, int, int]] = []  # (first index in order, width, most slots) per run of one width
    for k, i in enumerate(order):
        if runs and runs[-1][1] == rows[i].fed:
            first, width, most = runs[-1]
            runs[-1] = (first, width, max(most, rows[i].slots))
        else:
            runs.append((k, rows[i].fed, rows[i].slots))
    bounds = [first for first, _, _ in runs] + [len(order)]
    best = [0.0] + [float("inf")] * len(runs)
    cut = [0] * (len(runs) + 1)  # the first run of the last group of the first `end` runs
    for end in range(1, len(runs) + 1):
        width = runs[end - 1][1]
        most_slots = 0
        for start in range(end - 1, -1, -1):  # the last group grows leftwards
            most_slots = max(most_slots, runs[start][2])
            if capacity is not None and most_slots + width > capacity:
                break  # a longer group only holds more slots
            cost = best[start] + forward_cost(bounds[end] - bounds[start], width, forward_overhead)
            if cost <= best[end]:  # ties: the larger group, fewer forwards
                best[end], cut[end] = cost, start
    groups: list[list[int]] = []
    end = len(runs)
    while end > 0:
        groups.append(order[bounds[cut[end]]:bounds[end]])
        end = cut[end]
    return groups[::-1]
