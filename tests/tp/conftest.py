"""Fixtures for the tensor-parallel tests: one light Ray instance, a tiny model whose heads divide 2."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


def _root_conftest():
    # tests/conftest.py by path: a bare `import conftest` may resolve to this file.
    spec = importlib.util.spec_from_file_location("_treeserve_tests_root", Path(__file__).parents[1] / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def ray_cpu():
    """A small local Ray shared by the TP tests (start-up costs ~10 s on this box); shut down at the end
    unless someone else started it."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                                       "HF_HUB_OFFLINE": "1",
                                       **({"TREESERVE_CACHE": os.environ["TREESERVE_CACHE"]}
                                          if "TREESERVE_CACHE" in os.environ else {})}})
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def tiny_tp_dir(tmp_path_factory, default_model_dir):
    """4 query heads, 2 KV heads (GQA), MLP width 128: valid for TP=2 (and TP=1)."""
    return _root_conftest().make_tiny_llama(tmp_path_factory.mktemp("tiny_tp"), default_model_dir, seed=3, layers=2, hidden=64,
                           heads=4, kv_heads=2)
