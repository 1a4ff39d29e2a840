"""Drafter dtype "auto" (engine/drafters/dtype_choice.py): the faster of the target's dtype and bfloat16,
measured once per machine; a drafter in another dtype than the target's drafts losslessly."""

import pytest
import torch

from treeserve.engine.drafters import dtype_choice
from treeserve.engine.drafters.dtype_choice import candidate_dtypes, choose, fastest_dtype


def test_the_target_dtype_wins_unless_another_is_clearly_faster():
    both = candidate_dtypes(torch.float32)
    assert both == (torch.float32, torch.bfloat16) and candidate_dtypes(torch.bfloat16) == (torch.bfloat16,)
    assert choose(both, {"torch.float32": 4.0, "torch.bfloat16": 3.0}) == torch.bfloat16
    assert choose(both, {"torch.float32": 4.0, "torch.bfloat16": 3.9}) == torch.float32  # within 5%: noise
    assert choose(both, {"torch.float32": 3.0, "torch.bfloat16": 6.0}) == torch.float32  # no bf16 units


def test_fastest_dtype_measures_once_per_machine(tiny_drafter_dir, tmp_path, monkeypatch):
    from treeserve.engine.models.loading import load_model

    loaded, timed = [], []

    def load(dtype):
        loaded.append(dtype)
        return load_model(tiny_drafter_dir, "cpu", dtype)

    def fake_step(model, device, dtype, nodes, forward=None):
        assert next(model.parameters()).dtype == dtype and nodes == dtype_choice.FRONTIER_NODES
        timed.append(dtype)
        return {torch.float32: 4.0, torch.bfloat16: 2.0}[dtype]

    monkeypatch.setattr(dtype_choice, "time_drafter_step", fake_step)
    assert fastest_dtype(load, "cpu", torch.float32, cache_dir=tmp_path)[0] == torch.bfloat16
    assert timed == [torch.float32, torch.bfloat16]
    assert fastest_dtype(load, "cpu", torch.float32, cache_dir=tmp_path)[0] == torch.bfloat16  # from the cache
    assert timed == [torch.float32, torch.bfloat16]
    assert fastest_dtype(load, "cpu", torch.bfloat16, cache_dir=tmp_path)[0] == torch.bfloat16  # nothing to choose
    assert len(timed) == 2


@pytest.mark.parametrize("drafter_dtype", ["bfloat16", "auto"])
def test_a_drafter_in_its_own_dtype_drafts_losslessly(tiny_target_dir, tiny_drafter_dir, drafter_dtype):
    from treeserve.engine.factory import build_engine
    from treeserve.engine.requests import GenerationRequest

    def greedy(engine) -> list[int]:
        request = GenerationRequest(prompt_ids=engine.encode_chat("Name three colours."), max_new_tokens=24)
        return engine.generate([request])[0].token_ids

    plain = greedy(build_engine(str(tiny_target_dir), method="autoregressive"))
    for method, budget in (("dyspec", 8), ("c2t+lookup", "auto")):
        engine = build_engine(str(tiny_target_dir), drafter_path=str(tiny_drafter_dir), method=method,
                              budget=budget, drafter_dtype=drafter_dtype)
        chosen = next(engine.drafter.model.parameters()).dtype
        assert chosen == torch.bfloat16 if drafter_dtype == "bfloat16" else chosen in (torch.float32, torch.bfloat16)
        assert next(engine.target.lm.model.parameters()).dtype == torch.float32  # the target keeps its dtype
        assert greedy(engine) == plain


def test_bad_drafter_dtype_is_refused(tiny_target_dir, tiny_drafter_dir):
    from treeserve.engine.factory import build_engine

    with pytest.raises(ValueError, match="drafter dtype must be 'auto' or one of"):
        build_engine(str(tiny_target_dir), drafter_path=str(tiny_drafter_dir), method="chain", budget=2,
                     drafter_dtype="int8")
