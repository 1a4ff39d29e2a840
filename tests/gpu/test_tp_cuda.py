"""The tensor-parallel target on the NCCL path: TP=2 over two GPUs equals TP=1 on one GPU.

Same checks as tests/tp/test_tp_target.py (raw logits of a batch of different trees over different prefix
lengths, before and after KV compaction; greedy generation on 10 dev prompts; a killed rank fails health),
with device="cuda" (so backend "nccl" and one GPU per rank actor, from the placement group's bundles).
"""

import importlib.util
import time
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for TP=2 over NCCL"),
]

TOL = 1e-4


def _helpers():
    spec = importlib.util.spec_from_file_location("_tp_helpers", Path(__file__).parents[1] / "tp" / "helpers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ray_gpu():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}})
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def cuda_tp2(ray_gpu, tiny_target_dir):
    from treeserve.services.tp_target import TensorParallelTarget

    # Matmuls in true fp32 on both sides: TF32 would dominate the comparison.
    torch.backends.cuda.matmul.allow_tf32 = False
    tp = TensorParallelTarget(tiny_target_dir, tensor_parallel_size=2, device="cuda", dtype="float32",
                              cpus_per_rank=0.5)
    assert tp.backend == "nccl"
    yield tp
    tp.shutdown()


def test_cuda_tp2_logits_match_tp1(cuda_tp2, tiny_target_dir):
    from treeserve.engine.models.loading import load_causal_lm
    from treeserve.engine.runners.target import TargetRunner

    h = _helpers()
    ref = TargetRunner(load_causal_lm(tiny_target_dir, "cuda").model, "cuda")
    vocab = ref.vocab_size
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    step1 = h.tree_batch(0, contexts, vocab, 11)
    d1 = h.max_diff(cuda_tp2.score_logits(step1), [x.cpu() for x in h.reference_logits(ref, step1)])
    step2 = h.next_step(step1, vocab, 11)
    d2 = h.max_diff(cuda_tp2.score_logits(step2), [x.cpu() for x in h.reference_logits(ref, step2)])
    print(f"\nNCCL TP=2: max|diff| before compaction {d1:.2e}, after {d2:.2e}")
    assert d1 < TOL and d2 < TOL


def test_cuda_tp2_greedy_equals_tp1(cuda_tp2, tiny_target_dir):
    from treeserve.engine.models.loading import load_causal_lm
    from treeserve.engine.runners.target import TargetRunner

    h = _helpers()
    loaded = load_causal_lm(tiny_target_dir, "cuda")
    prompts = h.dev_prompts(loaded.tokenizer, 10)
    assert h.greedy(cuda_tp2, prompts, 24) == h.greedy(TargetRunner(loaded.model, "cuda"), prompts, 24)


def test_cuda_killed_rank_fails_health(cuda_tp2):
    import ray

    from treeserve.services.tp_target import TPGroupError

    cuda_tp2.health()
    ray.kill(cuda_tp2.actors[1], no_restart=True)
    with pytest.raises(TPGroupError, match="rank 1"):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            cuda_tp2.health()
            time.sleep(0.2)
