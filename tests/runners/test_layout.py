"""The input-major weight layout changes strides only: same parameters, same outputs, ties kept."""

import torch

from treeserve.engine.models.layout import is_input_major, use_input_major_weights
from treeserve.engine.models.loading import load_model


@torch.inference_mode()
def test_input_major_layout_keeps_outputs_and_ties(tiny_target_dir):
    model = load_model(tiny_target_dir)
    ids = torch.tensor([[3, 17, 25, 9, 41]])
    before = model(input_ids=ids).logits
    keys = sorted(model.state_dict())
    use_input_major_weights(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(is_input_major(m.weight) for m in linears)
    assert sorted(model.state_dict()) == keys
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    assert (model(input_ids=ids).logits - before).abs().max().item() < 1e-5
    again = [m.weight.data_ptr() for m in linears]
    use_input_major_weights(model)  # idempotent: no second copy
    assert [m.weight.data_ptr() for m in linears] == again
