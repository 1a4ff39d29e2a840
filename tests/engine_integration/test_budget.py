"""The hardware-aware budget chooser: cost curve interpolation, exploration, and choosing by measured rate."""

from treeserve.engine.budget import BudgetChooser, HardwareProfile
from treeserve.engine.builders import ChainBuilder, DySpecBuilder
from treeserve.engine.requests import StepRecord

PROFILE = HardwareProfile({1: 40.0, 2: 43.0, 4: 60.0, 8: 72.0, 16: 80.0, 32: 92.0, 64: 140.0}, 3.0, 128)


def record(emitted: int, ms: float) -> StepRecord:
    return StepRecord(tree_size=0, accepted=emitted - 1, emitted=emitted, batch_size=1, draft_ms=0.0,
                      draft_model_ms=0.0, score_ms=ms, verify_ms=0.0)


def test_profile_interpolates_and_extrapolates():
    assert PROFILE.target_time_ms(3) == 51.5
    assert PROFILE.target_time_ms(1) == 40.0
    assert PROFILE.target_time_ms(96) > PROFILE.target_time_ms(64)
    assert 0 < PROFILE.opt_tree_delta() < 1


def test_explores_plain_decoding_then_keeps_the_fastest_measured_budget():
    chooser = BudgetChooser(PROFILE, max_budget=32, revisit=0.0)
    seen = set()
    # Budget 2 pays (3 tokens in 50 ms); everything else is slower than plain decoding (1 token in 40 ms).
    for _ in range(40):
        built = chooser.builder_for(DySpecBuilder(budget=64))
        seen.add(chooser.current)
        assert (built is None) == (chooser.current == 0)
        chooser.observe(record(3, 50.0) if chooser.current == 2 else record(1, 40.0 + chooser.current))
    assert 0 in seen and 2 in seen
    assert chooser.choose() == 2


def test_falls_back_to_plain_decoding_when_drafting_never_pays():
    chooser = BudgetChooser(PROFILE, max_budget=8, revisit=0.0)
    for _ in range(30):
        builder = chooser.builder_for(ChainBuilder(length=4))
        chooser.observe(record(1, 40.0) if builder is None else record(1, 60.0))
    assert chooser.choose() == 0
