"""engine/greedy_rule.py: the one near-tie rule of the in-process bench, the service bench and the load test."""

from __future__ import annotations

from treeserve.engine.greedy_rule import TIE_GAP, GreedyCheck, greedy_verdict


def test_a_divergence_is_allowed_only_at_a_near_tie():
    reference = [1, 2, 3, 4]
    asked = []

    def gap_at(i: int) -> float:
        asked.append(i)
        return TIE_GAP / 2 if i == 2 else 1.0

    assert greedy_verdict(reference, [1, 2, 3, 4], gap_at) == "equal" and asked == []
    assert greedy_verdict(reference, [1, 2, 9, 9], gap_at) == "near_tie" and asked == [2]  # asked only there
    assert greedy_verdict(reference, [1, 9], gap_at) == "mismatch"
    assert greedy_verdict(reference, [1, 2, 3], gap_at) == "mismatch"  # stopped where greedy went on
    assert greedy_verdict(reference, [1, 2, 3, 4, 5], gap_at) == "mismatch"
    assert greedy_verdict(reference, [1, 2, 9], lambda i: TIE_GAP) == "mismatch"  # the gap must lie below it
    assert greedy_verdict(reference, [1, 2, 9], lambda i: 0.5, tie_gap=1.0) == "near_tie"  # a looser threshold


def test_greedy_check_counts_verdicts():
    check = GreedyCheck()
    gaps = [1.0, TIE_GAP / 10, 1.0]
    check.compare([1, 2, 3], gaps, [1, 2, 3])
    check.compare([1, 2, 3], gaps, [1, 7, 3])
    check.compare([1, 2, 3], gaps, [1, 2, 7])
    assert (check.compared, check.tie_divergences, check.mismatches) == (3, 1, 1)
