"""The shipped default pair: the drafter loads, agrees with the target, and greedy output is the target's."""

import json

import pytest

from treeserve.tools.bench.greedy import greedy_reference
from treeserve.engine.drafters.registry import SHIPPED
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.factory import build_engine
from treeserve.engine.requests import GenerationRequest
from treeserve.engine.dev_prompts import DEV_PROMPTS

DEV = DEV_PROMPTS  # the vendored Spec-Bench dev questions (benchmarks/data)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target():
    return load_causal_lm("default")


@pytest.fixture(scope="module")
def prompts(target):
    rows = [json.loads(line) for line in DEV.read_text().splitlines()][::60][:3]
    return [target.tokenizer.apply_chat_template([{"role": "user", "content": r["turns"][0]}],
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"] for r in rows]


@pytest.fixture(scope="module")
def references(target, prompts):
    """The target's own greedy continuations, computed once for every method."""
    return [greedy_reference(target.model, prompt, 32) for prompt in prompts]


def test_default_drafter_is_shipped_with_a_card():
    assert (SHIPPED["distilled"].directory / "model.safetensors").is_file()
    card = (SHIPPED["distilled"].directory / "README.md").read_text()
    assert "top-1" in card and "treeserve agreement" in card


@pytest.mark.parametrize("method, budget", [("dyspec", 8), ("opt_tree", 8), ("c2t", 8), ("chain", "auto")])
def test_greedy_output_is_the_targets(target, prompts, references, method, budget):
    engine = build_engine(method=method, budget=budget, target=target)
    accepted = 0
    for prompt, (reference, gaps) in zip(prompts, references):
        result = engine.generate([GenerationRequest(prompt, max_new_tokens=32)])[0]
        for i, (want, got) in enumerate(zip(reference, result.token_ids)):
            if want != got:
                assert gaps[i] < 1e-4, f"{method}: diverged at {i} where the target's top-2 gap is {gaps[i]}"
                break
        accepted += sum(s.accepted for s in result.steps)
    assert accepted > 0, "the distilled drafter never had a token accepted"
