"""The shipped parallel drafter (slow: loads the real target): card present, greedy output through
parallel drafting is the target's own, and draft tokens are accepted."""

from __future__ import annotations

import json

import pytest

from treeserve.tools.bench.greedy import greedy_reference
from treeserve.engine.drafters.registry import SHIPPED
from treeserve.engine.factory import build_engine
from treeserve.engine.requests import GenerationRequest
from treeserve.engine.dev_prompts import DEV_PROMPTS

DEV = DEV_PROMPTS  # the vendored Spec-Bench dev questions (benchmarks/data)
pytestmark = pytest.mark.slow
shipped = pytest.mark.skipif(not (SHIPPED["parallel"].directory / "model.safetensors").is_file(),
                             reason="no parallel drafter shipped")


@pytest.fixture(scope="module")
def target():
    from treeserve.engine.models.loading import load_causal_lm

    return load_causal_lm("default")


@shipped
def test_card():
    card = (SHIPPED["parallel"].directory / "README.md").read_text()
    assert "treeserve agreement --kind parallel" in card and "position" in card


@shipped
@pytest.mark.parametrize("method, budget", [("opt_tree", 16), ("chain", 4)])
def test_greedy_output_is_the_targets(target, method, budget):
    rows = [json.loads(line) for line in DEV.read_text().splitlines()][::60][:3]
    engine = build_engine(method=method, budget=budget, target=target, drafter_kind="parallel")
    accepted = 0
    for row in rows:
        prompt = engine.encode_chat(row["turns"][0])
        reference, gaps = greedy_reference(target.model, prompt, 32)
        result = engine.generate([GenerationRequest(prompt, max_new_tokens=32)])[0]
        for i, (want, got) in enumerate(zip(reference, result.token_ids)):
            if want != got:
                assert gaps[i] < 1e-4, f"{method}: diverged at {i} where the target's top-2 gap is {gaps[i]}"
                break
        accepted += sum(s.accepted for s in result.steps)
    assert accepted > 0
