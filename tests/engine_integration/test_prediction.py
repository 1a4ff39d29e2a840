"""Predicted outputs (OpenAI's `prediction`) never change the output: greedy equal to the target's own decoding
with a right, an edited and a wrong prediction, for the default hybrid (auto budgets) and lookup without a
drafter, on the real model (the tiny random one answers one token over and over, which anything predicts);
a right prediction is drafted from in long runs; sampled output follows the target."""

from __future__ import annotations

import pytest

from families import pit_pvalue
from treeserve.tools.bench.greedy import greedy_reference
from treeserve.engine.factory import build_engine
from treeserve.engine.models.loading import chat_ids, load_causal_lm
from treeserve.engine.requests import GenerationRequest, SamplingParams

CODE = '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def spread(values):
    low = min(values)
    high = max(values)
    return high - low
'''
PROMPT = f"Rename `values` to `numbers` everywhere in this code. Reply with the code only.\n\n```python\n{CODE}```"
N = 32


@pytest.fixture(scope="module")
def target():
    return load_causal_lm("default")


@pytest.fixture(scope="module")
def expected(target):
    """(chat prompt ids, the target's own greedy N tokens, top-2 logit gaps)."""
    prompt = chat_ids(target.tokenizer, PROMPT)
    return (prompt, *greedy_reference(target.model, prompt, N))


def predictions(tokenizer, reference: list[int]) -> dict[str, tuple[int, ...]]:
    return {"right": tuple(reference),
            "edited": tuple(reference[:10] + tokenizer.encode(" items", add_special_tokens=False) + reference[12:]),
            "file": tuple(tokenizer.encode(CODE, add_special_tokens=False)),  # what a client would send
            "wrong": tuple(tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4,
                                            add_special_tokens=False))}


def check(result, reference: list[int], gaps: list[float]) -> None:
    """The target's greedy output (a near-tie, top-2 logits within 1e-4, may go either way in float32)."""
    for i, (want, got) in enumerate(zip(reference, result.token_ids)):
        if want != got:
            assert gaps[i] < 1e-4, f"diverged at {i} where the target's top-2 gap is {gaps[i]}"
            return
    assert len(result.token_ids) == len(reference)


@pytest.mark.slow
def test_greedy_output_is_the_targets_whatever_the_prediction(target, expected):
    prompt, reference, gaps = expected
    engine = build_engine(target=target)  # the default hybrid, auto budgets
    for name, prediction in predictions(target.tokenizer, reference).items():
        result = engine.generate([GenerationRequest(prompt, N, prediction=prediction, ignore_eos=True)])[0]
        check(result, reference, gaps)
        accepted = result.accepted_prediction_tokens
        assert accepted + result.rejected_prediction_tokens == len(prediction), name
        if name == "right":
            assert accepted == N


@pytest.mark.slow
def test_lookup_without_a_drafter_drafts_a_right_prediction_in_long_runs(target, expected):
    """A fixed budget of 8 lookup nodes (no chooser): with the answer as the prediction most steps take all 8;
    with the file a client would send, the output is still the target's."""
    prompt, reference, gaps = expected
    engine = build_engine(method="lookup", budget=8, target=target)
    without = engine.generate([GenerationRequest(prompt, N, ignore_eos=True)])[0]
    right = engine.generate([GenerationRequest(prompt, N, prediction=tuple(reference), ignore_eos=True)])[0]
    file = engine.generate([GenerationRequest(prompt, N, ignore_eos=True,
                                              prediction=predictions(target.tokenizer, reference)["file"])])[0]
    for result in (without, right, file):
        check(result, reference, gaps)
    assert right.mean_accepted_length > 5 and right.mean_accepted_length > without.mean_accepted_length + 1


def test_sampled_output_with_a_prediction_follows_the_target(tiny_target_dir):
    tiny = load_causal_lm(tiny_target_dir)
    engine = build_engine(str(tiny_target_dir), method="lookup", budget=6, target=tiny)
    prompt = chat_ids(tiny.tokenizer, "Copy this list: alpha beta gamma delta epsilon")
    sampling = SamplingParams(temperature=1.0)
    first = engine.generate([GenerationRequest(prompt, 20, sampling=sampling, seed=99, ignore_eos=True)])[0]
    prediction = tuple(first.token_ids)  # a sample of the target's own: often right early, then not
    outputs = [engine.generate([GenerationRequest(prompt, 20, sampling=sampling, seed=s, ignore_eos=True,
                                                  prediction=prediction)])[0].token_ids for s in range(6)]
    pvalue, tokens = pit_pvalue(tiny.model, prompt, outputs, sampling)
    assert tokens == 6 * 20 and pvalue > 1e-3
