"""The hardware-aware budget chooser: cost curve interpolation, exploration, and choosing by measured rate."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from treeserve.engine.budget import (EARLY_STOP_STEPS, LOOKUP_ONLY, MAX_HOLD_DOUBLINGS, BudgetChooser, DraftPlan,
                                     allocate_copies)
from treeserve.engine.drafters.planner import BATCH_PLAIN_MARGIN
from treeserve.engine.hardware.profile import HardwareProfile
from treeserve.engine.builders import ChainBuilder, DySpecBuilder
from treeserve.engine.hardware.profile import BATCH_PROFILE_NODES, BATCH_PROFILE_ROWS, measure_profile
from treeserve.engine.requests import StepRecord

from chooser_lane import builder_for, decision  # tests/chooser_lane.py

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
        built = builder_for(chooser, DySpecBuilder(budget=64))
        current = decision(chooser).current
        seen.add(current)
        assert (built is None) == (current == 0)
        chooser.observe(record(3, 50.0) if current == 2 else record(1, 40.0 + current))
    assert 0 in seen and 2 in seen
    assert chooser.choose() == 2


def test_falls_back_to_plain_decoding_when_drafting_never_pays():
    chooser = BudgetChooser(PROFILE, max_budget=8, revisit=0.0)
    for _ in range(60):
        builder = builder_for(chooser, ChainBuilder(length=4))
        chooser.observe(record(1, 40.0) if builder is None else record(1, 60.0))
    assert chooser.choose() == 0


def test_plain_decoding_is_held_and_its_records_credited():
    """Choosing budget 0 holds plain decoding for `plain_hold_steps` more steps (no decision, no drafter
    call); every held step's record goes to budget 0, a record of a step it did not decide to nothing."""
    chooser = BudgetChooser(PROFILE, max_budget=8, revisit=0.0, plain_hold_steps=3)
    chooser.arms = {0: _arm(10, 400.0, steps=10), 2: _arm(10, 600.0, steps=5)}  # plain decoding wins
    chooser._to_explore = []
    assert builder_for(chooser, ChainBuilder(length=4)) is None and decision(chooser).held == 3
    for _ in range(4):  # the decided step and the 3 held ones
        chooser.observe(record(1, 40.0))
    chooser.observe(record(1, 1000.0))  # not decided by the chooser: ignored
    assert chooser.arms[0].steps == 14 and list(chooser.arms[0].step_seconds)[-4:] == [0.04] * 4
    chooser.arms[2] = _arm(30, 600.0, steps=15)  # drafting now measured faster: no hold once it is chosen
    assert builder_for(chooser, ChainBuilder(length=4)) is not None
    assert decision(chooser).current == 2 and decision(chooser).held == 0


def test_revisits_an_unlucky_rival_not_only_neighbours():
    """Budget 0 measured slow on a few unlucky steps is still re-measured while budget 4 leads (it is
    not a neighbour of 4), and wins once its true rate shows."""
    chooser = BudgetChooser(PROFILE, max_budget=8, revisit=0.2, seed=1)
    chooser._to_explore = []
    chooser.arms = {0: _arm(3, 300.0, steps=3), 4: _arm(15, 600.0, steps=6)}  # 10 vs 25 tok/s measured
    for _ in range(600):
        budget = chooser.next_budget()
        chooser.observe(record(2, 100.0) if budget else record(1, 33.0))  # truly: drafting 20 tok/s, plain 30
    assert max(chooser.summary().items(), key=lambda kv: kv[1])[0] == 0
    assert chooser.arms[0].steps > 20


def _arm(tokens: int, ms: float, steps: int):
    from treeserve.engine.budget import _Arm

    arm = _Arm(tokens=tokens, steps=float(steps))
    arm.step_seconds.extend([ms / 1e3 / steps] * steps)
    return arm


def test_a_well_measured_clearly_slower_budget_is_not_revisited():
    """Budget 8 with many steps at half the best rate stops being re-measured; an arm within the margin
    (budget 2, not a neighbour of 0) still is."""
    chooser = BudgetChooser(PROFILE, max_budget=8, revisit=1.0, seed=0)
    chooser._to_explore = []
    chooser.arms = {0: _arm(30, 1000.0, steps=30), 8: _arm(60, 4000.0, steps=20), 2: _arm(28, 1000.0, steps=20),
                    6: _arm(3, 400.0, steps=3)}
    picked = set()
    for _ in range(200):
        budget = chooser.next_budget()
        picked.add(budget)
        rate = chooser.arms[budget].rate if budget in chooser.arms else 20.0
        chooser.observe(record(1, 1e3 / rate))  # each arm keeps its measured rate
    assert 8 not in picked  # 15 tok/s vs 30, 20 steps: clearly worse and well measured
    assert {1, 2, 6} <= picked  # the neighbour, a close rival, an under-measured one


def test_a_stretch_of_rejected_drafts_falls_back_to_plain_decoding_and_drafting_resumes():
    """Budget 2 is faster on average (1.5 tokens per 50 ms vs 1 per 40 ms), but a stretch where its drafts are
    all rejected makes the recent acceptance factor drop until plain decoding wins; plain steps let the
    evidence decay back toward average, and drafting is tried again."""
    chooser = BudgetChooser(PROFILE, max_budget=8, revisit=0.0, plain_hold_steps=0)
    chooser._to_explore = []
    chooser.arms = {0: _arm(20, 800.0, steps=20), 2: _arm(30, 1000.0, steps=20)}
    chooser.arms[2].accepted = 10
    assert chooser.next_budget() == 2 and chooser.acceptance_factor == 1.0
    chooser.observe(record(1, 50.0))
    rejected = 1
    while chooser.next_budget() == 2:
        chooser.observe(record(1, 50.0))
        rejected += 1
        assert rejected <= 12
    low = chooser.acceptance_factor
    assert low < 0.6
    plain = 0
    while chooser.next_budget() == 0:
        chooser.observe(record(1, 40.0))
        plain += 1
        assert plain <= 12
    assert low < chooser.acceptance_factor < 1.0 and plain >= 1


def test_a_stalled_step_does_not_rule_a_budget_out():
    """The step cost is the median of recent step times: one 10x stall among three steps leaves it at 50 ms."""
    chooser = BudgetChooser(PROFILE, max_budget=8, revisit=0.0, explore_steps=3)
    chooser._to_explore = [2]
    for ms in (50.0, 500.0, 50.0):
        assert chooser.next_budget() == 2
        chooser.observe(record(2, ms))
    assert abs(chooser.arms[2].rate - 2 / 0.05) < 1e-9


def batch_record(emitted: int, ms: float, rows: int) -> StepRecord:
    return StepRecord(tree_size=0, accepted=emitted - 1, emitted=emitted, batch_size=rows, draft_ms=0.0,
                      draft_model_ms=0.0, score_ms=ms, verify_ms=0.0)


def batched_profile(per_token_ms: float, fixed_ms: float, drafter_ms: float) -> HardwareProfile:
    """Target forward = fixed + per_token x rows x nodes at every measured batch (a CPU: per_token large;
    a GPU: per_token ~0, the forward as dear for 8 x 7 tokens as for one)."""
    curve = lambda rows: {n: fixed_ms + per_token_ms * rows * n for n in (1, 2, 4, 7)}  # noqa: E731
    return HardwareProfile(curve(1), drafter_ms, 128, {rows: curve(rows) for rows in (2, 4, 8, 16)},
                           {rows: drafter_ms for rows in (2, 4, 8, 16)})


def run_batched(chooser: BudgetChooser, steps: int, rows: int, profile: HardwareProfile, accept: float) -> list[int]:
    """Drive a batched chooser on a simulated batch whose true costs are `profile`'s and whose chains accept
    `accept` tokens per drafted token; returns the depths chosen."""
    chosen = []
    for _ in range(steps):
        depth = chooser.next_budget()
        chosen.append(depth)
        ms = profile.target_time_ms(depth + 1, rows) + profile.drafter_time_ms(rows) * (depth + (depth > 0))
        emitted = 1 + round(accept * depth)
        for _ in range(rows):
            chooser.observe(batch_record(emitted, ms, rows))
    return chosen


def test_a_curve_where_trees_cannot_pay_gives_plain_batched_steps_and_drafting_returns_with_the_curve():
    """Priced by its batch (8 rows): on a CPU-like curve, where 8 x (depth + 1) tokens cost that many times one
    token's share, no depth pays and the chooser explores nothing else for long; handed a GPU-like (flat)
    curve the same acceptance pays, and it drafts."""
    cpu = batched_profile(per_token_ms=5.0, fixed_ms=10.0, drafter_ms=8.0)
    chooser = BudgetChooser(cpu, max_budget=6, rows=8, explore_within=0.8, plain_hold_steps=0, revisit=0.0)
    assert chooser._to_explore == [0]  # no depth is predicted within 80% of plain decoding's rate
    assert run_batched(chooser, 80, 8, cpu, accept=0.6) == [0] * 80
    gpu = batched_profile(per_token_ms=0.01, fixed_ms=40.0, drafter_ms=2.0)
    flat = chooser.fresh(profile=gpu)
    assert len(flat._to_explore) > 1  # depths are explored where verifying more tokens is nearly free
    assert sum(d > 0 for d in run_batched(flat, 80, 8, gpu, accept=0.6)[-40:]) == 40


def test_batched_costs_interpolate_in_rows_and_fall_back_to_total_tokens():
    profile = batched_profile(per_token_ms=1.0, fixed_ms=10.0, drafter_ms=4.0)
    assert profile.target_time_ms(2, rows=8) == 26.0 and profile.target_time_ms(2, rows=6) == 22.0
    assert profile.target_time_ms(2, rows=32) > profile.target_time_ms(2, rows=16)  # extended past the last
    unmeasured = HardwareProfile({1: 10.0, 8: 17.0, 16: 25.0}, 3.0, 128)
    assert unmeasured.target_time_ms(2, rows=4) == unmeasured.target_time_ms(8)
    assert HardwareProfile.from_json(profile.to_json()) == profile


def test_measured_profile_has_batched_curves(tmp_path):
    """measure_profile times rows x chain-length forwards and batched drafter steps, cached with them."""


    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    profile = measure_profile(model, model, prefix_tokens=16, repeats=1, cache_dir=tmp_path)
    assert set(profile.batch_target_ms) == set(BATCH_PROFILE_ROWS)
    assert all(set(c) == set(BATCH_PROFILE_NODES) for c in profile.batch_target_ms.values())
    assert set(profile.batch_drafter_ms) == set(BATCH_PROFILE_ROWS) and profile.drafter_step_ms > 0
    assert measure_profile(model, model, prefix_tokens=16, repeats=1, cache_dir=tmp_path) == profile  # cached


def test_copies_are_allocated_across_the_batch_where_they_pay():
    """OPT-Tree's criterion over a batch's copy chains: confident copies first whichever row they are in, and
    none on a curve where each token costs as much as a plain step's share (nothing pays)."""

    chains = [[0.9, 0.8, 0.1], [], [0.6, 0.05]]
    flat = batched_profile(per_token_ms=0.05, fixed_ms=40.0, drafter_ms=2.0)
    assert allocate_copies(chains, 4, 1, 4.0, flat) == [3, 0, 2]  # a token costs ~nothing: every copy pays
    middle = batched_profile(per_token_ms=2.0, fixed_ms=40.0, drafter_ms=2.0)
    assert allocate_copies(chains, 4, 1, 4.0, middle) == [2, 0, 1]  # the 0.1 and 0.05 copies do not pay
    steep = batched_profile(per_token_ms=10.0, fixed_ms=0.0, drafter_ms=2.0)  # cost proportional to tokens
    assert allocate_copies(chains, 4, 1, 4.0, steep) == [0, 0, 0]
    assert allocate_copies([[0.99, 0.98]], 4, 1, 4.0, steep) == [0]  # a token costs a plain token's share


def test_a_step_cost_ceiling_bounds_copies_and_depths():
    """`max_step_cost`: however many tokens they would bring, no copies past the ceiling on a step's predicted time
    (a plain step's times the ceiling), nor chain depths predicted past it; a batch-1 chooser has no ceiling."""
    middle = batched_profile(per_token_ms=2.0, fixed_ms=40.0, drafter_ms=2.0)
    chains = [[0.99, 0.98, 0.97], [0.99, 0.98], [0.99]]
    free = allocate_copies(chains, 4, 1, 4.0, middle)
    capped = allocate_copies(chains, 4, 1, 4.0, middle, max_step_cost=1.1)
    plain = middle.target_time_ms(1, 4)
    assert sum(capped) < sum(free) == 6
    assert middle.target_time_ms(1 + sum(capped) / 4, 4) <= 1.1 * plain < middle.target_time_ms(1 + (sum(capped) + 1) / 4, 4)
    chooser = BudgetChooser(middle, max_budget=6, rows=4, max_step_cost=1.3)
    assert chooser.candidates and all(chooser.step_ms(b) <= 1.3 * chooser.step_ms(0) for b in chooser.candidates)
    assert max(chooser.candidates) < max(BudgetChooser(middle, max_budget=6, rows=4).candidates)
    assert BudgetChooser(middle, max_budget=6, max_step_cost=1.01).candidates == \
        BudgetChooser(middle, max_budget=6).candidates
    with pytest.raises(ValueError, match="max_step_cost"):
        BudgetChooser(middle, rows=4, max_step_cost=0.5)


def test_a_depth_measured_past_the_step_cost_ceiling_is_not_chosen_however_many_tokens_it_brings():
    """Priced within the ceiling (a flat curve) but measured at 1.5x a plain step (the drafter's work on shared
    cores): the depth brings more tokens per second, and without a ceiling it is what the chooser keeps; with
    `max_step_cost` 1.2 it keeps plain decoding once both are measured, so each stream's ITL stays near plain's."""
    flat = batched_profile(per_token_ms=0.01, fixed_ms=40.0, drafter_ms=2.0)
    truth = batched_profile(per_token_ms=2.5, fixed_ms=40.0, drafter_ms=2.0)  # depth 1 of 8 rows: 1.5x plain
    for ceiling, kept in ((0.0, 1), (1.2, 0)):
        chooser = BudgetChooser(flat, max_budget=1, rows=8, plain_hold_steps=0, revisit=0.0, max_step_cost=ceiling)
        assert 1 in chooser.candidates  # the profile predicts it within the ceiling
        chosen = run_batched(chooser, 60, 8, truth, accept=0.9)
        assert 1 in chosen and chosen[-20:] == [kept] * 20
    assert chooser.within_measured_cost(0) and not chooser.within_measured_cost(1)


def test_a_batched_chooser_measures_plain_first_and_drops_losing_depths_early():
    """Priced optimistically (a flat curve) but truly slower: plain decoding is measured first, and each depth is
    abandoned after EARLY_STOP_STEPS steps clearly below it, well before its explore_steps."""

    flat = batched_profile(per_token_ms=0.01, fixed_ms=40.0, drafter_ms=2.0)
    truth = batched_profile(per_token_ms=10.0, fixed_ms=40.0, drafter_ms=20.0)
    chooser = BudgetChooser(flat, max_budget=6, rows=8, explore_within=0.8, plain_hold_steps=0, revisit=0.0)
    assert chooser._to_explore[0] == 0 and len(chooser._to_explore) > 1
    chosen = run_batched(chooser, 60, 8, truth, accept=0.6)
    assert chosen[:chooser.explore_steps] == [0] * chooser.explore_steps
    depths = [d for d in chosen if d > 0]
    assert set(depths) == {min(depths)}  # the shallowest depth lost: the deeper ones were never tried
    assert len(depths) <= EARLY_STOP_STEPS
    assert chosen[-20:] == [0] * 20


def test_a_copying_batch_measures_copies_alone_as_a_budget():
    """A batch that copies from the context has the LOOKUP_ONLY arm (copies, no model chain) right after plain
    decoding; measured slower, it is dropped like a losing depth, and plain decoding stays."""
    flat = batched_profile(per_token_ms=0.01, fixed_ms=40.0, drafter_ms=2.0)
    chooser = BudgetChooser(flat, max_budget=6, rows=8, explore_within=0.8, plain_hold_steps=0, revisit=0.0,
                            copies_arm=True)
    assert chooser._to_explore[:2] == [0, LOOKUP_ONLY]
    chosen = []
    for _ in range(40):
        budget = chooser.next_budget()
        chosen.append(budget)
        ms = 100.0 if budget == 0 else 180.0  # copying and drafting both cost more than they return here
        for _ in range(8):
            chooser.observe(batch_record(1, ms, 8))
    assert LOOKUP_ONLY in chosen and LOOKUP_ONLY in chooser.arms and chosen[-10:] == [0] * 10


def test_a_batched_chooser_holds_plain_decoding_longer_while_it_keeps_winning():

    chooser = BudgetChooser(PROFILE, max_budget=4, rows=8, plain_hold_steps=2, revisit=0.0)
    chooser._to_explore = []
    chooser.arms = {0: _arm(80, 400.0, steps=10), 2: _arm(80, 800.0, steps=10)}  # plain twice as fast
    holds = []
    for _ in range(MAX_HOLD_DOUBLINGS + 3):
        assert chooser.next_budget() == 0
        holds.append(decision(chooser).held)
    assert holds == [2 * 2 ** min(i, MAX_HOLD_DOUBLINGS) for i in range(MAX_HOLD_DOUBLINGS + 3)]
    single = BudgetChooser(PROFILE, max_budget=4, plain_hold_steps=2, revisit=0.0)  # batch 1: a fixed hold
    single._to_explore, single.arms = [], dict(chooser.arms)
    assert [single.next_budget() == 0 and decision(single).held for _ in range(3)] == [2, 2, 2]



def test_the_step_decision_is_a_plain_draft_plan():
    """`plan` is `next_budget`'s decision as one value, step for step: the budget (0 for plain decoding and for
    copies alone), copies alone (a batched chooser's LOOKUP_ONLY arm: not a plain step) and the plain steps held.
    `plan_hybrid` is `next_hybrid`'s: a lookup-only tree of so many nodes, or a model budget; never held."""
    flat = batched_profile(per_token_ms=0.01, fixed_ms=40.0, drafter_ms=2.0)
    kinds = {"batch 1": {"profile": PROFILE, "max_budget": 8, "plain_hold_steps": 3, "explore_steps": 2},
             "copying batch": {"profile": flat, "max_budget": 6, "rows": 8, "explore_within": 0.8, "copies_arm": True,
                               "explore_steps": 2}}
    for name, settings in kinds.items():
        planner, decider = BudgetChooser(**settings), BudgetChooser(**settings)
        plans = []
        for step in range(30):
            plan, budget = planner.plan(), decider.next_budget()
            assert plan == DraftPlan(max(budget, 0), lookup_only=budget == LOOKUP_ONLY,
                                     held=decision(decider).held), name
            assert plan.plain == (budget == 0)
            plans.append(plan)
            for chooser in (planner, decider):  # both credited alike: they keep deciding alike
                for _ in range(chooser.rows):
                    chooser.observe(batch_record(1 + step % 3, 100.0 + 10 * decision(chooser).current, chooser.rows))
        assert any(p.plain and p.held == 3 for p in plans) if name == "batch 1" else \
            any(p.lookup_only and not p.plain for p in plans)

    profile = HardwareProfile({1: 40.0, 2: 42.0, 4: 45.0, 8: 50.0, 16: 70.0}, drafter_step_ms=4.0, prefix_tokens=128)
    alone = BudgetChooser(profile, max_budget=8)
    assert alone.plan_hybrid([0.9, 1.7], model=False) == DraftPlan(0, lookup_only=True, lookup_nodes=2)
    assert decision(alone).current == LOOKUP_ONLY
    budget, _ = BudgetChooser(profile, max_budget=8).next_hybrid([])
    assert BudgetChooser(profile, max_budget=8).plan_hybrid([]) == DraftPlan(budget)  # nothing to copy: the model's


def test_a_batched_chooser_drafts_only_where_drafting_beats_plain_decoding_by_its_margin():
    """Measured 15% above plain decoding, a depth is not worth what its own step times leave out (switch
    catch-ups, the drafter's load on hardware other lanes share): with the drafter's 1.25 margin the batch stays
    plain; measured 40% above, it drafts."""
    flat = batched_profile(per_token_ms=0.01, fixed_ms=40.0, drafter_ms=2.0)
    for gain, expected in ((1.15, 0), (1.4, 2)):
        chooser = BudgetChooser(flat, max_budget=2, rows=4, explore_within=0.0, plain_hold_steps=0, revisit=0.0,
                                plain_margin=BATCH_PLAIN_MARGIN)
        chooser._to_explore = []
        chooser.arms = {0: _arm(400, 10_000.0, steps=100), 2: _arm(round(400 * gain), 10_000.0, steps=100)}
        assert chooser.next_budget() == expected
    with pytest.raises(ValueError, match="plain_margin"):
        BudgetChooser(flat, plain_margin=0.9)
