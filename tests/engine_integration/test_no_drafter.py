"""A target with no drafter (engine/drafters/lookup_only.py): method "lookup" drafts copies from the context with no
drafter model loaded, greedy output equal to `generate`, sampled output following the target; a method that needs
a drafter model is refused in one line naming the setting."""

from __future__ import annotations

import pytest
import torch

from families import pit_pvalue
from treeserve.engine.drafters.lookup_only import LookupDrafter
from treeserve.engine.factory import build_engine
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.requests import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_causal_lm(tiny_target_dir)


@torch.inference_mode()
def reference(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_lookup_without_a_drafter_equals_generate(target, tiny_target_dir):
    engine = build_engine(str(tiny_target_dir), method="lookup", budget=8, target=target)
    assert isinstance(engine.drafter.local, LookupDrafter)
    prompts = [engine.encode_chat("Repeat: the cat sat on the mat, the cat sat on the mat, the cat sat"),
               engine.encode_chat("Count: one two three one two three one two three")]
    alone = [engine.generate([GenerationRequest(p, max_new_tokens=24)])[0] for p in prompts]
    batched = engine.generate([GenerationRequest(p, max_new_tokens=24) for p in prompts])
    for prompt, one, both in zip(prompts, alone, batched):
        assert one.token_ids == both.token_ids == reference(target.model, prompt, len(one.token_ids))
    assert sum(s.accepted for r in alone + batched for s in r.steps) > 0  # copies were accepted


def test_sampled_lookup_without_a_drafter_follows_the_target(target, tiny_target_dir):
    engine = build_engine(str(tiny_target_dir), method="lookup", budget=6, target=target)
    prompt = engine.encode_chat("Repeat after me: red green blue red green blue red green blue red")
    sampling = SamplingParams(temperature=1.0)
    outputs = [engine.generate([GenerationRequest(prompt, 20, sampling=sampling, seed=s, ignore_eos=True)])[0]
               .token_ids for s in range(6)]
    pvalue, tokens = pit_pvalue(target.model, prompt, outputs, sampling)
    assert tokens == 6 * 20 and pvalue > 1e-3


def test_a_model_method_without_a_drafter_is_refused(target, tiny_target_dir):
    with pytest.raises(ValueError, match="drafts with a drafter model"):
        build_engine(str(tiny_target_dir), drafter_path="none", method="c2t+lookup", target=target)
    engine = build_engine(str(tiny_target_dir), drafter_path="none", method="autoregressive", target=target)
    assert engine.drafter is None
