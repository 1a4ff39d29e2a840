"""Fixtures for the tensor-parallel tests: one light Ray instance, a tiny model whose heads divide 2."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest


def _root_conftest():
    # tests/conftest.py by path: a bare `import conftest` may resolve to this file.
    spec = importlib.util.spec_from_file_location("_treeserve_tests_root", Path(__file__).parents[1] / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses there resolve their module's annotations through sys.modules
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


def _default_tp3(dtype):
    import time

    from treeserve.services.tp_target import TensorParallelTarget

    from helpers import RANK_CPUS

    start = time.perf_counter()
    tp = TensorParallelTarget("default", tensor_parallel_size=3, cpus_per_rank=RANK_CPUS, dtype=dtype)
    print(f"\nTP=3 default {dtype} start-up {time.perf_counter() - start:.1f} s, "
          f"per-rank params {[round(i['local_param_bytes'] / 2**20) for i in tp.load_info]} MiB of "
          f"{tp.load_info[0]['full_param_bytes'] / 2**20:.0f} MiB")
    return tp


@pytest.fixture(scope="session")
def default_tp3(ray_cpu, default_model_dir):
    """One float32 TP=3 group over the default target for every test that needs one: each group start loads
    and shards the model on three ranks, the largest cost of this folder."""
    import torch

    tp = _default_tp3(torch.float32)
    yield tp
    tp.shutdown()


@pytest.fixture(scope="session")
def default_tp3_float64(ray_cpu, default_model_dir):
    """The same group in float64, where TP=3 must equal TP=1 up to round-off."""
    import torch

    tp = _default_tp3(torch.float64)
    yield tp
    tp.shutdown()
