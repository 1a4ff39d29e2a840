"""The drafter pipeline on a GPU (`--device cuda`): corpus decoding equals the CPU's, features computed on the
GPU equal the ones captured while generating, an EAGLE-3 head trained there drafts losslessly, and the bench
runs there with its greedy check."""

import json

import pytest
import torch
from safetensors.torch import load_file

from treeserve.cli.main import main
from treeserve.tools.training.corpus import chunk_stats, decode_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def tiny_model(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, attn_implementation="sdpa").eval()


def test_cuda_corpus_decoding_equals_the_cpu(tiny_model):
    prompts = [[1, 5, 9, 200, 17], [3, 4], [88, 12, 400, 7, 7, 7, 31, 2]]
    eos = {7}  # a row hits it early: the batch shrinks on the GPU too
    layers = (1, 2)
    cpu_out, cpu_feats = decode_batch(tiny_model, prompts, 8, [0.0] * 3, eos, 0, feature_layers=layers)
    gpu = tiny_model.to("cuda")
    try:
        gpu_out, gpu_feats = decode_batch(gpu, prompts, 8, [0.0] * 3, eos, 0, feature_layers=layers)
        sampled = decode_batch(gpu, prompts, 8, [0.8] * 3, eos, 0, torch.Generator("cuda").manual_seed(0))
    finally:
        tiny_model.to("cpu")
    assert gpu_out == cpu_out
    for c, g in zip(cpu_feats, gpu_feats):
        assert g.device.type == "cpu" and g.dtype == torch.float16
        torch.testing.assert_close(g.float(), c.float(), atol=2e-2, rtol=1e-2)
    assert all(1 <= len(row) <= 8 for row in sampled)


def test_make_corpus_train_eagle3_and_bench_on_cuda(tiny_target_dir, tmp_path):
    corpus, captured, computed, head = (tmp_path / n for n in ("corpus", "captured", "computed", "head"))
    assert main(["make-corpus", "--target", str(tiny_target_dir), "--out", str(corpus), "--device", "cuda",
                 "--features-dir", str(captured), "--num-conversations", "8", "--chunk-size", "4",
                 "--batch-size", "8", "--max-new-tokens", "16", "--instruction-tokens", "8", "--mix", "stdlib"]) == 0
    chunks = sorted(corpus.glob("chunk-*.safetensors"))
    assert len(chunks) == 2
    stats = chunk_stats(chunks[0])
    assert stats["device"] == torch.cuda.get_device_name() and stats["batch_size"] == 8
    # A fresh features directory: train-eagle3 computes every chunk's features on the GPU first.
    assert main(["train-eagle3", "--target", str(tiny_target_dir), "--corpus", str(corpus), "--features-dir",
                 str(computed), "--device", "cuda", "--draft-vocab-size", "256", "--ttt-steps", "2",
                 "--minutes", "0.05", "--batch-tokens", "256", "--max-seq-len", "64", "--holdout-sequences", "2",
                 "--compute-dtype", "bfloat16", "--out", str(head)]) == 0
    for chunk in chunks:
        torch.testing.assert_close(load_file(str(computed / chunk.name))["features"].float(),
                                   load_file(str(captured / chunk.name))["features"].float(), atol=5e-2, rtol=1e-2)
    card = json.loads((head / "training.json").read_text())
    assert card["device"] == torch.cuda.get_device_name() and card["training"]["steps"] >= 1
    report = tmp_path / "bench.json"
    # The head drafts on the GPU, and every method's tokens must be the target's own greedy decoding.
    assert main(["bench", "--target", str(tiny_target_dir), "--drafter", str(head), "--device", "cuda",
                 "--methods", "autoregressive", "c2t:6", "c2t+lookup:auto", "--num-prompts", "3",
                 "--max-new-tokens", "16", "--warmup-prompts", "1", "--check-greedy", "--no-projection",
                 "--json-out", str(report)]) == 0
    run = json.loads(report.read_text())
    assert run["config"]["device"] == torch.cuda.get_device_name()
    assert not run["greedy_check"]["mismatches"] and len(run["rows"]) == 3
