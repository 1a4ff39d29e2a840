"""Grouped-query attention without repeat_kv equals transformers' eager attention."""

import pytest
import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

from treeserve.engine.models.attention import grouped_attention


class _Module(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("q_len,masked", [(1, False), (5, True), (16, True)])
def test_grouped_attention_equals_eager(q_len, masked):
    gen = torch.Generator().manual_seed(q_len)
    batch, kv_heads, groups, length, dim = 3, 2, 3, 21, 8
    query = torch.randn(batch, q_len, kv_heads * groups, dim, generator=gen).transpose(1, 2)  # as the model hands it
    key = torch.randn(batch, kv_heads, length, dim, generator=gen)
    value = torch.randn(batch, kv_heads, length, dim, generator=gen)
    mask = None
    if masked:  # an additive tree-style mask: random allowed sets, each query sees at least itself
        allowed = torch.rand(batch, 1, q_len, length, generator=gen) < 0.5
        allowed[..., torch.arange(q_len), length - q_len + torch.arange(q_len)] = True
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = _Module(groups).eval()
    ours, weights = grouped_attention(module, query, key, value, mask, scaling=dim ** -0.5)
    ref, _ = eager_attention_forward(module, query, key, value, mask, scaling=dim ** -0.5)
    assert weights is None
    assert ours.shape == ref.shape == (batch, q_len, kv_heads * groups, dim)
    assert torch.allclose(ours, ref, atol=1e-6)
