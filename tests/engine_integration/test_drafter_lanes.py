"""Lanes (engine/lanes.py): a drafter's budget choosers measure every lane's steps but keep each lane's decision
apart, so lanes stepped in turn (as the router steps its Target replicas' sessions) each credit their records to
their own decision and hold their own plain decoding; a draft call's facts come back with its trees."""

from __future__ import annotations

import asyncio

import pytest
import torch

from treeserve.engine.budget import BudgetChooser
from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.hardware.profile import HardwareProfile
from treeserve.engine.lanes import Lanes
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.requests import GenerationRequest
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.factory import in_process_engine
from treeserve.engine.tree_config import TreeConfig



@pytest.fixture(scope="module")
def pair(tiny_target_dir, tiny_drafter_dir):
    return load_causal_lm(tiny_target_dir), load_causal_lm(tiny_drafter_dir).model


@torch.inference_mode()
def reference(model, prompt_ids: list[int], n: int) -> list[int]:
    out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


def test_lanes_keep_the_least_recently_stepped_within_their_limit():
    made = []
    lanes = Lanes(lambda lane: made.append(lane) or {"lane": lane}, limit=2)
    a = lanes["a"]
    lanes["b"]
    assert lanes["a"] is a  # kept: made once
    lanes["c"]  # "b" is now the least recently stepped: dropped
    assert len(lanes) == 2 and lanes["a"] is a
    lanes["b"]  # made afresh, and "c" goes
    assert made == ["a", "b", "c", "b"] and len(lanes) == 2


def test_two_lanes_stepped_in_turn_credit_their_own_choosers(pair):
    """Two batch-1 sequences, each a lane of its own, stepped alternately (the router's two Target replicas): the
    chooser decides each lane's steps apart and credits every step of both lanes to the decision of its own lane,
    plain holds included, and both outputs equal the target's greedy decoding. One decision for both lanes would
    credit a lane's records to the other lane's latest decision (and drop the ones past what it is owed)."""
    target, drafter = pair
    profile = HardwareProfile({1: 40.0, 2: 42.0, 4: 45.0}, 5.0, 128)
    # Two budgets to explore for 2 steps each, then plain decoding (explored last at batch size 1), held 3 steps.
    chooser = BudgetChooser(profile, max_budget=2, explore_steps=2, plain_hold_steps=3)
    local = LocalDrafter(DrafterRunner(drafter, target.model.config.vocab_size), budget=chooser)
    calls = {"a": [], "b": []}
    draft = local.draft

    def spy(requests, batch_size=None, lane=""):
        call = draft(requests, batch_size, lane)
        calls[lane].append(call)
        return call

    local.draft = spy
    engine = in_process_engine(TargetRunner(target.model), local, target.tokenizer,
                               TreeConfig(method="dyspec", budget=4, budget_auto=True), max_context_tokens=2048)
    prompts = {lane: engine.encode_chat(text) for lane, text in
               (("a", "Tell me about the weather"), ("b", "Name three colours."))}
    seqs = {lane: engine.start(GenerationRequest(prompt, max_new_tokens=32)) for lane, prompt in prompts.items()}
    while any(s.finish is None for s in seqs.values()):
        for lane, s in seqs.items():
            if s.finish is None:
                asyncio.run(engine.step([s], lane))
    for lane, s in seqs.items():
        assert s.emitted == reference(target.model, prompts[lane], 32)[:len(s.emitted)]

    # Every step of both lanes after its prefill is credited, each to its own lane's decision.
    assert set(chooser.decisions) == {"a", "b"}
    assert sum(arm.steps for arm in chooser.arms.values()) == pytest.approx(
        sum(len(s.steps) - 1 for s in seqs.values()))
    assert chooser.arms[0].steps >= 4  # plain decoding was decided and held
    for lane, s in seqs.items():
        # Held steps never called the drafter: fewer calls than the steps after the prefill.
        assert len(calls[lane]) < len(s.steps) - 1
        assert all(call.hold_steps in (0, chooser.plain_hold_steps) for call in calls[lane])
    asyncio.run(engine.release(seqs["a"]))
    asyncio.run(engine.release(seqs["b"]))
