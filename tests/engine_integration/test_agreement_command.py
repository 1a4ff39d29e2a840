"""CLI commands on the tiny pair: `treeserve agreement` (several drafters compared on the same target
answers) and `train-c2t`'s input checks."""

import json
import subprocess
import sys


def test_agreement_compares_drafters_on_the_same_answers(tiny_target_dir, tiny_drafter_dir):
    out = subprocess.run([sys.executable, "-m", "treeserve.cli.main", "agreement", "--target", str(tiny_target_dir),
                          "--drafter", str(tiny_drafter_dir), str(tiny_target_dir), "--num-prompts", "3",
                          "--max-new-tokens", "5", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["drafter"] for r in results] == [str(tiny_drafter_dir), str(tiny_target_dir)]
    assert all(r["positions"] == 15 for r in results)
    # The target as its own drafter agrees with its greedy answer everywhere.
    assert results[1]["top1"] == 1.0 and results[1]["top4"] == 1.0
    assert 0.0 <= results[0]["top1"] <= results[0]["top4"] <= 1.0


def test_write_card_needs_one_drafter(tiny_target_dir, tiny_drafter_dir):
    out = subprocess.run([sys.executable, "-m", "treeserve.cli.main", "agreement", "--target", str(tiny_target_dir),
                          "--drafter", str(tiny_drafter_dir), str(tiny_drafter_dir), "--write-card"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "exactly one --drafter" in out.stderr and "Traceback" not in out.stderr


def test_train_c2t_rejects_a_bad_prompts_file(tmp_path):
    """A bad --prompts-file is a CLI message naming the file, before any model is loaded."""
    bad = tmp_path / "prompts.json"
    bad.write_text('{"not": "a list"}')
    for path in (bad, tmp_path / "missing.json"):
        out = subprocess.run([sys.executable, "-m", "treeserve.cli.main", "train-c2t", "--prompts-file", str(path),
                              "--target", str(tmp_path / "no-model")], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "--prompts-file" in out.stderr and "Traceback" not in out.stderr


def test_prompts_are_balanced_over_categories(tmp_path):
    """Spec-Bench's shape: two large categories and small ones. Every category gets its share, spread over
    its rows, in file order; a category that runs out leaves its turns to the others."""
    import pytest

    from treeserve.engine.dev_prompts import load_prompts

    rows = ([{"question_id": i, "category": "writing"} for i in range(3)]
            + [{"question_id": 10 + i, "category": "qa"} for i in range(40)]
            + [{"question_id": 100 + i, "category": "math"} for i in range(40)])
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ids = [r["question_id"] for r in load_prompts(path, 9)]
    assert ids == [0, 1, 2, 10, 23, 36, 100, 113, 126]
    picked = load_prompts(path, 20)
    assert [sum(r["category"] == c for r in picked) for c in ("writing", "qa", "math")] == [3, 9, 8]
    assert [r["question_id"] for r in picked] == sorted(r["question_id"] for r in picked)
    assert len(load_prompts(path, 500)) == len(rows)
    with pytest.raises(ValueError, match=">= 1"):
        load_prompts(path, 0)
