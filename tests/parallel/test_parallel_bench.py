"""`treeserve bench` compares the autoregressive and the parallel drafter in one run (tiny models)."""

from __future__ import annotations

import argparse
import json

import pytest

from parallel_drafters import make_parallel_drafter  # tests/parallel_drafters.py
from treeserve.cli import bench
from treeserve.tools.bench.runner import parse_entry


def test_parse_entries():
    assert parse_entry("dyspec:32@parallel") == [("dyspec", 32, "parallel")]
    assert parse_entry("chain:4", "both") == [("chain", 4, "autoregressive"), ("chain", 4, "parallel")]
    assert parse_entry("autoregressive", "both") == [("autoregressive", "auto", "autoregressive")]
    with pytest.raises(ValueError, match="drafter kind"):
        parse_entry("chain:4@medusa")


def test_bench_reports_both_kinds(tmp_path, tiny_target, tiny_target_dir, tiny_drafter_dir):
    pd = tmp_path / "pd"
    make_parallel_drafter(tiny_target.model, layers=(0,), vocab_size=tiny_target.model.config.vocab_size).save(pd)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                               for i, (c, t) in enumerate([("qa", "Why is the sky blue?"), ("math", "2+2=?")])))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "summary.json"
    args = parser.parse_args(["--prompts", str(prompts), "--num-prompts", "2", "--max-new-tokens", "10",
                              "--target", str(tiny_target_dir), "--drafter", str(tiny_drafter_dir),
                              "--parallel-drafter", str(pd), "--drafter-kind", "both", "--threads", "1",
                              "--methods", "autoregressive", "chain:4", "opt_tree:8", "--check-greedy", "--repeats", "2",
                              "--drafter-dtype", "float32",
                              "--json-out", str(out), "--answers-dir", str(tmp_path / "answers")])
    assert bench.run(args) == 0
    rows = {(r["method"], r["drafter_kind"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("autoregressive", "autoregressive"), ("chain", "autoregressive"), ("chain", "parallel"),
                         ("opt_tree", "autoregressive"), ("opt_tree", "parallel")}
    # The drafter column names the drafter (not its kind) and the dtype it ran in.
    assert rows[("chain", "autoregressive")]["drafter"] == f"{tiny_drafter_dir} (float32)"
    assert rows[("chain", "parallel")]["drafter"] == f"parallel:{pd} (float32)"
    assert rows[("autoregressive", "autoregressive")]["drafter"] == "-"
    for key, row in rows.items():
        assert row["greedy_mismatches"] == 0
        if key[0] != "autoregressive":
            assert row["draft_ms_per_step"] >= row["drafter_runner_ms_per_step"] >= row["drafter_forward_ms_per_step"] > 0
    answers = (tmp_path / "answers" / "chain-4-parallel.jsonl").read_text().splitlines()
    assert len(answers) == 2  # one answer per prompt, whatever the repeats


def test_bench_rejects_zero_repeats(tiny_target_dir):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--target", str(tiny_target_dir), "--repeats", "0", "--methods", "autoregressive"])
    with pytest.raises(ValueError, match="--repeats"):
        bench.run(args)
