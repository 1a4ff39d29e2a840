"""The drafter trainers' shared batching and learning-rate schedule."""
import pytest
import torch

from treeserve.engine.training.batches import SequenceBatches, cosine_lr


def test_batches_pack_to_the_token_budget_and_cover_every_sequence_each_epoch():
    spans = [(0, 5), (5, 15), (15, 18), (18, 40)]  # lengths 5, 10, 3, 22 (cut to 8)
    batches = SequenceBatches([0, 1, 2, 3], spans, batch_tokens=12, max_len=8, generator=torch.Generator().manual_seed(0))
    drawn = []
    while len(drawn) < 12:  # three epochs
        batch, n = batches.next()
        assert n >= 12 and n - min(spans[batch[-1]][1] - spans[batch[-1]][0], 8) < 12  # stops once over budget
        assert n == sum(min(spans[s][1] - spans[s][0], 8) for s in batch)
        drawn += batch
    for epoch in range(3):
        assert sorted(drawn[4 * epoch:4 * epoch + 4]) == [0, 1, 2, 3]


def test_cosine_lr_decays_from_peak_to_a_tenth():
    assert cosine_lr(1e-3, 0, 60) == pytest.approx(1e-3)
    assert cosine_lr(1e-3, 30, 60) == pytest.approx(0.55e-3)
    assert cosine_lr(1e-3, 60, 60) == pytest.approx(1e-4)
    assert cosine_lr(1e-3, 90, 60) == pytest.approx(1e-4)  # past the budget: stays at the floor
