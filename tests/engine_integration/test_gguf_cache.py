"""The GGUF -> safetensors cache (engine/models/gguf_cache.py): converted once, reused, converted again when the
GGUF changes, one conversion when processes ask at once, and a model read from it identical to the one
transformers builds from the GGUF itself."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from treeserve.engine.models import gguf_cache, loading
from treeserve.engine.models.conversion import start_conversion
from treeserve.engine.models.gguf_cache import ensure_converted
from treeserve.engine.models.paths import (SOURCE_FILE, default_gguf_path, gguf_and_cache_dir, gguf_stamp,
                                           is_current)


@pytest.fixture
def fake_conversions(monkeypatch):
    """Replaces the real conversion (seconds of work) by one that writes a marked directory and counts."""
    done: list[str] = []

    def convert(gguf_path, out_dir):
        time.sleep(0.05)  # long enough for a concurrent caller to arrive while it runs
        tmp = out_dir.with_name(out_dir.name + f".partial-{len(done)}")
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps({"n": len(done)}))
        (tmp / SOURCE_FILE).write_text(json.dumps(gguf_stamp(gguf_path)))
        gguf_cache._replace_dir(tmp, out_dir)
        done.append(out_dir.name)
        return out_dir

    monkeypatch.setattr(gguf_cache, "convert_gguf", convert)
    return done


def _model_file(tmp_path, content: bytes = b"GGUF v1"):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    return path


def test_written_once_then_reused(tmp_path, fake_conversions):
    gguf, out = _model_file(tmp_path), tmp_path / "cache" / "model"
    assert not is_current(gguf, out)
    assert ensure_converted(gguf, out) == out and fake_conversions == ["model"]
    assert is_current(gguf, out)
    ensure_converted(gguf, out)
    assert fake_conversions == ["model"]  # current: not converted again
    assert sorted(p.name for p in out.parent.iterdir()) == ["model", "model.lock"]  # nothing half-written left


def test_a_changed_or_unstamped_gguf_is_converted_again(tmp_path, fake_conversions):
    gguf, out = _model_file(tmp_path), tmp_path / "cache" / "model"
    ensure_converted(gguf, out)
    gguf.write_bytes(b"GGUF v2, another release")  # other size and time
    assert not is_current(gguf, out)
    ensure_converted(gguf, out)
    assert len(fake_conversions) == 2 and json.loads((out / "config.json").read_text()) == {"n": 1}
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # same size, rewritten in place
    assert not is_current(gguf, out)
    ensure_converted(gguf, out)
    assert len(fake_conversions) == 3
    (out / SOURCE_FILE).unlink()  # written before the stamp existed: its source is unknown
    assert not is_current(gguf, out)
    ensure_converted(gguf, out)
    assert len(fake_conversions) == 4 and is_current(gguf, out)
    assert not list(out.parent.glob("*.stale-*"))  # the replaced directories are gone


def test_callers_at_once_wait_for_one_conversion(tmp_path, fake_conversions):
    """Replicas started together: one converts, the others wait on the lock and find it current."""
    gguf, out = _model_file(tmp_path), tmp_path / "cache" / "model"
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(ensure_converted(gguf, out))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == [out] * 4 and fake_conversions == ["model"]


def test_a_gguf_converts_into_the_model_cache(tmp_path, monkeypatch, fake_conversions):
    gguf = _model_file(tmp_path)
    monkeypatch.setenv("TREESERVE_CACHE", str(tmp_path / "cache"))
    assert not is_current(*gguf_and_cache_dir(gguf))
    model_dir = loading.resolve_model_dir(gguf)
    assert model_dir.parent == tmp_path / "cache" / "models" and is_current(*gguf_and_cache_dir(gguf))
    assert loading.resolve_model_dir(gguf) == model_dir and len(fake_conversions) == 1


def test_an_unreadable_gguf_is_one_line(tmp_path):
    bad = _model_file(tmp_path, b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="model.gguf is not a readable GGUF model"):
        gguf_cache.convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_child_process_says_why_it_refuses_a_gguf(tmp_path, monkeypatch):
    """The conversion a first start runs beside Ray (engine/models/conversion.py) is this module's `main` in a
    child process: an unreadable GGUF comes back to the parent as the same one-line ValueError."""
    monkeypatch.setenv("TREESERVE_CACHE", str(tmp_path / "cache"))
    bad = _model_file(tmp_path, b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="^[^\n]*model.gguf is not a readable GGUF model"):
        start_conversion(bad).result(timeout=300)
    assert not list((tmp_path / "cache" / "models").glob("*/config.json"))


@pytest.mark.slow
def test_the_cached_model_is_the_one_transformers_reads_from_the_gguf(default_model_dir):
    """Lossless: the converted default target (weights, logits, tokenizer) against what transformers' own GGUF
    reading gives without the shared parse, in a model initialised as usual (`from_pretrained(gguf_file=...)`
    itself needs accelerate, which TreeServe does not install)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = default_gguf_path()
    assert loading.resolve_model_dir("default") == default_model_dir and is_current(gguf, default_model_dir)
    cached = loading.load_causal_lm("default")
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=reference)["tensors"]
    reference.load_state_dict(tensors, strict=False)
    reference.tie_weights()
    reference.eval()
    mine, theirs = cached.model.state_dict(), reference.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]) for k in mine)
    reference_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    texts = ["Explain in two sentences why the sky is blue.", "def f(x):\n\treturn x ** 2  # émoji 🙂",
             "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert cached.tokenizer(text)["input_ids"] == reference_tokenizer(text)["input_ids"]
    ids = torch.tensor([cached.tokenizer(texts[0])["input_ids"]])
    with torch.no_grad():
        assert torch.equal(cached.model(ids).logits, reference(ids).logits)
