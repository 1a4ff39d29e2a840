"""CachedLM's split of a step's rows by width (engine/runners/row_groups.py).

- the pure split: equal widths stay one forward; a long prefill beside short rows runs apart; a bounded pool's
  capacity still holds in every group; the split is the cheapest contiguous one; on the static step only the
  rows past the largest token bucket run apart;
- through CachedLM (eager and static step): a split batch gives every row the logits it gets run alone.
"""

import itertools
import random

import pytest
import torch

from tiny_models import tiny_llama  # tests/tiny_models.py
from treeserve.engine.runners.cached_lm import CachedLM, ExtendRequest
from treeserve.engine.runners.row_groups import DEFAULT_FORWARD_OVERHEAD, RowShape, forward_cost, row_groups
from treeserve.engine.runners.step_settings import StaticStepSettings

VOCAB = 300
SETTINGS = StaticStepSettings(batch_buckets=(1, 2, 4), token_buckets=(1, 4, 8, 16), context_tokens=96,
                              min_context_bucket=16)


def shapes(*fed: int, slots: int = 0) -> list[RowShape]:
    return [RowShape(f, slots) for f in fed]


def step_cost(rows: list[RowShape], groups: list[list[int]], overhead: float) -> float:
    return sum(forward_cost(len(g), max(rows[i].fed for i in g), overhead) for g in groups)


# ---------------------------------------------------------------------- the pure split
def test_equal_widths_stay_one_forward():
    assert row_groups(shapes(3, 3, 3, 3)) == [[0, 1, 2, 3]]
    assert row_groups(shapes(1, 2, 3, 1)) == [[0, 3, 1, 2]]  # padding 4 positions < one forward's overhead


def test_a_long_prefill_beside_short_rows_runs_apart():
    """7 decoding rows of 1-3 tokens and a 60-token prompt: 8 x 60 = 480 positions in one forward."""
    rows = shapes(1, 2, 3, 1, 2, 3, 1, 60)
    groups = row_groups(rows)
    assert groups == [[0, 3, 6, 1, 4, 2, 5], [7]]
    assert step_cost(rows, groups, DEFAULT_FORWARD_OVERHEAD) < step_cost(rows, [list(range(8))],
                                                                          DEFAULT_FORWARD_OVERHEAD)
    assert row_groups(rows, forward_overhead=1e9) == [[0, 3, 6, 1, 4, 2, 5, 7]]  # never worth another forward


def test_the_split_is_the_cheapest_contiguous_one():
    rng = random.Random(0)
    for _ in range(200):
        widths = [rng.choice([1, 1, 2, 3, 5, 20, 40, 60]) for _ in range(rng.randrange(1, 8))]
        rows = [RowShape(w, rng.randrange(60)) for w in widths]
        overhead = rng.choice([0, 5, 48, 200])
        capacity = rng.choice([None, 80, 120])
        if capacity is not None and any(r.fed + r.slots > capacity for r in rows):
            continue
        groups = row_groups(rows, overhead, capacity)
        assert sorted(i for g in groups for i in g) == list(range(len(rows)))
        order = sorted(range(len(rows)), key=lambda i: (rows[i].fed, rows[i].slots))
        costs = []
        for cuts in itertools.product((False, True), repeat=len(rows) - 1):
            bounds = [0] + [k + 1 for k, cut in enumerate(cuts) if cut] + [len(rows)]
            split = [order[a:b] for a, b in zip(bounds, bounds[1:])]
            if capacity is None or all(max(rows[i].slots for i in g) + max(rows[i].fed for i in g) <= capacity
                                       for g in split):
                costs.append(step_cost(rows, split, overhead))
        assert step_cost(rows, groups, overhead) == min(costs)


def test_every_group_fits_the_pool():
    """A deep session beside a long prefill: together they would span 60 + 30 slots of a 64-slot row."""
    rows = [RowShape(1, 60), RowShape(30, 0), RowShape(1, 10)]
    groups = row_groups(rows, forward_overhead=1e9, capacity=64)
    assert len(groups) == 2
    for g in groups:
        assert max(rows[i].slots for i in g) + max(rows[i].fed for i in g) <= 64
    with pytest.raises(ValueError):
        row_groups([RowShape(10, 60)], capacity=64)


def test_static_step_runs_only_rows_past_the_largest_bucket_apart():
    assert row_groups(shapes(1, 16, 3), largest_bucket=16) == [[0, 2, 1]]  # padding alone never splits it
    assert row_groups(shapes(1, 40, 3, 2), largest_bucket=16) == [[0, 3, 2], [1]]
    assert row_groups(shapes(40, 30), largest_bucket=16) == [[1, 0]]  # prefills together, at their own shape


# ---------------------------------------------------------------------- through CachedLM
def random_tree(rng: random.Random, root: int, size: int) -> tuple[list[int], list[int]]:
    return [root] + [rng.randrange(VOCAB) for _ in range(size - 1)], [-1] + [rng.randrange(i) for i in range(1, size)]


def decode_beside_prefill(seed: int, prompt: int) -> list[list[tuple[str, list[int], list[int], list[int]]]]:
    """Two steps: three sessions prefill short contexts; then they score small trees while a `prompt`-token
    session arrives (its prefill and root in the same forward)."""
    rng = random.Random(seed)
    contexts = {f"s{i}": [rng.randrange(VOCAB) for _ in range(n)] for i, n in enumerate((5, 9, 7))}
    first = [(sid, c, [c[-1]], [-1]) for sid, c in contexts.items()]
    second = []
    for (sid, c), size in zip(contexts.items(), (1, 2, 3)):
        c = c + [rng.randrange(VOCAB)]
        second.append((sid, c, *random_tree(rng, c[-1], size)))
    long = [rng.randrange(VOCAB) for _ in range(prompt)]
    second.append(("long", long, [long[-1]], [-1]))
    return [first, second]


def run_batched(lm: CachedLM, steps) -> tuple[list[torch.Tensor], int]:
    """The last step's logits per request, and how many forwards that step took."""
    for step in steps:
        for sid, context, _, _ in step:
            lm.begin(sid, context)
        before = lm.forward_count
        out = lm.extend([ExtendRequest(sid, tokens, parents) for sid, _, tokens, parents in step])
    return out, lm.forward_count - before


def run_alone(lm: CachedLM, steps) -> list[torch.Tensor]:
    """The same steps with every request in a forward of its own."""
    for step in steps:
        out = []
        for sid, context, tokens, parents in step:
            lm.begin(sid, context)
            out += lm.extend([ExtendRequest(sid, tokens, parents)])
    return out


@pytest.mark.parametrize("static", [None, SETTINGS], ids=["eager", "static"])
def test_a_split_batch_gives_each_row_its_logits_alone(static):
    model = tiny_llama(VOCAB)
    steps = decode_beside_prefill(0, prompt=60)
    batched, forwards = run_batched(CachedLM(model, static=static), steps)
    assert forwards == 2  # the decoding rows in one forward (a bucket on the static step), the prompt in another
    for got, ref in zip(batched, run_alone(CachedLM(model, static=static), steps)):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_a_bounded_eager_pool_splits_and_keeps_the_logits():
    model = tiny_llama(VOCAB)
    steps = decode_beside_prefill(1, prompt=60)
    batched, forwards = run_batched(CachedLM(model, max_sessions=4, max_context_tokens=64), steps)
    assert forwards == 2
    for got, ref in zip(batched, run_alone(CachedLM(model), steps)):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
