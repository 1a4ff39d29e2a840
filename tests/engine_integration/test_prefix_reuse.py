"""Prefix reuse changes no output (docs/design.md section 10): a conversation's second turn and requests sharing
a system prompt start from cached KV pages on the target and the drafter, and decode exactly what the target's
own greedy decoding gives, for every tree method (hybrid copies included), alone and batched; sampled output
with the cache on follows the target distribution (chi-square on the probability integral transforms)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from families import pit_pvalue
from step_plans import decode_beside  # tests/step_plans.py
from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.kv_settings import KVSettings
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.requests import GenerationRequest, SamplingParams
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.speculative_engine import SpeculativeEngine
from treeserve.engine.factory import in_process_engine
from treeserve.engine.tree_config import TreeConfig, tree_config

METHODS = [TreeConfig(method="autoregressive"), TreeConfig(method="chain", depth=4),
           TreeConfig(method="static", static_tree="mc_sim_7b_63"), TreeConfig(method="eagle2", budget=16, depth=4,
                                                                                  top_k=4),
           TreeConfig(method="dyspec", budget=12), TreeConfig(method="opt_tree", budget=12, delta=0.1),
           TreeConfig(method="c2t", budget=16, depth=4, top_k=4), tree_config("c2t+lookup", 12)]
PAGES = KVSettings(page_size=8)  # small pages: prompts of a few dozen tokens span several


@pytest.fixture(scope="module")
def pair(tiny_target_dir, tiny_drafter_dir):
    return load_causal_lm(tiny_target_dir), load_causal_lm(tiny_drafter_dir).model


def make_engine(pair, tree: TreeConfig, prefix_caching: bool) -> SpeculativeEngine:
    target, drafter = pair
    kv = KVSettings(PAGES.page_size, prefix_caching=prefix_caching)
    runner = TargetRunner(target.model)
    runner.lm.bound(256, kv=kv)
    local = None
    if tree.method != "autoregressive":
        local = LocalDrafter(DrafterRunner(drafter, target.model.config.vocab_size))
        local.lm.bound(256, kv=kv)
    return in_process_engine(runner, local, target.tokenizer, tree, max_context_tokens=2048)


@torch.inference_mode()
def reference(model, prompt_ids: list[int], n: int) -> list[int]:
    out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


def turns(engine: SpeculativeEngine) -> list[int]:
    """A first turn with a system prompt long enough to fill several pages."""
    system = "You are a careful assistant who answers in full sentences about animals and the weather."
    return engine.encode_chat([{"role": "system", "content": system},
                               {"role": "user", "content": "Tell me a story about a fox."}])


def follow_up(engine: SpeculativeEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(f"\nUser: {text}\nAssistant:", add_special_tokens=False)


@pytest.mark.parametrize("tree", METHODS, ids=lambda t: t.method)
def test_cache_on_and_off_decode_the_targets_greedy_output(pair, tree):
    target = pair[0].model
    outputs = {}
    for caching in (True, False):
        engine = make_engine(pair, tree, caching)
        first = turns(engine)
        answer = engine.generate([GenerationRequest(first, max_new_tokens=12)])[0]
        history = first + answer.token_ids
        seconds = [history + follow_up(engine, text) for text in ("Now shorter.", "Why a fox?")]
        alone = [engine.generate([GenerationRequest(p, max_new_tokens=10)])[0] for p in seconds]
        together = engine.generate([GenerationRequest(p, max_new_tokens=10) for p in seconds])
        outputs[caching] = [answer.token_ids] + [r.token_ids for r in alone + together]
        cached = [r.cached_tokens for r in alone + together]
        if caching:  # the first turn's full pages, then the second turns' own too
            assert all(c >= PAGES.page_size * (len(first) // PAGES.page_size) for c in cached), cached
        else:
            assert cached == [0, 0, 0, 0]
        for prompt, result in zip([first] + seconds + seconds, [answer] + alone + together):
            expected = reference(target, prompt, len(result.token_ids))
            assert result.token_ids == expected
    assert outputs[True] == outputs[False]


def test_sampled_output_with_a_cached_prefix_follows_the_target(pair):
    engine = make_engine(pair, tree_config("c2t+lookup", 8), True)
    prompt = engine.encode_chat("Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat sat.")
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    engine.generate([GenerationRequest(prompt, 4, sampling=sampling, seed=99)])  # caches the prompt's pages
    outputs, cached = [], 0
    for seed in range(6):
        result = engine.generate([GenerationRequest(prompt, 24, sampling=sampling, seed=seed, ignore_eos=True)])[0]
        outputs.append(result.token_ids)
        cached += result.cached_tokens
    assert cached >= 6 * PAGES.page_size * ((len(prompt) - 1) // PAGES.page_size)
    pvalue, tokens = pit_pvalue(pair[0].model, prompt, outputs, sampling)
    assert tokens == 6 * 24
    assert pvalue > 1e-3


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95)],
                         ids=["greedy", "sampled"])
def test_a_prompt_fed_in_chunks_beside_a_decoding_sequence_changes_no_output(pair, sampling):
    """Chunked prefill: while another sequence decodes, a long prompt is fed 16 tokens a step; both outputs are
    those of each request decoded alone (a seed gives the same sample however the prompt was fed)."""
    engine = make_engine(pair, tree_config("c2t+lookup", 8), prefix_caching=False)
    engine.prefill_chunk_tokens = 16
    short = GenerationRequest(turns(engine), max_new_tokens=48, sampling=sampling, seed=5)
    long_prompt = turns(engine) + follow_up(engine, "Tell me more about the fox and the river, in detail.") * 3
    long = GenerationRequest(long_prompt, max_new_tokens=10, sampling=sampling, seed=6)
    alone = [engine.generate([r])[0].token_ids for r in (short, long)]
    running, arriving = engine.start(short), engine.start(long)
    assert decode_beside(engine, running, arriving) >= len(long_prompt) // 16 - 1
    assert [engine.result(running).token_ids, engine.result(arriving).token_ids] == alone
    if sampling.is_greedy:
        assert alone[1] == reference(pair[0].model, long_prompt, len(alone[1]))
    asyncio.run(engine.release(running)), asyncio.run(engine.release(arriving))
