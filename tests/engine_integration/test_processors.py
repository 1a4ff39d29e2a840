"""Penalties, biases, min_tokens, ignore_eos and log-probabilities through speculative decoding (engine/processors.py):
applied at every tree node from its own path, the greedy output is Hugging Face `generate`'s with the same logits
processors (transformers' repetition penalty, sequence bias and min-new-tokens; OpenAI's presence / frequency as a
reference processor written here), for a chain, a sampled tree, a deterministic tree with copies and plain
decoding; sampled output follows the processed, warped target distribution (chi-square on the probability
integral transforms); log-probabilities equal a plain forward of the target within 1e-4 at every position."""

from __future__ import annotations

import pytest
import torch
from transformers import (LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                          RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from families import pit_pvalue
from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.processors import apply_processors, apply_to_paths
from treeserve.engine.requests import GenerationRequest, LogitsProcessors, SamplingParams
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.sampling import warp_probs
from treeserve.engine.speculative_engine import SpeculativeEngine
from treeserve.engine.factory import in_process_engine
from treeserve.engine.tree import TokenTree
from treeserve.engine.tree_config import TreeConfig

# One per tree family: plain decoding, a chain, sampled children (DySpec), deterministic top-k trees (EAGLE-2, OPT-Tree),
# copies mixed with the model's (C2T + lookup) and copies alone.
METHODS = [("autoregressive", 0), ("chain", 3), ("dyspec", 6), ("eagle2", 8), ("opt_tree", 8), ("c2t+lookup", 8),
           ("lookup", 6)]


class PresenceFrequency(LogitsProcessor):
    """OpenAI's presence and frequency penalties as a transformers logits processor: the reference the engine's
    per-node penalties are checked against (they count the generated tokens only, as OpenAI and vLLM do)."""

    def __init__(self, prompt_tokens: int, presence: float, frequency: float):
        self.prompt_tokens, self.presence, self.frequency = prompt_tokens, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        output = input_ids[:, self.prompt_tokens:]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def reference(processors: LogitsProcessors, prompt_tokens: int, stop_ids: list[int]) -> LogitsProcessorList:
    """transformers' processors in the engine's order: bias, min_tokens, repetition, frequency / presence."""
    out = LogitsProcessorList()
    if processors.logit_bias:
        out.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in processors.logit_bias]))
    if processors.min_tokens:
        out.append(MinNewTokensLengthLogitsProcessor(prompt_tokens, processors.min_tokens, stop_ids))
    if processors.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(processors.repetition_penalty))
    if processors.presence_penalty or processors.frequency_penalty:
        out.append(PresenceFrequency(prompt_tokens, processors.presence_penalty, processors.frequency_penalty))
    return out


@pytest.fixture(scope="module")
def pair(tiny_target_dir, tiny_drafter_dir):
    return load_causal_lm(tiny_target_dir), load_causal_lm(tiny_drafter_dir).model


def make_engine(pair, method: str, budget: int) -> SpeculativeEngine:
    target, drafter = pair
    local = None if method == "autoregressive" else LocalDrafter(DrafterRunner(drafter, target.model.config.vocab_size))
    return in_process_engine(TargetRunner(target.model), local, target.tokenizer,
                             TreeConfig(method=method, budget=budget or 1), 2048)


def generate(model, prompt: list[int], n: int, processors: LogitsProcessorList, eos: list[int] | None) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, logits_processor=processors,
                             eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_a_node_is_penalised_from_its_own_path(pair):
    """apply_processors on a branching tree equals the reference processors applied to each node's own path."""
    target, _ = pair
    context = [5, 9, 9, 13, 7, 21]
    tree = TokenTree.build([21, 9, 30, 9, 44, 30], [-1, 0, 0, 1, 1, 2])
    processors = LogitsProcessors(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.4,
                                  logit_bias=((30, 2.0), (44, -3.0)), min_tokens=6, prompt_tokens=3, stop_ids=(2, 17))
    logits = torch.randn(tree.num_nodes, 64, generator=torch.Generator().manual_seed(0)) * 3
    got = apply_processors(logits, tree, context, processors)
    ref = reference(processors, 3, [2, 17])
    parents = tree.parent_list
    for node in range(tree.num_nodes):
        path, walk = [], node
        while walk > 0:
            path.insert(0, tree.token_list[walk])
            walk = parents[walk]
        want = ref(torch.tensor([context + path]), logits[node][None].clone())[0]
        assert torch.allclose(got[node], want, atol=1e-6), node
    # the root's row (3 generated + depth 0 < 6) and depth-2 rows (3 + 2 < 6) hold the stop ids back
    assert got[0, 2] == float("-inf") and got[3, 17] == float("-inf")


def processor_sets(eos: int) -> list[LogitsProcessors]:
    """Each changes the greedy output of the tiny target (asserted below); the last makes EOS the argmax everywhere
    but holds it back for 12 tokens (the nodes at depths around the 12th token differ in whether it is held)."""
    return [LogitsProcessors(repetition_penalty=3.0),
            LogitsProcessors(presence_penalty=1.5, frequency_penalty=0.8, logit_bias=((300, 5.0),)),
            LogitsProcessors(frequency_penalty=1.2, repetition_penalty=3.0, logit_bias=((eos, 100.0),), min_tokens=12)]


@pytest.mark.parametrize("method,budget", METHODS)
def test_greedy_with_processors_equals_generate(pair, method, budget):
    target, _ = pair
    engine = make_engine(pair, method, budget)
    prompt = engine.encode_chat("Repeat after me: the cat sat on the mat, the cat sat on the mat.")
    eos = sorted(engine.eos_ids)
    accepted = 0
    plain = generate(target.model, prompt, 32, LogitsProcessorList(), eos)
    for processors in processor_sets(target.tokenizer.eos_token_id):
        result = engine.generate([GenerationRequest(prompt, max_new_tokens=32, processors=processors)])[0]
        expected = generate(target.model, prompt, 32, reference(processors, len(prompt), eos), eos)
        assert result.token_ids == expected and expected != plain, processors
        accepted += sum(s.accepted for s in result.steps)
    if method not in ("autoregressive", "lookup"):  # the lookup copies the prompt's tokens, which the penalties shun
        assert accepted > 0  # tree paths were accepted: the per-node penalties, not only the roots', were used


def test_logit_bias_and_min_tokens_steer_the_output(pair):
    """A large bias makes its token the greedy choice; min_tokens holds the stop tokens back; ignore_eos lets the
    model's EOS pass (the bias forces it at every step, and the sequence runs to its length)."""
    target, _ = pair
    engine = make_engine(pair, "c2t+lookup", 8)
    prompt = engine.encode_chat("Hello")
    eos = target.tokenizer.eos_token_id
    forced = engine.generate([GenerationRequest(prompt, 8, processors=LogitsProcessors(logit_bias=((eos, 100.0),)))])[0]
    assert forced.token_ids == [eos]
    held = engine.generate([GenerationRequest(prompt, 8, processors=LogitsProcessors(logit_bias=((eos, 100.0),),
                                                                                      min_tokens=5))])[0]
    assert len(held.token_ids) == 6 and held.token_ids[-1] == eos and eos not in held.token_ids[:5]
    ignored = engine.generate([GenerationRequest(prompt, 8, ignore_eos=True,
                                                 processors=LogitsProcessors(logit_bias=((eos, 100.0),)))])[0]
    assert ignored.token_ids == [eos] * 8 and ignored.finish_reason.value == "length"


def processed_pit(model, prompt: list[int], outputs: list[list[int]], processors: LogitsProcessors,
                  sampling: SamplingParams, eos: list[int]) -> tuple[float, int]:
    """pit_pvalue of `outputs` under the reference processors: the model wrapped so that its logits at every
    position are the processed ones (position t sees prompt + output[:t], as decoding one token at a time)."""
    ref = reference(processors, len(prompt), eos)

    class Processed(torch.nn.Module):
        def forward(self, ids):
            logits = model(ids).logits[0]
            rows = [ref(ids[:, :t + 1], logits[t][None].clone())[0] for t in range(ids.shape[1])]
            return type("Out", (), {"logits": torch.stack(rows)[None]})()

    return pit_pvalue(Processed(), prompt, outputs, sampling)


@pytest.mark.parametrize("method,budget", [("chain", 3), ("dyspec", 4), ("c2t+lookup", 6)])
def test_sampled_with_processors_follows_the_processed_target(pair, method, budget):
    target, _ = pair
    engine = make_engine(pair, method, budget)
    prompt = engine.encode_chat("Repeat after me: the cat sat on the mat, the cat sat on the mat.")
    # strong enough that the raw target's distribution fails the test (checked when this test was written); the
    # EOS ids biased up but held back by min_tokens for the whole output (the reference holds them back too)
    eos = sorted(engine.eos_ids)
    processors = LogitsProcessors(presence_penalty=2.0, frequency_penalty=1.0, repetition_penalty=2.0,
                                  logit_bias=((300, 4.0), (301, 3.0), (302, 2.0), *((e, 100.0) for e in eos)),
                                  min_tokens=24)
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    outputs, accepted = [], 0
    for seed in range(6):
        result = engine.generate([GenerationRequest(prompt, 24, sampling=sampling, seed=seed,
                                                    processors=processors)])[0]
        outputs.append(result.token_ids)
        accepted += sum(s.accepted for s in result.steps)
    pvalue, tokens = processed_pit(target.model, prompt, outputs, processors, sampling, eos)
    assert tokens == 6 * 24 and accepted > 0
    assert pvalue > 1e-3


@pytest.mark.parametrize("method,budget,sampling", [("dyspec", 6, SamplingParams()),
                                                    ("c2t+lookup", 8, SamplingParams(temperature=0.8, top_k=50)),
                                                    ("autoregressive", 0, SamplingParams(temperature=1.0))])
def test_logprobs_equal_a_plain_forward(pair, method, budget, sampling):
    """Every emitted token's log-probability and its top 5 equal log_softmax of a plain forward of the target over
    prompt + output (raw: before penalties and the warp) within 1e-4, whichever tree node emitted it."""
    target, _ = pair
    engine = make_engine(pair, method, budget)
    prompt = engine.encode_chat("Count: one two three one two three")
    processors = LogitsProcessors(repetition_penalty=1.1)
    for seed in range(2):
        result = engine.generate([GenerationRequest(prompt, 24, sampling=sampling, seed=seed, logprobs=5,
                                                    processors=processors)])[0]
        tokens = result.token_ids
        assert result.logprobs is not None and [lp.token for lp in result.logprobs] == tokens
        with torch.inference_mode():
            logits = target.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        plain = torch.log_softmax(logits.float(), dim=-1)
        for t, lp in enumerate(result.logprobs):
            assert abs(lp.logprob - float(plain[t, tokens[t]])) < 1e-4
            values, ids = plain[t].topk(5)
            assert [i for i, _ in lp.top] == ids.tolist()
            assert max(abs(v - w) for (_, v), w in zip(lp.top, values.tolist())) < 1e-4
    plain_result = engine.generate([GenerationRequest(prompt, 4, sampling=sampling, seed=0)])[0]
    assert plain_result.logprobs is None


def test_processed_logprobs_are_those_of_the_drawn_distribution(pair):
    """processed_logprobs: each token's log-probability under the distribution it was drawn from, the reference
    processors' logits at its position, warped as the request samples (log_softmax of them when greedy)."""

    target, _ = pair
    engine = make_engine(pair, "dyspec", 6)
    prompt = engine.encode_chat("Count: one two three one two three")
    processors = LogitsProcessors(presence_penalty=1.0, repetition_penalty=1.5, logit_bias=((300, 3.0),))
    ref = reference(processors, len(prompt), [])
    for sampling in (SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9)):
        result = engine.generate([GenerationRequest(prompt, 16, sampling=sampling, seed=1, logprobs=3,
                                                    processors=processors, processed_logprobs=True,
                                                    ignore_eos=True)])[0]
        tokens = result.token_ids
        with torch.inference_mode():
            logits = target.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        for t, lp in enumerate(result.logprobs):
            row = ref(torch.tensor([prompt + tokens[:t]]), logits[t][None].clone())[0]
            want = (torch.log_softmax(row, dim=-1) if sampling.is_greedy
                    else torch.log(warp_probs(row[None], sampling)[0]))
            assert abs(lp.logprob - float(want[tokens[t]])) < 1e-4
            values, ids = want.topk(3)
            finite = [i for i, v in zip(ids.tolist(), values.tolist()) if v > float("-inf")]
            assert [i for i, v in lp.top if v > float("-inf")] == finite


@pytest.mark.parametrize("head", [None, 40_000])
def test_the_drafter_drafts_with_the_penalties(pair, head):
    """The drafter's rows get the request's processors too (DraftRequest.processors), each from its own path: a row
    equals the warp of the processed logits of the drafter's plain forward over context + path; a head over part of
    the vocabulary (`head` rows, the rest absent) reads them in its own ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    target, drafter = pair
    vocab = target.model.config.vocab_size
    if head is not None:  # a causal LM whose vocabulary is a prefix of the target's: vocab_ids = arange(head)
        torch.manual_seed(3)
        drafter = LlamaForCausalLM(LlamaConfig(vocab_size=head, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=512)).eval()
    runner = DrafterRunner(drafter, vocab)
    assert (runner.vocab_ids is None) == (head is None)
    context = make_engine(pair, "chain", 4).encode_chat("Count: one two three")
    eos = target.tokenizer.eos_token_id
    processors = LogitsProcessors(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=2.0,
                                  logit_bias=((300, 5.0), (45_000, 3.0), (eos, 2.0)), min_tokens=2,
                                  prompt_tokens=len(context) - 2, stop_ids=(eos, 45_001))
    sampling = SamplingParams(temperature=0.8)
    oracle = runner.begin("s", context, sampling, processors=processors)
    tokens, parents = [context[-1], 300, 301, 302, 300], [-1, 0, 1, 0, 2]
    rows = oracle.probs(tokens, parents, [0, 1, 2, 3, 4])
    for node, path in enumerate([[], [300], [300, 301], [302], [300, 301, 300]]):
        with torch.inference_mode():
            raw = drafter(torch.tensor([context + path])).logits[0, -1].float()
        if head is not None:  # the absent ids at -inf: probability 0, whatever the processors do to them
            raw = torch.cat([raw, torch.full((vocab - head,), float("-inf"))])
        want = warp_probs(apply_to_paths(raw[None], [path], context, processors), sampling)[0]
        assert torch.allclose(rows[node], want, atol=1e-5), node
    runner.release("s")
