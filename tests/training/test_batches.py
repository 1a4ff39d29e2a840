"""The drafter trainers' shared batching and learning-rate schedule."""
import pytest
import torch

from treeserve.tools.training.batches import SequenceBatches, cosine_lr


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


def test_the_first_epoch_is_shuffled_too():
    """Callers may pass ids in corpus order (growing_corpus_holdout returns them sorted): the first epoch must
    not walk the corpus chunk by chunk."""
    spans = [(i, i + 1) for i in range(64)]
    batches = SequenceBatches(list(range(64)), spans, batch_tokens=64, max_len=8,
                              generator=torch.Generator().manual_seed(0))
    first, _ = batches.next()
    assert sorted(first) == list(range(64)) and first != list(range(64))


def test_a_growing_corpus_never_holds_out_what_it_trained_on():
    """As the corpus grows, the held-out set only drops members and gains new sequences: a drafter continued
    on the larger corpus is never measured on a sequence the earlier run trained on."""
    from treeserve.tools.training.loop import growing_corpus_holdout

    small_held, small_train = growing_corpus_holdout(500, 40, seed=0)
    big_held, big_train = growing_corpus_holdout(800, 40, seed=0)
    assert len(small_held) == len(big_held) == 40 and len(small_train) == 460 and len(big_train) == 760
    assert not set(big_held) & set(small_train)
    assert set(small_held) | set(small_train) == set(range(500))
    assert growing_corpus_holdout(800, 40, seed=1)[0] != big_held  # the seed picks another set
