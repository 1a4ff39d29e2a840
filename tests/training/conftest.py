"""The tiny target and an EAGLE-3 head over it with perturbed weights (a trained head is never the identity
its initialisation starts from), shared by the EAGLE-3 training and acceptance tests."""

from __future__ import annotations

import pytest
import torch

from treeserve.engine.drafters.models.eagle3 import Eagle3Drafter


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="module")
def random_eagle3():
    """Factory: an EAGLE-3 head for a model over `draft_vocab` random tokens, weights perturbed, seeded."""
    return _random_eagle3


def _random_eagle3(model, draft_vocab: int) -> Eagle3Drafter:
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(model, torch.randperm(model.config.vocab_size)[:draft_vocab])
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name != "embed_tokens.weight":
                p.add_(torch.randn_like(p) * 0.05)
    return drafter.eval()
