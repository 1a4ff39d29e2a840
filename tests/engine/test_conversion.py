"""The first start's conversion in a child process (engine/models/conversion.py): nothing to start for a model
directory or a current cache, the child handed the GGUF and its directory, read like a Future, its failures
raised with its own reason. The child here is tests/fake_conversion.py; the real one (gguf_cache.py's `main`) is
run in tests/engine_integration/test_gguf_cache.py."""

from __future__ import annotations

import json

import pytest
from fake_conversion import CONVERTS, exits  # tests/fake_conversion.py

from treeserve.engine.models.conversion import UNCONVERTIBLE, ConversionError, start_conversion
from treeserve.engine.models.paths import is_current


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("TREESERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF v1")
    return path


def test_the_child_converts_into_the_model_cache(gguf, tmp_path):
    converting = start_conversion(gguf, CONVERTS)
    out = tmp_path / "cache" / "models" / f"model-{gguf.stat().st_size}"
    assert converting.result(timeout=60) == out and converting.done()
    assert json.loads((out / "arguments.json").read_text()) == [str(gguf), str(out)]
    assert is_current(gguf, out)
    assert converting.result() == out  # asked again: the same answer
    assert start_conversion(gguf, exits(1, "must not run")) is None  # current now: nothing to start


def test_a_model_directory_needs_no_conversion(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert start_conversion(model, exits(1, "must not run")) is None


def test_a_refused_gguf_is_a_value_error_with_the_childs_reason(gguf):
    converting = start_conversion(gguf, exits(UNCONVERTIBLE, "some warning", "model.gguf is not a readable GGUF"))
    with pytest.raises(ValueError, match="^model.gguf is not a readable GGUF$"):
        converting.result(timeout=60)


def test_a_crash_names_the_conversion_and_its_last_line(gguf):
    with pytest.raises(ConversionError, match=r"converting .*model\.gguf into .* failed: MemoryError"):
        start_conversion(gguf, exits(1, "Traceback (most recent call last):", "MemoryError")).result(timeout=60)
    with pytest.raises(ConversionError, match="failed: exit status 3"):
        start_conversion(gguf, exits(3)).result(timeout=60)


def test_a_child_that_ends_without_a_current_directory_failed(gguf):
    with pytest.raises(ConversionError, match="failed: exit status 0"):
        start_conversion(gguf, exits(0)).result(timeout=60)

