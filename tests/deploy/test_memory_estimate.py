"""`treeserve memory-estimate`: the arithmetic, the verdicts, and the committed reports being fresh."""

import argparse
from pathlib import Path

import pytest

from treeserve.services import memory_estimate as me
from treeserve.services.config import load_serve_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _args(*argv):
    parser = argparse.ArgumentParser()
    me.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_llama2_70b_parameter_count():
    facts = load_serve_config(DEPLOY / "llama2-70b-4xa100.yaml").app.args.target.facts()
    sharded, replicated = me.param_counts(facts)
    assert 68.5e9 < sharded + replicated < 69.5e9  # Llama-2-70B has ~69.0B parameters


@pytest.mark.parametrize("layout", sorted(DEPLOY.glob("*.yaml")), ids=lambda p: p.name)
def test_committed_report_is_fresh(layout):
    text, ok = me.report(layout, 80.0, 2.0)
    assert ok
    committed = me.report_path(layout)
    assert committed.is_file(), f"run `treeserve memory-estimate --write` to create {committed.name}"
    assert committed.read_text() == text, f"{committed.name} is stale: run `treeserve memory-estimate --write`"


def test_report_rows_and_kv_formula():
    text, ok = me.report(DEPLOY / "llama2-70b-4xa100.yaml", 80.0, 2.0)
    assert ok and text.count("target rank (4 ranks)") == 4 and "cuda:4  drafter" in text
    # KV per rank: 2 x 80 layers x 8/4 kv heads x 128 x 2 bytes x 16 x 4096 tokens = 5 GiB
    assert "5.00 GiB" in text


def test_small_gpu_does_not_fit(capsys):
    assert me.run(_args(str(DEPLOY / "llama2-70b-4xa100.yaml"), "--gpu-memory-gib", "40")) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_bad_input():
    with pytest.raises(ValueError):
        me.run(_args("--gpu-memory-gib", "0"))
    with pytest.raises(ValueError):
        me.run(_args("/nonexistent.yaml"))


def test_write(tmp_path, capsys):
    layout = tmp_path / "local-cpu.yaml"
    layout.write_text((DEPLOY / "local-cpu.yaml").read_text())
    assert me.run(_args(str(layout), "--write")) == 0
    assert (tmp_path / "local-cpu.memory.txt").read_text() in capsys.readouterr().out
