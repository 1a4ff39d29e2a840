"""Speculative generation on the tiny pair equals the target's own greedy decoding, for every method."""

import pytest
import torch

from treeserve.engine.tree_config import TreeConfig
from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.drafters.base import Drafted, DrafterBase, root_only
from treeserve.engine.factory import in_process_engine
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.requests import FinishReason, GenerationRequest
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.requests import SamplingParams

from chooser_lane import decision  # tests/chooser_lane.py

METHODS = [
    TreeConfig(method="autoregressive"),
    TreeConfig(method="chain", depth=4),
    TreeConfig(method="static", static_tree="mc_sim_7b_63"),
    TreeConfig(method="eagle2", budget=16, depth=4, top_k=4),
    TreeConfig(method="dyspec", budget=12),
    TreeConfig(method="dyspec_threshold", threshold=0.05, budget=24),
    TreeConfig(method="opt_tree", budget=12, delta=0.1),
    TreeConfig(method="c2t", budget=16, depth=4, top_k=4),
]


@pytest.fixture(scope="module")
def pair(tiny_target_dir, tiny_drafter_dir):
    target = load_causal_lm(tiny_target_dir)
    drafter = load_causal_lm(tiny_drafter_dir).model
    return target, drafter


def make_engine(pair, tree):
    target, drafter = pair
    local = LocalDrafter(DrafterRunner(drafter, target.model.config.vocab_size))
    return in_process_engine(TargetRunner(target.model), local, target.tokenizer, tree, max_context_tokens=2048)


@torch.inference_mode()
def reference(model, prompt_ids, n):
    out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("tree", METHODS, ids=lambda t: t.method)
def test_greedy_equals_target_generate(pair, tree):
    engine = make_engine(pair, tree)
    prompts = [engine.encode_chat(p) for p in ["Tell me a story about a fox.", "2+2=?"]]
    for prompt in prompts:
        result = engine.generate([GenerationRequest(prompt, max_new_tokens=20)])[0]
        expected = reference(pair[0].model, prompt, 20)
        n = len(result.token_ids)
        assert result.token_ids == expected[:n]
        assert result.finish_reason in (FinishReason.LENGTH, FinishReason.EOS)
        assert sum(s.emitted for s in result.steps) >= n
        # Drafting time splits into tree construction, runner bookkeeping and model forwards (nested timers).
        drafted = [s for s in result.steps if s.tree_size > 0]
        assert tree.method == "autoregressive" or drafted
        assert all(s.draft_ms >= s.draft_model_ms >= s.draft_forward_ms > 0 for s in drafted)


def test_batch_chain_mode_equals_single(pair):
    engine = make_engine(pair, TreeConfig(method="dyspec", budget=8))
    prompts = [engine.encode_chat(p) for p in ["Hello there", "Write a poem about rain and the sea", "Why?"]]
    lengths = [12, 20, 7]
    results = engine.generate([GenerationRequest(p, max_new_tokens=n) for p, n in zip(prompts, lengths)])
    for p, n, r in zip(prompts, lengths, results):
        assert r.token_ids == reference(pair[0].model, p, n)[:len(r.token_ids)]
        assert all(s.batch_size >= 1 for s in r.steps)
    assert results[1].steps[0].batch_size == 3


@pytest.mark.parametrize("bad, field", [
    (dict(prompt_ids=[]), "prompt"),
    (dict(prompt_ids=[1, 2], max_new_tokens=0), "max_new_tokens"),
    (dict(prompt_ids=[1, 2], max_new_tokens=5000), "context window"),
])
def test_bad_requests_rejected_before_model_work(pair, bad, field):
    engine = make_engine(pair, TreeConfig(method="chain"))
    with pytest.raises(ValueError, match=field):
        engine.generate([GenerationRequest(**bad)])


def test_bad_sampling_rejected():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1, top_p=1.5)


def test_stop_string(pair):
    engine = make_engine(pair, TreeConfig(method="chain", depth=3))
    prompt = engine.encode_chat("Say something")
    full = engine.generate([GenerationRequest(prompt, max_new_tokens=16)])[0]
    stop = full.text[len(full.text) // 2:][:3]
    if not stop.strip():
        pytest.skip("tiny model produced no usable stop string")
    cut = engine.generate([GenerationRequest(prompt, max_new_tokens=16, stop_strings=(stop,))])[0]
    assert cut.finish_reason == FinishReason.STOP_STRING
    assert stop not in cut.text
    assert full.text.startswith(cut.text)


def test_batched_chain_depth_is_chosen_per_batch_size_and_stays_lossless(pair):
    """With hardware-aware budgets, batched steps explore chain depths (0 = plain batched decoding) in
    their own chooser per batch-size bucket, fed one record per sequence; output stays the target's."""
    from treeserve.engine.budget import BudgetChooser
    from treeserve.engine.hardware.profile import HardwareProfile

    target, drafter = pair
    # Flat enough that every depth stays within the batched chooser's step-cost ceiling (BATCH_STEP_COST)
    profile = HardwareProfile({1: 40.0, 2: 40.5, 4: 41.0, 8: 42.0, 16: 43.0, 32: 44.0}, 0.5, 128)
    local = LocalDrafter(DrafterRunner(drafter, target.model.config.vocab_size),
                         budget=BudgetChooser(profile, max_budget=8, explore_steps=1), batch_chain_depth=4)
    engine = in_process_engine(TargetRunner(target.model), local, target.tokenizer,
                               TreeConfig(method="dyspec", budget=8, budget_auto=True), max_context_tokens=2048)
    prompts = [engine.encode_chat(p) for p in ["Hello there", "Write a poem about rain", "Why?", "Count to ten"]]
    results = engine.generate([GenerationRequest(p, max_new_tokens=24) for p in prompts])
    for p, r in zip(prompts, results):
        assert r.token_ids == reference(target.model, p, 24)[:len(r.token_ids)]
    chooser = local.planner.batch_budgets[4]
    assert set(local.planner.batch_budgets) <= {2, 4}
    assert chooser.candidates == [0, 1, 2, 3, 4]
    measured = {b for b, arm in chooser.arms.items() if arm.steps >= 1}
    assert 0 in measured and len(measured) >= 2  # plain batched decoding and some chain depth were timed
    batched_steps = len([s for s in results[0].steps if s.batch_size == 4])
    # Every batched step is credited once, except the first: it prefilled the prompts.
    assert abs(sum(arm.steps for arm in chooser.arms.values()) - (batched_steps - 1)) < 1e-6


def test_an_explicit_budget_caps_batched_chains_without_the_chooser(pair):
    """A batch whose requests fix their budget drafts chains of at most that many tokens (and of the
    configured depth, not a chosen one); the batch choosers are neither asked nor credited."""
    from treeserve.engine.budget import BudgetChooser
    from treeserve.engine.hardware.profile import HardwareProfile
    from treeserve.engine.drafters.base import DraftRequest

    target, drafter = pair
    profile = HardwareProfile({1: 40.0, 2: 42.0, 4: 45.0, 8: 50.0}, 5.0, 128)
    local = LocalDrafter(DrafterRunner(drafter, target.model.config.vocab_size),
                         budget=BudgetChooser(profile, max_budget=8), batch_chain_depth=4,
                         batch_chain_beta=1e-6)  # the C2T prior's early exit never stops these chains
    contexts = [[5, 6, 7, 8], [9, 10, 11]]
    call = local.draft([DraftRequest(f"s{i}", c, SamplingParams(), TreeConfig(method="dyspec", budget=2), 0)
                        for i, c in enumerate(contexts)])
    assert [t.num_nodes - 1 for t in call.trees] == [2, 2]
    assert local.planner.batch_budgets == {} and call.hold_steps == 0
    wide = local.draft([DraftRequest(f"s{i}", c, SamplingParams(), TreeConfig(method="dyspec", budget=12), 0)
                        for i, c in enumerate(contexts)]).trees
    assert [t.num_nodes - 1 for t in wide] == [4, 4]  # batch_chain_depth


def test_a_sequence_drafted_alone_for_a_batched_step_is_drafted_as_the_batch(pair):
    """One speculative sequence in a step of several (the others autoregressive here; or held by other
    Drafter replicas: `batch_size`) is a batched step: a chain from the bucket chooser, never a batch-1
    tree from the batch-1 chooser, so the step's records (batch_size > 1) reach the chooser that decided."""
    from treeserve.engine.budget import BudgetChooser
    from treeserve.engine.hardware.profile import HardwareProfile
    from treeserve.engine.drafters.base import DraftRequest

    target, drafter = pair
    profile = HardwareProfile({1: 40.0, 2: 42.0, 4: 45.0, 8: 50.0}, 5.0, 128)
    single = BudgetChooser(profile, max_budget=8)
    single.plan = lambda: pytest.fail("a batched step asked the batch-1 chooser")
    local = LocalDrafter(DrafterRunner(drafter, target.model.config.vocab_size), budget=single,
                         batch_chain_depth=4, batch_chain_beta=1e-6)
    auto = TreeConfig(method="dyspec", budget=8, budget_auto=True)
    alone = DraftRequest("s0", [5, 6, 7, 8], SamplingParams(), auto, 0)
    plain = DraftRequest("s1", [9, 10, 11], SamplingParams(), TreeConfig(method="autoregressive"), 0)
    for requests, batch_size in (([alone, plain], None), ([alone], 3)):
        tree = local.draft(requests, batch_size).trees[0]
        assert all(len(tree.children(n)) <= 1 for n in range(tree.num_nodes))  # a chain (or the root alone)
        assert tree.num_nodes - 1 <= local.batch_chain_depth
    assert set(local.planner.batch_budgets) == {2, 4}


def test_held_plain_decoding_skips_the_drafter_and_stays_lossless(pair):
    """When the budget chooser picks plain decoding it holds it: the engine does not call the drafter for
    the held steps, the held steps' records reach budget 0, and the drafter catches up its cache from the
    context at the next drafted step (output = the target's greedy decoding)."""
    from treeserve.engine.budget import BudgetChooser
    from treeserve.engine.hardware.profile import HardwareProfile

    target, drafter = pair
    # Explore budget 0 first and hold it 3 steps, then a budget that drafts, then exploit.
    chooser = BudgetChooser(HardwareProfile({1: 40.0, 2: 42.0, 4: 45.0}, 5.0, 128), max_budget=4,
                            explore_steps=2, plain_hold_steps=3)
    chooser._to_explore = [0, 2]
    local = LocalDrafter(DrafterRunner(drafter, target.model.config.vocab_size), budget=chooser)
    calls = []
    draft = local.draft
    local.draft = lambda requests, batch_size=None, lane="": calls.append(len(requests)) or draft(requests, batch_size,
                                                                                                  lane)
    engine = in_process_engine(TargetRunner(target.model), local, target.tokenizer,
                               TreeConfig(method="dyspec", budget=4, budget_auto=True), max_context_tokens=2048)
    prompt = engine.encode_chat("Tell me about the weather")
    result = engine.generate([GenerationRequest(prompt, max_new_tokens=24)])[0]
    assert result.token_ids == reference(target.model, prompt, 24)[:len(result.token_ids)]
    assert len(calls) < len(result.steps)  # held steps never called the drafter
    drafted = [s for s in result.steps if s.tree_size > 0]
    assert drafted, "budget 2 was explored: some steps drafted"
    # Step 1 (prefill) is not reported; after it every step is credited to the budget that decided it.
    assert abs(sum(a.steps for a in chooser.arms.values()) - (len(result.steps) - 1)) < 1e-6
    assert chooser.arms[0].steps >= 3  # at least the 3 steps held after the first (prefill) decision


def test_a_fixed_budget_is_not_overridden_by_the_chooser(pair):
    """Only budget_auto trees are sized by the hardware-aware chooser: a request's explicit budget stands
    (the chooser, which would pick plain decoding here, is neither asked nor credited)."""
    from treeserve.engine.budget import BudgetChooser
    from treeserve.engine.hardware.profile import HardwareProfile
    from treeserve.engine.drafters.base import DraftRequest

    target, drafter = pair
    chooser = BudgetChooser(HardwareProfile({1: 40.0, 2: 42.0, 4: 45.0}, 5.0, 128), max_budget=4)
    chooser._to_explore = [0]
    local = LocalDrafter(DrafterRunner(drafter, target.model.config.vocab_size), budget=chooser)
    context = [5, 6, 7, 8]
    fixed = local.draft([DraftRequest("s", context, SamplingParams(), TreeConfig(method="dyspec", budget=12), 0)])
    assert fixed.trees[0].num_nodes - 1 == 12 and fixed.hold_steps == 0 and decision(chooser).owed == 0
    auto = TreeConfig(method="dyspec", budget=12, budget_auto=True)
    chosen = local.draft([DraftRequest("s", context, SamplingParams(), auto, 0)])
    assert chosen.trees[0].num_nodes == 1 and decision(chooser).current == 0
    assert chosen.hold_steps == chooser.plain_hold_steps


def test_a_plain_decoding_hold_survives_requests_leaving_the_batch(pair):
    """The hold is kept per batch-size bucket: a batch of 4 shrinking to 3 stays held (no drafter call),
    shrinking to 1 (another bucket, another chooser) asks the drafter again."""

    target, _ = pair

    class HoldingDrafter(DrafterBase):
        def __init__(self):
            self.batch_sizes = []

        def draft(self, requests, batch_size=None, lane=""):
            self.batch_sizes.append(len(requests))
            # as a chooser that picked plain decoding for a long stretch
            return Drafted([root_only(r.context) for r in requests], hold_steps=1000)

        def observe(self, record, lane=""):
            pass

        def release(self, session_id):
            return True

    drafter = HoldingDrafter()
    engine = in_process_engine(TargetRunner(target.model), drafter, target.tokenizer,
                               TreeConfig(method="dyspec", budget=4), max_context_tokens=2048)
    prompt = engine.encode_chat("Tell me about the weather")
    lengths = [3, 6, 6, 12]  # batch sizes 4, 3 (same bucket), then 1
    results = engine.generate([GenerationRequest(prompt, max_new_tokens=n) for n in lengths])
    assert [len(r.token_ids) for r in results] == lengths  # no early EOS: the batch shrinks as planned
    assert [s.batch_size for s in results[-1].steps] == [4] * 3 + [3] * 3 + [1] * 6
    assert drafter.batch_sizes == [4, 1]
