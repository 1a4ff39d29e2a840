"""CommittedFeatures: the target features of a sequence's context[:-1] that an EAGLE drafter reads."""
import torch

from treeserve.engine.drafters.base import root_only
from treeserve.engine.speculative_engine import CommittedFeatures
from treeserve.engine.tree import TokenTree
from treeserve.engine.verify import TargetDists


def fed(values, start):
    """Target features [rows, 2] whose first column names the row (to check which rows were kept)."""
    values = torch.tensor(values, dtype=torch.float32)
    return TargetDists(features=torch.stack([values, -values], dim=1), features_start=start)


def test_prefill_then_steps_keep_the_fed_context_and_the_accepted_path():
    features = CommittedFeatures()
    features.commit(root_only([7, 8, 9, 10, 11]), fed([0, 1, 2, 3, 4], 0), [])  # prompt of 5: rows 0..4
    assert features.rows[:, 0].tolist() == [0, 1, 2, 3, 4]

    # root at position 5, nodes 1 -> 2 and a sibling 3 of 1; nodes 1 and 2 accepted
    tree = TokenTree.build([12, 13, 14, 15], [-1, 0, 1, 0])
    features.commit(tree, fed([5, 101, 102, 103], 5), [1, 2])
    assert features.rows[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 101, 102]
    assert torch.equal(features.rows[:, 1], -features.rows[:, 0])

    # the target re-fed two context rows (an extension from position 6) before the root; node 1 accepted
    tree = TokenTree.build([16, 17, 18], [-1, 0, 1])
    features.commit(tree, fed([201, 202, 203, 301, 302], 6), [1])
    assert features.rows[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 201, 202, 203, 301]


def test_many_steps_grow_the_buffer_and_keep_every_row():
    features = CommittedFeatures()
    features.commit(root_only([1, 2]), fed([0, 1], 0), [])
    chain = TokenTree.build([5, 6, 7], [-1, 0, 1])
    expected = [0, 1]
    for step in range(40):  # the root and both nodes accepted: 3 rows a step
        rows = [len(expected), 1000 + step, 2000 + step]
        features.commit(chain, fed(rows, len(expected)), [1, 2])
        expected += rows
        assert features.rows[:, 0].tolist() == expected
