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


@pytest.mark.parametrize("implementation", ["sdpa", "treeserve_grouped"])
def test_tree_logits_equal_eager_under_each_implementation(tiny_target_dir, implementation):
    """The attention chosen per device (SDPA on a GPU, grouped on the CPU) reads the additive tree mask as
    eager does: a batch of different trees over different prefixes, then a step after KV compaction, gives the
    same logits on the tiny model."""
    from treeserve.engine.models.loading import load_causal_lm
    from treeserve.engine.runners.cached_lm import CachedLM, ExtendRequest

    gen = torch.Generator().manual_seed(0)
    contexts = {f"s{i}": torch.randint(3, 1000, (n,), generator=gen).tolist() for i, n in enumerate((6, 19, 11))}
    shapes = [[-1, 0, 0, 1, 1, 2, 4], [-1, 0, 1, 2], [-1, 0, 0, 0]]

    def run(attention: str) -> list[torch.Tensor]:
        lm = CachedLM(load_causal_lm(tiny_target_dir).model, attention=attention)
        g = torch.Generator().manual_seed(1)
        out = []
        for step in range(2):
            requests = []
            for (sid, ctx), parents in zip(contexts.items(), shapes[step:] + shapes[:step]):
                context = ctx if step == 0 else ctx + [int(t) for t in out_tokens[sid][1:3]] + [7]
                lm.begin(sid, context, [1, 3] if step and len(out_tokens[sid]) > 3 else None)
                tokens = [context[-1]] + torch.randint(3, 1000, (len(parents) - 1,), generator=g).tolist()
                requests.append(ExtendRequest(sid, tokens, parents))
            if step == 0:
                out_tokens = {r.session_id: r.tokens for r in requests}
            out += lm.extend(requests)
        return out

    got, want = run(implementation), run("eager")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_attention_is_chosen_per_device():
    from treeserve.engine.models.attention import GROUPED_ATTENTION, attention_for

    assert attention_for("cpu") == GROUPED_ATTENTION
    assert attention_for("cuda") == attention_for("cuda:1") == "sdpa"
