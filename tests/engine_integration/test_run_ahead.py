"""Run-ahead drafting (engine/drafters/run_ahead.py): trees drafted for the expected outcome of a step while the
target scores it. Hits and misses both decode exactly the target's greedy output; a tree drafted ahead is used
only for the exact context it assumed; sampled requests draft nothing ahead and keep following the target."""

import asyncio
import collections

import pytest
import torch

from chi_square import next_token_pvalue  # tests/chi_square.py
from treeserve.engine.tree_config import TreeConfig
from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.drafters.base import DraftRequest
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.drafters.run_ahead import AheadTree, RunAheadStore, likely_path
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.requests import GenerationRequest
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.requests import SamplingParams
from treeserve.engine.speculative_engine import SpeculativeEngine
from treeserve.engine.factory import in_process_engine
from treeserve.engine.tree import TokenTree


@pytest.fixture(scope="module")
def pair(tiny_target_dir, tiny_drafter_dir):
    return load_causal_lm(tiny_target_dir), load_causal_lm(tiny_drafter_dir).model


def engine_for(pair, tree: TreeConfig) -> tuple[SpeculativeEngine, LocalDrafter]:
    target, drafter = pair
    local = LocalDrafter(DrafterRunner(drafter, target.model.config.vocab_size))
    return in_process_engine(TargetRunner(target.model), local, target.tokenizer, tree, 2048, run_ahead=True), local


def greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_likely_path_follows_the_most_probable_children():
    tree = TokenTree.build([5, 6, 7, 8, 9], [-1, 0, 0, 1, 1],
                           log_joint=[0.0, -1.0, -0.5, -2.0, -1.5])
    assert likely_path(tree) == [2]  # node 2 (-0.5) beats node 1 (-1.0); node 2 is a leaf
    deeper = TokenTree.build([5, 6, 7, 8], [-1, 0, 1, 1], log_joint=[0.0, -0.1, -0.9, -0.3])
    assert likely_path(deeper) == [1, 3]


def test_an_ahead_tree_serves_only_its_exact_context():
    store = RunAheadStore()
    tree = TokenTree.build([9, 4], [-1, 0])
    store.put("s", AheadTree([1, 2, 3, 9], tree))
    assert store.take("s", [1, 2, 3, 8]) is None and store.misses == 1
    store.put("s", AheadTree([1, 2, 3, 9], tree))
    assert store.take("s", [1, 2, 3, 9]).tree is tree and store.hits == 1
    assert store.take("s", [1, 2, 3, 9]) is None and (store.hits, store.misses) == (1, 1)  # forgotten


@pytest.mark.parametrize("method,budget", [("dyspec", 6), ("c2t", 8), ("c2t+lookup", 8), ("chain", 3)])
def test_greedy_with_run_ahead_equals_generate(pair, method, budget):
    target, _ = pair
    engine, drafter = engine_for(pair, TreeConfig(method=method, budget=budget))
    prompts = [engine.encode_chat(p) for p in ("Tell me a story about a fox.", "List three rivers.")]
    for prompt in prompts:
        result = engine.generate([GenerationRequest(prompt, max_new_tokens=24)])[0]
        assert result.token_ids == greedy(target.model, prompt, 24)[:len(result.token_ids)]
    assert drafter.run_ahead.hits > 0
    assert not drafter.run_ahead.trees  # released sessions leave nothing behind


def test_a_hybrid_methods_hits_carry_copies(pair):
    """c2t+lookup: the trees drafted ahead mix in the lookup's copies after the guessed tokens, as drafted steps'
    trees do (a hit's tree is not the model's part alone), and the output is still the target's greedy output."""
    target, _ = pair
    engine, drafter = engine_for(pair, TreeConfig(method="c2t+lookup", budget=8))
    hits = []
    for text in ("Repeat: the cat sat on the mat. The cat sat on the mat.", "Count: one two three one two three"):
        prompt = engine.encode_chat(text)
        result = engine.generate([GenerationRequest(prompt, max_new_tokens=48)])[0]
        assert result.token_ids == greedy(target.model, prompt, 48)[:len(result.token_ids)]
        hits += [s for s in result.steps if s.run_ahead_hit]
    assert hits and any(s.tree_size_lookup > 0 for s in hits)


def test_a_miss_drafts_as_usual(pair):
    """Every guess wrong (the store's trees replaced by ones for another context): each step is a miss, drafted
    from the real context, and the output is still the target's greedy output."""
    target, _ = pair
    engine, drafter = engine_for(pair, TreeConfig(method="dyspec", budget=6))
    draft_ahead = drafter.draft_ahead

    def wrong_guesses(lane=""):
        draft_ahead(lane)
        for aheads in drafter.run_ahead.trees.values():
            for ahead in aheads:
                ahead.context = ahead.context[:-1] + [(ahead.context[-1] + 1) % target.model.config.vocab_size]
        return True

    drafter.draft_ahead = wrong_guesses
    prompt = engine.encode_chat("Tell me a story about a fox.")
    result = engine.generate([GenerationRequest(prompt, max_new_tokens=24)])[0]
    assert result.token_ids == greedy(target.model, prompt, 24)[:len(result.token_ids)]
    assert drafter.run_ahead.misses > 0 and drafter.run_ahead.hits == 0


def test_a_hit_step_is_credited_to_the_budget_that_drafted_it(pair):
    target, _ = pair
    engine, drafter = engine_for(pair, TreeConfig(method="dyspec", budget=6))
    prompt = engine.encode_chat("Tell me a story about a fox.")
    seq = engine.start(GenerationRequest(prompt, max_new_tokens=40))
    while seq.finish is None and drafter.run_ahead.hits == 0:
        asyncio.run(engine.step([seq]))
    assert drafter.run_ahead.hits == 1
    assert seq.steps[-1].tree_size > 0  # the hit step scored the tree drafted ahead
    asyncio.run(engine.release(seq))


def test_sampled_requests_draft_nothing_ahead_and_follow_the_target(pair):
    """Chi-square of the first two emitted tokens' second one given the first, over seeds, against the target's
    warped distribution: the run-ahead engine at temperature 1 (which drafts nothing ahead)."""
    target, _ = pair
    engine, drafter = engine_for(pair, TreeConfig(method="dyspec", budget=6))
    prompt = engine.encode_chat("Tell me a story about a fox.")
    sampling = SamplingParams(temperature=1.0, top_k=5)
    counts = collections.Counter()
    draws = 240
    for seed in range(draws):
        result = engine.generate([GenerationRequest(prompt, max_new_tokens=3, sampling=sampling, seed=seed)])[0]
        counts[result.token_ids[0]] += 1
    assert drafter.run_ahead.hits == drafter.run_ahead.misses == 0 and not drafter.draft_ahead()
    assert next_token_pvalue(target.model, prompt, counts, sampling) > 1e-3


def test_the_draft_request_of_a_hit_keeps_the_lookup_in_step(pair):
    """A hit skips drafting, but a lookup method's index still takes the emitted tokens (its next copies)."""
    engine, drafter = engine_for(pair, TreeConfig(method="c2t+lookup", budget=8))
    prompt = engine.encode_chat("Repeat: the cat sat on the mat. The cat sat on the mat.")
    seq = engine.start(GenerationRequest(prompt, max_new_tokens=40))
    while seq.finish is None and drafter.run_ahead.hits == 0:
        asyncio.run(engine.step([seq]))
    if drafter.run_ahead.hits:
        session = drafter.lookup_session(seq.session_id)
        assert len(session.index) == len(seq.context) - seq.steps[-1].emitted  # the hit step's whole context
    asyncio.run(engine.release(seq))
    assert drafter.draft([DraftRequest("x", [1, 2, 3], SamplingParams(), TreeConfig(method="dyspec", budget=2),
                                       0)]).trees
