"""TP=2 (gloo, Ray actors) scores trees exactly like TP=1; dead ranks fail health checks.

Logits are compared raw for a batch of different trees over different prefix lengths, before and after KV
compaction: max |diff| < 1e-4 on the tiny model. On the default target (TP=3: 9 heads, 3 KV heads) 30 layers of
row-parallel partial sums reorder fp32 additions, and logits reach |37|: measured max |diff| ~1e-4 (2.8e-6 of
the logit scale), so there the bound is relative, 1e-5 x max|logit|, plus exact argmax and greedy equality on
10 Spec-Bench dev prompts.
"""

import time

import pytest
import torch

from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.runners.target import TargetRunner
from treeserve.services.tp_target import TensorParallelTarget, TPGroupError

from helpers import dev_prompts, greedy, max_diff, next_step, reference_logits, tree_batch, RANK_CPUS

TOL = 1e-4


def _check_tree_steps(tp, ref, contexts, vocab, seed, report, rel_tol=None):
    step1 = tree_batch(0, contexts, vocab, seed)
    want1 = reference_logits(ref, step1)
    d1 = max_diff(tp.score_logits(step1), want1)
    step2 = next_step(step1, vocab, seed)  # carries accepted nodes: both sides compact their caches
    want2 = reference_logits(ref, step2)
    d2 = max_diff(tp.score_logits(step2), want2)
    scale = max(float(x.abs().max()) for x in want1 + want2)
    report(f"max|diff| before compaction {d1:.2e}, after {d2:.2e} (max|logit| {scale:.1f})")
    tol = TOL if rel_tol is None else rel_tol * scale
    assert d1 < tol and d2 < tol
    # Same result through the public score() (argmax and warped probabilities).
    step3 = next_step(step2, vocab, seed + 1)
    ref_dists = ref.score(step3)
    tp_dists = tp.score(step3)
    for a, b in zip(tp_dists, ref_dists):
        assert torch.equal(a.argmax, b.argmax)
    return step3


@pytest.fixture(scope="module")
def tiny_tp2(ray_cpu, tiny_tp_dir):
    start = time.perf_counter()
    tp = TensorParallelTarget(tiny_tp_dir, tensor_parallel_size=2, device="cpu", dtype="float32",
                              cpus_per_rank=RANK_CPUS)
    print(f"\nTP=2 tiny start-up {time.perf_counter() - start:.1f} s: {tp.load_info}")
    yield tp
    tp.shutdown()


def test_tiny_tp2_matches_tp1(tiny_tp2, tiny_tp_dir, capsys):
    import ray

    assert all(info["mode"] == "sharded" for info in tiny_tp2.load_info)
    assert all(info["local_param_bytes"] < info["full_param_bytes"] for info in tiny_tp2.load_info)
    ref = TargetRunner(load_causal_lm(tiny_tp_dir).model)
    vocab = ref.vocab_size
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    _check_tree_steps(tiny_tp2, ref, contexts, vocab, seed=11, report=lambda m: print("\ntiny TP=2:", m))
    # KV cache sharded by head: 2 KV heads -> 1 per rank.
    assert ray.get([a.kv_heads.remote("s0") for a in tiny_tp2.actors]) == [1, 1]
    assert tiny_tp2.release("s0") and not tiny_tp2.release("s0")


def test_tiny_tp2_greedy_equals_tp1(tiny_tp2, tiny_tp_dir):
    loaded = load_causal_lm(tiny_tp_dir)
    prompts = dev_prompts(loaded.tokenizer, 10)
    ref = greedy(TargetRunner(loaded.model), prompts, 24)
    assert greedy(tiny_tp2, prompts, 24) == ref


def test_bad_request_raises_and_group_stays_usable(tiny_tp2):
    from treeserve.engine.runners.target import ScoreRequest
    from treeserve.engine.requests import SamplingParams
    from treeserve.engine.tree import TokenTree

    bad = ScoreRequest("bad", [5, 6, 7], TokenTree.build([8], [-1]), SamplingParams())  # root != context[-1]
    with pytest.raises(ValueError, match="is not the last context token"):
        tiny_tp2.score([bad])
    tiny_tp2.health()
    good = ScoreRequest("ok", [5, 6, 7], TokenTree.build([7], [-1]), SamplingParams())
    assert tiny_tp2.score([good])[0].argmax.shape == (1,)


def test_killed_rank_fails_health(ray_cpu, tiny_tp_dir):
    import ray

    # This group loads the full model and shards it with apply_tp (the fallback path), so it also checks
    # the plan applied to an already-built model.
    tp = TensorParallelTarget(tiny_tp_dir, tensor_parallel_size=2, cpus_per_rank=RANK_CPUS, load_from_slices=False)
    try:
        assert [info["mode"] for info in tp.load_info] == ["full_then_shard"] * 2
        ref = TargetRunner(load_causal_lm(tiny_tp_dir).model)
        step = tree_batch(0, [[1, 2, 3, 4, 5, 6], [7, 8, 9]], ref.vocab_size, seed=2)
        assert max_diff(tp.score_logits(step), reference_logits(ref, step)) < TOL
        tp.health()
        ray.kill(tp.actors[1], no_restart=True)
        with pytest.raises(TPGroupError, match="rank 1"):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the kill is asynchronous
                tp.health()
                time.sleep(0.2)
        with pytest.raises(TPGroupError):
            tp.score([])
    finally:
        tp.shutdown()
    with pytest.raises(TPGroupError):
        tp.health()


@pytest.mark.slow
def test_default_target_tp3(default_tp3, default_model_dir):
    loaded = load_causal_lm(default_model_dir)
    ref = TargetRunner(loaded.model)
    prompts = dev_prompts(loaded.tokenizer, 10)
    _check_tree_steps(default_tp3, ref, [prompts[0], prompts[3][:40], prompts[5][:23]], ref.vocab_size, seed=5,
                      report=lambda m: print("default TP=3:", m), rel_tol=1e-5)
    assert greedy(default_tp3, prompts, 24) == greedy(ref, prompts, 24)


@pytest.mark.slow
def test_default_target_tp3_float64(default_tp3_float64, default_model_dir):
    """In float32 the split sums round differently at the ~1e-4 level on 37-unit logits; in float64 the same
    code must give TP=3 logits equal to TP=1 within the absolute 1e-4 of the issue (round-off, not logic)."""
    loaded = load_causal_lm(default_model_dir, dtype=torch.float64)
    ref64 = TargetRunner(loaded.model, dtype=torch.float64)
    prompts = dev_prompts(loaded.tokenizer, 4)
    _check_tree_steps(default_tp3_float64, ref64, [prompts[0], prompts[3][:40]], ref64.vocab_size, seed=7,
                      report=lambda m: print("default TP=3 float64:", m))
