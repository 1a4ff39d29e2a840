"""Fixtures for the parallel drafter: the tiny target of tests/conftest.py and parallel drafters made from it.

The toy language-model pair of tests/engine (toy.py) is importable here too, for the statistical tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from parallel_drafters import make_parallel_drafter  # tests/parallel_drafters.py
from treeserve.engine.models.loading import load_causal_lm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    return load_causal_lm(tiny_target_dir)


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
