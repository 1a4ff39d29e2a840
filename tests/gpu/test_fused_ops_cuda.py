"""The static step with its fused ops compiled on CUDA (engine/runners/fused_ops.py): a lean forward compiled and
captured as a CUDA graph, replayed on new inputs, gives the modules' logits; CachedLM's static step with fused ops
(the default) gives the eager forward's logits and features over trees and batches, and actually compiled them.
In bfloat16 the fused path may round differently from the modules (once instead of after every op), so both are
compared with a float32 forward: the fused one may not be further from it than the modules' one (plus a margin)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from step_plans import plan_steps, run_plan  # tests/step_plans.py
from tiny_models import tiny_llama  # tests/tiny_models.py
from treeserve.engine.runners.cached_lm import CachedLM
from treeserve.engine.runners.lean_decoder import StepBuffers, decoder_parts, lean_forward
from treeserve.engine.runners.static_step import CudaGraphs
from treeserve.engine.runners.step_settings import StaticStepSettings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SETTINGS = StaticStepSettings(batch_buckets=(1, 2, 4), token_buckets=(1, 4, 8, 16), context_tokens=128)
VOCAB = 300
DEVICE = torch.device("cuda")


def tiny_varied_llama() -> LlamaForCausalLM:
    return tiny_llama(VOCAB, hidden=128, intermediate=256, layers=3, varied_norms=True)


def tiny_qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         use_sliding_window=False, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    return model


def close_enough(got: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: equal to rounding; half precision: no further from the float32 `truth` than `ref` is."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
        return
    err_got = (got.float() - truth.float()).abs().max().item()
    err_ref = (ref.float() - truth.float()).abs().max().item()
    assert err_got <= 1.5 * err_ref + 2e-2, (err_got, err_ref)


def causal_inputs(model, head_dim: int, batch: int, width: int, slots: int, dtype: torch.dtype):
    kv_heads = model.config.num_key_value_heads
    keys = [torch.zeros(batch, kv_heads, slots, head_dim, dtype=dtype, device=DEVICE)
            for _ in range(model.config.num_hidden_layers)]
    values = [torch.zeros_like(k) for k in keys]
    positions = torch.arange(width, device=DEVICE).repeat(batch, 1)
    allowed = torch.zeros(width, slots, dtype=torch.bool, device=DEVICE)
    allowed[:, :width] = torch.ones(width, width, dtype=torch.bool, device=DEVICE).tril()
    mask = torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[None, None].expand(batch, 1, -1, -1)
    rows = torch.arange(batch, device=DEVICE)
    inputs = StepBuffers(torch.zeros(batch, width, dtype=torch.long, device=DEVICE), positions, mask.contiguous(),
                         rows[:, None].expand(-1, width).contiguous(), positions.clone(), rows)
    return keys, values, inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_fn", [tiny_varied_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_a_compiled_forward_captured_as_a_graph_equals_the_modules(model_fn, dtype):
    """Compiled during the capture's warm-up runs (as the static step captures), replayed on new token ids."""
    reference = model_fn().to(DEVICE)
    model = model_fn().to(DEVICE, dtype)
    fused = decoder_parts(model, 64, DEVICE, dtype, fused_ops=True)
    plain = decoder_parts(model, 64, DEVICE, dtype)
    truth_parts = decoder_parts(reference, 64, DEVICE, torch.float32)
    assert fused.ops is not None and fused.fused_mlp and plain.ops is None
    keys, values, inputs = causal_inputs(model, fused.head_dim, 2, 6, 8, dtype)
    ref_keys, ref_values, _ = causal_inputs(model, fused.head_dim, 2, 6, 8, dtype)
    truth_keys, truth_values, truth_inputs = causal_inputs(reference, fused.head_dim, 2, 6, 8, torch.float32)
    layers = (0, 2, 3)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    with torch.inference_mode():
        captured = CudaGraphs(DEVICE).capture(lambda: lean_forward(fused, keys, values, inputs, 0, layers, True))
        for _ in range(3):
            inputs.input_ids.copy_(torch.randint(0, VOCAB, inputs.input_ids.shape, generator=generator,
                                                 device=DEVICE))
            truth_inputs.input_ids.copy_(inputs.input_ids)
            captured.replay()
            ref_logits, ref_hidden = lean_forward(plain, ref_keys, ref_values, inputs, 0, layers, True)
            truth_logits, truth_hidden = lean_forward(truth_parts, truth_keys, truth_values, truth_inputs, 0, layers,
                                                      True)
            close_enough(captured.logits, ref_logits, truth_logits, dtype)
            close_enough(captured.hidden, ref_hidden, truth_hidden, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_fn", [tiny_varied_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_the_fused_static_step_equals_eager(model_fn, dtype):
    reference = model_fn().to(DEVICE)
    model = model_fn().to(DEVICE, dtype)
    truth = CachedLM(reference, "cuda", torch.float32, attention="sdpa")
    eager = CachedLM(model, "cuda", dtype, attention="sdpa")
    plain = CachedLM(model, "cuda", dtype, static=dataclasses.replace(SETTINGS, fused_ops=False))
    torch._dynamo.reset()
    compiled_before = counters["stats"]["unique_graphs"]
    fused = CachedLM(model, "cuda", dtype, static=SETTINGS)
    for lm in (truth, eager, plain, fused):
        lm.feature_layers = (1, 2, 3)
    plan = list(plan_steps(0, [9, 40, 3], [6, 1, 12], VOCAB))
    for truth_step, eager_step, plain_step, fused_step in zip(run_plan(truth, plan, True), run_plan(eager, plan, True),
                                                              run_plan(plain, plan, True), run_plan(fused, plan, True)):
        for t, e, p, f in zip(truth_step, eager_step, plain_step, fused_step):
            close_enough(f.logits, e.logits, t.logits, dtype)
            close_enough(f.hidden, e.hidden, t.hidden, dtype)
            close_enough(p.logits, e.logits, t.logits, dtype)
    assert fused.static_step.graphs, "no bucket was captured"
    assert counters["stats"]["unique_graphs"] > compiled_before, "the static step compiled no fused op"
