"""The lean decoder's fused ops (engine/runners/fused_ops.py) on a CPU: each function computes what transformers'
module computes (LlamaRMSNorm, Qwen3's per-head q/k norms, apply_rotary_pos_emb, LlamaMLP), eagerly (bit for bit)
and compiled with torch.compile (inductor, as on CUDA; to rounding), in float32 and bfloat16; compiled over every
bucket shape of a static step they make a handful of graphs (no recompile-limit fallback); and `lean_forward` with
the fused path forced on gives the modules' path's logits and features (Llama, Qwen3, a non-SiLU MLP, packed CPU
linears). The compiled static step on CUDA is tests/gpu/test_fused_ops_cuda.py."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from tiny_models import tiny_llama  # tests/tiny_models.py
from treeserve.engine.models.packed_linear import use_fast_cpu_linears
from treeserve.engine.runners.fused_ops import DecoderOps, compiled_ops
from treeserve.engine.runners.lean_decoder import StepBuffers, decoder_parts, lean_forward
from treeserve.engine.runners.step_settings import StaticStepSettings, default_static_step

EAGER = DecoderOps()
# Inductor compiles these functions on this CPU in well under a minute (C++ kernels), so the tests compile with
# the backend CUDA uses; "aot_eager" would test the tracing alone.
BACKEND = "inductor"
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5),
             # compiled, a bf16 chain is kept in float32 and rounded once where eager rounds every op (the q/k
             # norms' outputs, up to ~4, before the rotation): two bf16 roundings at that scale
             torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2)}


@pytest.fixture(scope="module")
def compiled():
    torch._dynamo.reset()
    yield compiled_ops(BACKEND)
    torch._dynamo.reset()


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float32).to(dtype)


def check(got, ref, dtype, exact):
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if exact:
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got, ref, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_fused_functions_equal_the_transformers_modules(mode, dtype, request):
    ops = EAGER if mode == "eager" else request.getfixturevalue("compiled")
    exact = mode == "eager"
    torch.manual_seed(0)
    batch, width, hidden, heads, kv_heads, head_dim = 3, 5, 64, 4, 2, 16
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    q_norm, k_norm = Qwen3RMSNorm(head_dim, eps=1e-6).to(dtype), Qwen3RMSNorm(head_dim, eps=1e-6).to(dtype)
    mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=96, hidden_act="silu")).to(dtype)
    with torch.no_grad():
        for module in (norm, q_norm, k_norm):
            module.weight.normal_(1.0, 0.5)
    with torch.inference_mode():
        x = randn(batch, width, hidden, dtype=dtype) * 3
        check(ops.norm(norm, x), norm(x), dtype, exact)
        check(ops.mlp(mlp, x), mlp(x), dtype, exact)
        query = randn(batch, width, heads, head_dim, dtype=dtype)
        key = randn(batch, width, kv_heads, head_dim, dtype=dtype)
        angles = torch.rand(batch, width, head_dim // 2) * 6
        cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
        sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
        # transformers rotates [B, H, W, D] with cos [B, W, D] unsqueezed at dim 1; the lean decoder rotates
        # before the heads move to dim 1
        ref_q, ref_k = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        got_q, got_k = ops.rotate(query, key, cos, sin)
        check(got_q.transpose(1, 2), ref_q, dtype, exact)
        check(got_k.transpose(1, 2), ref_k, dtype, exact)
        ref_q, ref_k = apply_rotary_pos_emb(q_norm(query).transpose(1, 2), k_norm(key).transpose(1, 2), cos, sin)
        got_q, got_k = ops.rotate(query, key, cos, sin, q_norm, k_norm)
        check(got_q.transpose(1, 2), ref_q, dtype, exact)
        check(got_k.transpose(1, 2), ref_k, dtype, exact)


@pytest.mark.parametrize("largest_first", [True, False])
def test_every_bucket_shape_compiles_a_handful_of_graphs(largest_first):
    """dynamic=True over flattened inputs: one graph for every token count but 1 (dynamo specialises a size of
    1), so all (rows, tokens) buckets need two graphs per function, SiLU-and-multiply one (its 1-D input never has
    a size of 1), whichever bucket comes first. fullgraph=True would raise at the recompile limit, never fall
    back to eager silently."""
    torch._dynamo.reset()
    counter = CompileCounter()
    ops = compiled_ops(counter)
    settings = StaticStepSettings()
    shapes = sorted(((b, w) for b in settings.batch_buckets for w in settings.token_buckets
                     if b * w <= settings.max_graph_tokens), key=lambda bw: bw[0] * bw[1], reverse=largest_first)
    norm = LlamaRMSNorm(64, eps=1e-5)
    mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=96, hidden_act="silu"))
    with torch.inference_mode():
        for batch, width in shapes:
            x = torch.randn(batch, width, 64)
            ops.norm(norm, x)
            ops.mlp(mlp, x)
            cos = torch.randn(batch, width, 16)
            ops.rotate(torch.randn(batch, width, 4, 16), torch.randn(batch, width, 2, 16), cos, cos)
    torch._dynamo.reset()
    assert counter.frame_count == 5, counter.frame_count  # rms_norm 2, rotary 2, silu_mul 1


def tiny_varied_llama(**extra) -> LlamaForCausalLM:
    return tiny_llama(max_positions=256, varied_norms=True, **extra)


def tiny_qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         use_sliding_window=False, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    return model


def causal_step(parts, model, batch: int, width: int, slots: int):
    """An empty pool of `batch` pages (one per row) and a causal prefill of `width` tokens per row: (pool keys, values, inputs)."""
    config = model.config
    kv_heads = config.num_key_value_heads
    keys = [torch.zeros(kv_heads, batch, slots, parts.head_dim) for _ in parts.layers]
    values = [torch.zeros_like(k) for k in keys]
    ids = torch.randint(0, config.vocab_size, (batch, width), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(width).repeat(batch, 1)
    allowed = torch.zeros(width, slots, dtype=torch.bool)
    allowed[:, :width] = torch.ones(width, width, dtype=torch.bool).tril()
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None].expand(batch, 1, -1, -1)
    rows = torch.arange(batch)
    inputs = StepBuffers(ids, positions, mask.contiguous(), rows[:, None].expand(-1, width).contiguous(),
                         positions.clone(), rows[:, None])  # one page of `slots` per row
    return keys, values, inputs


@pytest.mark.parametrize("model_fn", [tiny_varied_llama, tiny_qwen3, lambda: tiny_varied_llama(hidden_act="gelu"),
                                      lambda: use_fast_cpu_linears(tiny_varied_llama())],
                         ids=["llama", "qwen3", "gelu-mlp", "packed-linears"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_lean_forward_with_fused_ops_equals_the_modules(model_fn, mode, request):
    model = model_fn()
    ops = EAGER if mode == "eager" else request.getfixturevalue("compiled")
    plain = decoder_parts(model, 64, torch.device("cpu"), torch.float32)
    fused = decoder_parts(model, 64, torch.device("cpu"), torch.float32, ops=ops)
    assert plain.ops is None and fused.ops is ops
    assert fused.fused_mlp == (model.config.hidden_act == "silu")
    layers = (0, 1, 2)
    with torch.inference_mode():
        keys, values, inputs = causal_step(plain, model, batch=2, width=6, slots=8)
        ref_logits, ref_hidden = lean_forward(plain, keys, values, inputs, 0, layers, True)
        got_keys, got_values, inputs = causal_step(fused, model, batch=2, width=6, slots=8)
        got_logits, got_hidden = lean_forward(fused, got_keys, got_values, inputs, 0, layers, True)
        own = model(input_ids=inputs.input_ids).logits
    torch.testing.assert_close(ref_logits, own, atol=1e-4, rtol=1e-4)  # the modules' path is the model's forward
    torch.testing.assert_close(got_logits, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_hidden, ref_hidden, atol=1e-4, rtol=1e-4)
    for got, ref in zip(got_keys + got_values, keys + values):  # the same keys (rotated) and values in the pool
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_fused_ops_only_on_cuda_or_when_forced():
    model = tiny_varied_llama()
    assert decoder_parts(model, 16, torch.device("cpu"), torch.float32, fused_ops=True).ops is None
    model.model.layers[1].post_attention_layernorm = torch.nn.LayerNorm(64)  # not an RMSNorm: keep the modules
    assert decoder_parts(model, 16, torch.device("cpu"), torch.float32, ops=EAGER).ops is None


def test_the_setting_defaults_on_and_turns_off():
    assert StaticStepSettings().fused_ops and default_static_step("cuda").fused_ops
    assert not default_static_step("cuda", fused_ops=False).fused_ops
