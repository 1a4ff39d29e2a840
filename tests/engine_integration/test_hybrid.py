"""Hybrid drafting (engine/lookup/) through the real engine on the tiny pair: greedy output equals the target's
own greedy decoding for every lookup method, at batch size 1 (fixed and auto budgets) and in batched chain
mode; lookup candidates are proposed, accepted and counted per source; the chooser drafts lookup-only steps
when they pay and falls back to the model's when they do not."""

import pytest
import torch

from treeserve.engine.budget import LOOKUP_ONLY, BudgetChooser
from treeserve.engine.hardware.profile import HardwareProfile
from treeserve.engine.tree_config import TreeConfig
from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.lookup import MATCH_BUCKETS, LookupSettings
from treeserve.engine.factory import in_process_engine
from treeserve.engine.models.loading import chat_ids, load_causal_lm
from treeserve.engine.requests import GenerationRequest, StepRecord
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.requests import SamplingParams

from chooser_lane import decision  # tests/chooser_lane.py

# The tiny random target soon repeats itself, and these prompts repeat themselves: both give the lookup matches.
PROMPTS = ["one two three four five six. one two three four five six. one two three",
           "The fox jumps. The fox jumps. The fox"]
HYBRID = [
    TreeConfig(method="lookup", budget=8),
    TreeConfig(method="chain+lookup", depth=4),
    TreeConfig(method="eagle2+lookup", budget=12, depth=4, top_k=4),
    TreeConfig(method="dyspec+lookup", budget=10),
    TreeConfig(method="dyspec_threshold+lookup", threshold=0.05, budget=16),
    TreeConfig(method="opt_tree+lookup", budget=10, delta=0.05),
    TreeConfig(method="c2t+lookup", budget=12, depth=4, top_k=4),
]


@pytest.fixture(scope="module")
def pair(tiny_target_dir, tiny_drafter_dir):
    return load_causal_lm(tiny_target_dir), load_causal_lm(tiny_drafter_dir).model


def flat_profile() -> HardwareProfile:
    """A machine where a target forward costs the same for any tree size: drafting anything with a chance of
    acceptance pays, so a lookup-only tree beats plain decoding whenever the lookup proposes something."""
    return HardwareProfile({1: 40.0, 64: 40.0}, drafter_step_ms=4.0, prefix_tokens=128)


def make_engine(pair, tree, chooser=None):
    target, drafter = pair
    local = LocalDrafter(DrafterRunner(drafter, target.model.config.vocab_size), budget=chooser)
    return in_process_engine(TargetRunner(target.model), local, target.tokenizer, tree, max_context_tokens=2048)


@torch.inference_mode()
def reference(model, prompt_ids, n):
    out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def references(pair):
    """prompt text -> (chat prompt ids, the target's own greedy 24 tokens)."""
    target = pair[0]
    ids = {p: chat_ids(target.tokenizer, p) for p in PROMPTS}
    return {p: (i, reference(target.model, i, 24)) for p, i in ids.items()}


def check_greedy(engine, references, n=24):
    """Greedy output equals the reference for every prompt; returns (lookup candidates, accepted copies)."""
    copied = accepted_copies = 0
    for text in PROMPTS:
        prompt, expected = references[text]
        result = engine.generate([GenerationRequest(prompt, max_new_tokens=n)])[0]
        assert result.token_ids == expected[:len(result.token_ids)]
        by_source = result.accepted_by_source()
        assert sum(by_source.values()) == sum(s.accepted for s in result.steps)
        assert all(v >= 0 for v in by_source.values())
        copied += sum(s.tree_size_lookup for s in result.steps)
        accepted_copies += by_source["lookup"] + by_source["both"]
    return copied, accepted_copies


@pytest.mark.parametrize("tree", HYBRID, ids=lambda t: t.method)
def test_hybrid_greedy_equals_target_generate(pair, references, tree):
    copied, accepted = check_greedy(make_engine(pair, tree), references)
    assert copied > 0, "the lookup proposed nothing"
    if tree.method in ("lookup", "opt_tree+lookup", "c2t+lookup", "eagle2+lookup"):
        assert accepted > 0, "no copied token was accepted"


def test_auto_budget_drafts_lookup_only_steps_and_stays_greedy_equal(pair, references, monkeypatch):
    chooser = BudgetChooser(flat_profile(), explore_steps=1)  # 48 steps: exploration must end early
    engine = make_engine(pair, TreeConfig(method="c2t+lookup", budget_auto=True, depth=4, top_k=4), chooser)
    seen = []
    original = BudgetChooser.next_hybrid

    def spy(self, gains, model=True, lane="", explore=True):  # every chooser the drafter asks (both contexts)
        out = original(self, gains, model, lane, explore)
        seen.append(out)
        return out

    monkeypatch.setattr(BudgetChooser, "next_hybrid", spy)
    calls = []
    draft = engine.drafter.local.draft
    monkeypatch.setattr(engine.drafter.local, "draft", lambda *args: calls.append(draft(*args)) or calls[-1])
    check_greedy(engine, references)
    assert any(nodes > 0 for _, nodes in seen), "no lookup-only step"
    assert all(budget == 0 or nodes == 0 for budget, nodes in seen)
    calibrated = chooser.cost_ratios or engine.drafter.local.planner.copy_budget.cost_ratios
    assert calibrated, "lookup-only steps did not calibrate their cost"
    assert calls and all(call.hold_steps == 0 for call in calls)  # the lookup is checked every step: no holds


def test_steps_with_something_to_copy_are_measured_apart(pair, references):
    """Auto budgets: hybrid steps whose lookup expects to copy are decided and measured by the drafter's
    `copy_budget`, the others by its `budget`; each chooser gets the records of the steps it decided."""
    chooser = BudgetChooser(flat_profile())
    engine = make_engine(pair, TreeConfig(method="c2t+lookup", budget_auto=True, depth=4, top_k=4), chooser)
    contexts = []
    original = engine.drafter.local.planner._copy_chooser

    def spy(gains):
        picked = original(gains)
        contexts.append((bool(gains) and gains[-1] >= 0.5, picked))
        return picked

    engine.drafter.local.planner._copy_chooser = spy
    check_greedy(engine, references)
    copy = engine.drafter.local.planner.copy_budget
    assert copy is not None and copy is not chooser and copy.profile is chooser.profile
    assert {copying for copying, _ in contexts} == {True, False}, "both contexts should occur on these prompts"
    assert all((picked is copy) == copying for copying, picked in contexts)
    # The copying steps' records reached the copy chooser (model budgets measured while it explores). (On these
    # short answers the other context occurs at a request's first step, a prefill step, which no chooser is
    # credited.)
    assert sum(a.steps for a in copy.arms.values()) > 0
    assert engine.drafter.local.step_choosers() == {"": chooser, "copying": copy}  # what the bench reports


def test_lookup_method_auto_never_calls_the_model(pair, references):
    engine = make_engine(pair, TreeConfig(method="lookup", budget_auto=True), BudgetChooser(flat_profile()))
    for text in PROMPTS:
        prompt, expected = references[text]
        result = engine.generate([GenerationRequest(prompt, max_new_tokens=24)])[0]
        assert result.token_ids == expected[:len(result.token_ids)]
        assert all(s.draft_forward_ms == 0 for s in result.steps)
        assert any(s.tree_size > 0 for s in result.steps)


def test_batched_hybrid_chains_equal_single(pair, references):
    engine = make_engine(pair, TreeConfig(method="c2t+lookup", budget=8))
    results = engine.generate([GenerationRequest(references[p][0], max_new_tokens=24) for p in PROMPTS])
    for text, r in zip(PROMPTS, results):
        assert r.token_ids == references[text][1][:len(r.token_ids)]
    assert results[0].steps[1].batch_size == 2
    assert sum(s.tree_size_lookup for r in results for s in r.steps) > 0


def references_ids(engine):
    return chat_ids(engine.tokenizer, PROMPTS[0])


def test_sampled_hybrid_runs_and_is_reproducible(pair):
    engine = make_engine(pair, TreeConfig(method="dyspec+lookup", budget=10))
    request = GenerationRequest(references_ids(engine), max_new_tokens=16, sampling=SamplingParams(temperature=0.8), seed=7)
    first = engine.generate([request])[0]
    second = engine.generate([request])[0]
    assert first.token_ids == second.token_ids and len(first.token_ids) == 16


def record(accepted: int, tree_size: int, ms: float) -> StepRecord:
    return StepRecord(tree_size=tree_size, accepted=accepted, emitted=accepted + 1, batch_size=1, draft_ms=0.0,
                      draft_model_ms=0.0, score_ms=ms, verify_ms=0.0)


def test_chooser_prices_lookup_only_steps():
    profile = HardwareProfile({1: 40.0, 2: 42.0, 4: 45.0, 8: 50.0, 16: 70.0}, drafter_step_ms=4.0, prefix_tokens=128)
    chooser = BudgetChooser(profile, max_budget=8, explore_steps=1)
    # Nothing to copy: the model's budgets (exploration first).
    budget, nodes = chooser.next_hybrid([])
    assert nodes == 0 and decision(chooser).current == budget
    gains = [0.9, 1.7, 2.4, 3.0, 3.5, 3.9]
    explored = {budget}
    for _ in range(20):  # while exploring, every promising budget is measured whatever the lookup offers
        chooser.observe(StepRecord(tree_size=budget, accepted=0, emitted=1, batch_size=1, draft_ms=5.0,
                                   draft_model_ms=4.0, score_ms=45.0, verify_ms=0.0))
        budget, nodes = chooser.next_hybrid(gains)
        if nodes:
            break
        explored.add(budget)
    assert explored == set(chooser._to_explore)
    # Then a confident copy of 6 tokens: expected ~4 accepted for ~1.2 plain steps beats the model budgets.
    assert budget == 0 and nodes == 6 and decision(chooser).current == LOOKUP_ONLY and decision(chooser).held == 0
    chooser.observe(record(accepted=1, tree_size=6, ms=48.0))  # it accepted less than predicted
    assert chooser.lookup_factor < 1.0 and chooser.cost_ratios[-1] == pytest.approx(48.0 / profile.target_time_ms(7))
    # A weak copy does not beat a measured model budget that accepts well.
    for _ in range(3):
        decision(chooser).current, decision(chooser).owed = 4, 1.0
        chooser.observe(StepRecord(tree_size=4, accepted=3, emitted=4, batch_size=1, draft_ms=10.0,
                                   draft_model_ms=8.0, score_ms=45.0, verify_ms=0.0))
    budget, nodes = chooser.next_hybrid([0.05])
    assert nodes == 0
    # Lookup-only method: plain decoding unless the copy pays.
    alone = BudgetChooser(profile, max_budget=8)
    assert alone.next_hybrid([0.001], model=False) in ((0, 0), (0, 1))
    assert alone.next_hybrid([0.9, 1.7], model=False) == (0, 2)


def test_shared_outputs_feed_later_requests_and_stay_greedy_equal(pair, references):
    """With the cross-request index on, a request that repeats an earlier one drafts from that one's output
    (predictions from the shared outputs are made and hit), and its output is still the target's greedy output."""
    target, drafter = pair
    local = LocalDrafter(DrafterRunner(drafter, target.model.config.vocab_size),
                         lookup=LookupSettings(shared_tokens=4096))
    engine = in_process_engine(TargetRunner(target.model), local, target.tokenizer,
                               TreeConfig(method="lookup", budget=8), max_context_tokens=2048)
    for text in PROMPTS:
        prompt, expected = references[text]
        for _ in range(2):
            result = engine.generate([GenerationRequest(prompt, max_new_tokens=24)])[0]
            assert result.token_ids == expected[:len(result.token_ids)]
    assert local.lookups.shared().outputs == 4  # each finished request's output joined the index
    shared_buckets = slice(len(MATCH_BUCKETS), None)
    assert sum(local.lookups.pooled.trials[shared_buckets]) > 0 and sum(local.lookups.pooled.hits[shared_buckets]) > 0


def test_factory_passes_lookup_settings(tiny_target_dir, tiny_drafter_dir, references):
    """`build_engine(..., lookup=...)` (what the CLI and bench use) reaches the drafter's lookup source."""
    from treeserve.engine.factory import build_engine

    engine = build_engine(str(tiny_target_dir), str(tiny_drafter_dir), method="c2t+lookup", budget=8,
                          lookup=LookupSettings(shared_tokens=1024, max_ngram=6))
    settings = engine.drafter.local.lookups.settings
    assert (settings.shared_tokens, settings.max_ngram) == (1024, 6) and engine.drafter.local.lookups.shared() is not None
    prompt, expected = references[PROMPTS[0]]
    result = engine.generate([GenerationRequest(prompt, max_new_tokens=24)])[0]
    assert result.token_ids == expected[:len(result.token_ids)]
