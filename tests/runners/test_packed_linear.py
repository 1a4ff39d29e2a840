"""PackedLinear (oneDNN on a packed weight) changes kernels only: same parameters, outputs, ties; it follows
weight updates, leaves training on the ordinary path, and survives copies."""

import copy

import pytest
import torch

from treeserve.engine.models.packed_linear import PACKED_DTYPES, PackedLinear, onednn_available, use_fast_cpu_linears
from treeserve.engine.models.loading import load_model

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")


@torch.inference_mode()
def test_packed_linears_keep_outputs_state_and_ties(tiny_target_dir):
    model = load_model(tiny_target_dir)
    ids = torch.tensor([[3, 17, 25, 9, 41]])
    before = model(input_ids=ids).logits
    keys = sorted(model.state_dict())
    weights = [p.data_ptr() for p in model.parameters()]
    use_fast_cpu_linears(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is PackedLinear for m in linears)
    assert sorted(model.state_dict()) == keys
    assert [p.data_ptr() for p in model.parameters()] == weights  # no copy of a parameter
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    for rows in (1, 2, 3, 5):  # every small M, the sizes a tree feeds
        assert (model(input_ids=ids[:, :rows]).logits - before[:, :rows]).abs().max().item() < 1e-4
    use_fast_cpu_linears(model)  # idempotent
    assert all(type(m) is PackedLinear for m in linears)


def test_pack_follows_weight_updates_and_training_uses_autograd():
    torch.manual_seed(0)
    layer = use_fast_cpu_linears(torch.nn.Sequential(torch.nn.Linear(8, 4)))[0]
    x = torch.randn(3, 8)
    with torch.inference_mode():
        first = layer(x)
    assert torch.allclose(first, x @ layer.weight.T + layer.bias, atol=1e-6)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place, as an optimizer step does: the pack must be rebuilt
    with torch.inference_mode():
        assert torch.allclose(layer(x), x @ layer.weight.T + layer.bias, atol=1e-6)
    layer.weight.data = torch.randn(4, 8)  # replaced
    with torch.inference_mode():
        assert torch.allclose(layer(x), x @ layer.weight.T + layer.bias, atol=1e-6)
    loss = layer(x).sum()  # grad mode: ordinary nn.Linear path, gradients flow
    loss.backward()
    assert torch.allclose(layer.weight.grad, x.sum(0).expand(4, 8))


def test_copies_rebuild_their_own_pack():
    layer = use_fast_cpu_linears(torch.nn.Sequential(torch.nn.Linear(8, 4)))[0]
    x = torch.randn(2, 8)
    with torch.inference_mode():
        layer(x)
    clone = copy.deepcopy(layer)
    with torch.no_grad():
        clone.weight.zero_()
    with torch.inference_mode():
        assert torch.equal(clone(x), clone.bias.expand(2, 4))
        assert torch.allclose(layer(x), x @ layer.weight.T + layer.bias, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_dtypes(dtype):
    torch.manual_seed(0)
    reference = torch.nn.Linear(64, 32).to(dtype)
    packed = use_fast_cpu_linears(copy.deepcopy(torch.nn.Sequential(reference)))[0]
    # bfloat16 is packed only where this CPU's oneDNN has a bf16 path; elsewhere the layer stays nn.Linear
    assert isinstance(packed, PackedLinear) == (dtype in PACKED_DTYPES)
    x = torch.randn(4, 7, 64, dtype=dtype)  # 3D input, as a model's hidden states are
    with torch.inference_mode():
        out, want = packed(x), reference(x)
    assert out.shape == want.shape and out.dtype == dtype
    assert torch.allclose(out.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 3e-2)
