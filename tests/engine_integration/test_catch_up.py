"""Catch-up beside the step (issue 60 item 2; engine/drafters/autoregressive.py `LocalDrafter.catch_up`): a session
whose drafter cache lags its context too far (a prompt, a stretch decoded plainly: a parked session) drafts nothing
with the model for one step, the drafter reads what it missed while the target scores that step, and the next step
drafts without the wait. Output stays the target's: greedy-equal, and sampled output follows the target's
distribution (chi-square)."""

import asyncio
import collections

import pytest
import torch

from chi_square import next_token_pvalue  # tests/chi_square.py
from treeserve.engine.budget import BudgetChooser
from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.drafters.base import DraftRequest
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.hardware.profile import HardwareProfile
from treeserve.engine.models.loading import chat_ids, load_causal_lm
from treeserve.engine.requests import GenerationRequest, SamplingParams
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.speculative_engine import SpeculativeEngine
from treeserve.engine.factory import in_process_engine
from treeserve.engine.tree_config import TreeConfig, tree_config

BESIDE = 16  # tokens of lag past which a session catches up beside the step
PROFILE = HardwareProfile({1: 40.0, 2: 43.0, 4: 60.0, 8: 72.0, 16: 80.0, 32: 92.0, 64: 140.0}, 3.0, 128)
PROMPT = "Tell me a long story about a fox who lived by a river, and what it saw there every morning."


@pytest.fixture(scope="module")
def pair(tiny_target_dir, tiny_drafter_dir):
    return load_causal_lm(tiny_target_dir), load_causal_lm(tiny_drafter_dir).model


def engine_for(pair, tree: TreeConfig, beside: int | None = BESIDE) -> tuple[SpeculativeEngine, LocalDrafter]:
    target, drafter = pair
    local = LocalDrafter(DrafterRunner(drafter, target.model.config.vocab_size), catch_up_beside=beside)
    return in_process_engine(TargetRunner(target.model), local, target.tokenizer, tree, 2048, run_ahead=True), local


def greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_a_prompt_is_read_beside_the_step_then_drafted(pair):
    target, _ = pair
    engine, drafter = engine_for(pair, TreeConfig(method="c2t", budget=6))
    prompt = engine.encode_chat(PROMPT)
    assert len(prompt) > BESIDE
    seq = engine.start(GenerationRequest(prompt, max_new_tokens=24))
    asyncio.run(engine.step([seq]))  # the prefill: the root alone, the drafter not called
    assert drafter.runner.lm.lag(seq.session_id, len(seq.context)) == len(seq.context) - 1
    asyncio.run(engine.step([seq]))  # the drafter lags the whole prompt: no model drafts, its catch-up runs beside the score
    assert seq.steps[-1].tree_size == 0 and seq.steps[-1].catch_up
    assert drafter.runner.lm.lag(seq.session_id, len(seq.context)) <= 2  # read all but the step's own tokens
    asyncio.run(engine.step([seq]))
    assert seq.steps[-1].tree_size > 0  # drafted at once: nothing left to read inline
    while seq.finish is None:
        asyncio.run(engine.step([seq]))
    assert seq.emitted == greedy(target.model, prompt, 24)[:len(seq.emitted)]
    asyncio.run(engine.release(seq))


def test_a_hybrid_step_copies_while_the_model_catches_up(pair):
    """c2t+lookup: the lagging step still gets its copies (they cost the drafter nothing), the model none."""
    target, _ = pair
    engine, drafter = engine_for(pair, TreeConfig(method="c2t+lookup", budget=8))
    prompt = engine.encode_chat("Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the")
    seq = engine.start(GenerationRequest(prompt, max_new_tokens=32))
    asyncio.run(engine.step([seq]))
    asyncio.run(engine.step([seq]))
    assert seq.steps[-1].tree_size == seq.steps[-1].tree_size_lookup  # copies only
    while seq.finish is None:
        asyncio.run(engine.step([seq]))
    assert seq.emitted == greedy(target.model, prompt, 32)[:len(seq.emitted)]
    asyncio.run(engine.release(seq))


def test_a_parked_batch_row_resumes_without_stalling_the_batch(pair):
    """Batched: a row whose drafter cache lags (as after a stretch of held plain steps) drafts no model chain that
    step while the others do, and drafts again once caught up; every row greedy-equal."""
    target, _ = pair
    engine, drafter = engine_for(pair, TreeConfig(method="c2t", budget=4))
    prompts = [engine.encode_chat(p) for p in (PROMPT, "List three rivers of Europe and their lengths.")]
    running = engine.start(GenerationRequest(prompts[1], max_new_tokens=20))
    asyncio.run(engine.step([running]))
    asyncio.run(engine.step([running]))  # caught up beside this step
    asyncio.run(engine.step([running]))
    arriving = engine.start(GenerationRequest(prompts[0], max_new_tokens=20))
    batch = [running, arriving]
    asyncio.run(engine.step(batch))  # the arrival's prefill; the running row drafts
    assert running.steps[-1].tree_size > 0
    lagging = drafter.draft([engine.draft_request(s) for s in batch], 2)
    assert lagging.catching_up == (arriving.session_id,) and lagging.trees[1].num_nodes == 1  # the arrival: its catch-up pending
    assert drafter.catch_up() == 1
    assert drafter.runner.lm.lag(arriving.session_id, len(arriving.context)) <= 1
    while any(s.finish is None for s in batch):
        asyncio.run(engine.step([s for s in batch if s.finish is None]))
    for s, prompt in zip(batch, (prompts[1], prompts[0])):
        assert s.emitted == greedy(target.model, prompt, 20)[:len(s.emitted)]
        asyncio.run(engine.release(s))


def test_a_parked_session_costs_the_drafter_nothing(pair):
    """A batch whose chooser decides plain decoding (a batched chooser measures plain decoding first): its lagging
    sessions are not caught up (no forward, no KV cache here) until a step has the model draft for them."""
    target, drafter_model = pair
    drafter = LocalDrafter(DrafterRunner(drafter_model, target.model.config.vocab_size),
                           budget=BudgetChooser(PROFILE), catch_up_beside=BESIDE)
    tree = tree_config("c2t", "auto")
    contexts = [chat_ids(target.tokenizer, p) for p in (PROMPT, "List three rivers of Europe and their lengths.")]
    drafted = drafter.draft([DraftRequest(f"s{i}", c, SamplingParams(), tree, 0) for i, c in enumerate(contexts)], 2)
    assert all(t.num_nodes == 1 for t in drafted.trees) and drafted.catching_up == ()
    assert drafter.catch_up() == 0 and drafter.session_ids() == [] and drafter.runner.seconds == 0.0


def test_a_released_session_is_not_caught_up(pair):
    engine, drafter = engine_for(pair, TreeConfig(method="c2t", budget=4))
    context = engine.encode_chat(PROMPT)
    drafted = drafter.draft([DraftRequest("gone", context, SamplingParams(), TreeConfig(method="c2t", budget=4), 0)])
    assert drafted.catching_up == ("gone",)
    drafter.release("gone")
    assert drafter.catch_up() == 0 and "gone" not in drafter.session_ids()


def test_inline_catch_up_keeps_drafting_every_step(pair):
    """catch_up_beside None (the in-process default without run-ahead's thread): the drafter reads the prompt in the
    step's first forward, as before."""
    engine, drafter = engine_for(pair, TreeConfig(method="c2t", budget=6), beside=None)
    prompt = engine.encode_chat(PROMPT)
    seq = engine.start(GenerationRequest(prompt, max_new_tokens=8))
    asyncio.run(engine.step([seq]))
    asyncio.run(engine.step([seq]))
    assert seq.steps[-1].tree_size > 0
    asyncio.run(engine.release(seq))


def test_sampled_output_after_a_catch_up_follows_the_target(pair):
    """The token of the step right after the catch-up (the third emitted, the first drafted by the model), given
    the two before it, against the target's warped distribution there (chi-square over seeds)."""
    target, _ = pair
    engine, drafter = engine_for(pair, TreeConfig(method="c2t", budget=6))
    prompt = engine.encode_chat(PROMPT)
    sampling = SamplingParams(temperature=1.0, top_k=4)
    outputs = [engine.generate([GenerationRequest(prompt, max_new_tokens=3, sampling=sampling, seed=seed)])[0]
               for seed in range(480)]
    assert all(len(o.token_ids) == 3 for o in outputs)
    assert all(o.steps[1].tree_size == 0 for o in outputs)  # the catch-up step
    head = collections.Counter(tuple(o.token_ids[:2]) for o in outputs).most_common(1)[0][0]
    counts = collections.Counter(o.token_ids[2] for o in outputs if tuple(o.token_ids[:2]) == head)
    draws = sum(counts.values())
    assert draws >= 40
    assert next_token_pvalue(target.model, prompt + list(head), counts, sampling) > 1e-3
