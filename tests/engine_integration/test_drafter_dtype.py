"""Drafter dtype "auto" (engine/drafters/dtype_choice.py): the faster of the target's dtype and bfloat16,
measured once per machine; a drafter in another dtype than the target's drafts losslessly."""

import pytest
import torch

from treeserve.engine.drafters import dtype_choice
from treeserve.engine.drafters.dtype_choice import candidate_dtypes, choose, fastest_dtype
from treeserve.engine.factory import build_engine
from treeserve.engine.hardware import profile
from treeserve.engine.models.loading import load_model
from treeserve.engine.requests import GenerationRequest


def test_the_target_dtype_wins_unless_another_is_clearly_faster():
    both = candidate_dtypes(torch.float32)
    assert both == (torch.float32, torch.bfloat16) and candidate_dtypes(torch.bfloat16) == (torch.bfloat16,)
    assert choose(both, {"torch.float32": 4.0, "torch.bfloat16": 3.0}) == torch.bfloat16
    assert choose(both, {"torch.float32": 4.0, "torch.bfloat16": 3.9}) == torch.float32  # within 5%: noise
    assert choose(both, {"torch.float32": 3.0, "torch.bfloat16": 6.0}) == torch.float32  # no bf16 units


def test_fastest_dtype_measures_once_per_machine(tiny_drafter_dir, tmp_path, monkeypatch):
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
    def greedy(engine) -> list[int]:
        request = GenerationRequest(prompt_ids=engine.encode_chat("Name three colours."), max_new_tokens=24)
        return engine.generate([request])[0].token_ids

    plain = greedy(build_engine(str(tiny_target_dir), method="autoregressive"))
    for method, budget in (("dyspec", 8), ("c2t+lookup", "auto")):
        engine = build_engine(str(tiny_target_dir), drafter_path=str(tiny_drafter_dir), method=method,
                              budget=budget, drafter_dtype=drafter_dtype)
        chosen = next(engine.drafter.local.model.parameters()).dtype
        assert chosen == torch.bfloat16 if drafter_dtype == "bfloat16" else chosen in (torch.float32, torch.bfloat16)
        assert next(engine.target.runner.lm.model.parameters()).dtype == torch.float32  # the target keeps its dtype
        assert greedy(engine) == plain


def test_bad_drafter_dtype_is_refused(tiny_target_dir, tiny_drafter_dir):
    with pytest.raises(ValueError, match="drafter dtype must be 'auto' or one of"):
        build_engine(str(tiny_target_dir), drafter_path=str(tiny_drafter_dir), method="chain", budget=2,
                     drafter_dtype="int8")


def test_a_known_machines_measurement_is_read_when_the_cache_has_none(tiny_drafter_dir, tmp_path, monkeypatch):
    """A first start on a machine whose measurement ships with the code (engine/hardware/known_profiles) times
    nothing; the cache's own measurement, once made, wins over the shipped one; an explicit cache_dir (a test's,
    a benchmark's) never reads the shipped ones."""
    known, cache = tmp_path / "known", tmp_path / "cache"
    monkeypatch.setattr(profile, "KNOWN_PROFILES", known)
    monkeypatch.setenv("TREESERVE_CACHE", str(cache))
    timed = []

    def fake_step(model, device, dtype, nodes, forward=None):
        timed.append(dtype)
        return {torch.float32: 4.0, torch.bfloat16: 2.0}[dtype]

    monkeypatch.setattr(dtype_choice, "time_drafter_step", fake_step)
    load = lambda dtype: load_model(tiny_drafter_dir, "cpu", dtype)  # noqa: E731
    assert fastest_dtype(load, "cpu", torch.float32, cache_dir=tmp_path / "explicit")[0] == torch.bfloat16
    name = next((tmp_path / "explicit").iterdir()).name
    known.mkdir()
    (known / name).write_text('{"step_ms": {"torch.float32": 1.0, "torch.bfloat16": 3.0}, "nodes": 4}')
    timed.clear()
    assert fastest_dtype(load, "cpu", torch.float32)[0] == torch.float32 and timed == []  # the shipped one
    assert profile.measurement_path(name) == (cache / "profiles" / name, known / name)
    (cache / "profiles").mkdir(parents=True)
    (cache / "profiles" / name).write_text('{"step_ms": {"torch.float32": 4.0, "torch.bfloat16": 2.0}, "nodes": 4}')
    assert fastest_dtype(load, "cpu", torch.float32)[0] == torch.bfloat16 and timed == []  # the cache's wins
    assert profile.measurement_path(name, tmp_path / "elsewhere") == (tmp_path / "elsewhere" / name, None)
