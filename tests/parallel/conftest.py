"""Fixtures for the parallel drafter: the tiny target of tests/conftest.py and parallel drafters made from it.

The toy language-model pair of tests/engine (toy.py) is importable here too, for the statistical tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from treeserve.engine.drafters.models.parallel import ParallelDrafterModel
from treeserve.engine.models.loading import load_causal_lm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    return load_causal_lm(tiny_target_dir)


def make_parallel_drafter(target_model, layers=(0,), vocab_size: int = 4096, num_masks: int = 4, seed: int = 0,
                          noise: float = 0.5):
    """A parallel drafter from the tiny target's layers with a random sub-vocabulary (specials included) and
    randomised [MASK] embeddings, so mask outputs differ from the plain next-token output."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target_model.config.vocab_size
    ids = torch.randperm(vocab, generator=gen)[:vocab_size]
    ids = torch.unique(torch.cat([ids, torch.arange(8)]))
    model = ParallelDrafterModel.from_target(target_model, list(layers), ids, num_masks, seed)
    with torch.no_grad():
        model.mask_embeddings.add_(torch.randn(model.mask_embeddings.shape, generator=gen) * noise)
    return model.eval()


@pytest.fixture(scope="session")
def parallel_drafter(tiny_target):
    return make_parallel_drafter(tiny_target.model)


@pytest.fixture(scope="session")
def parallel_drafter_dir(tmp_path_factory, tiny_target):
    """A saved parallel drafter of the tiny target's own layers, without mask noise: position 1 agrees with the
    target always, the mask positions sometimes."""
    out = tmp_path_factory.mktemp("parallel") / "pd"
    make_parallel_drafter(tiny_target.model, layers=(0, 1), vocab_size=tiny_target.model.config.vocab_size,
                          noise=0.0).save(out)
    return out
