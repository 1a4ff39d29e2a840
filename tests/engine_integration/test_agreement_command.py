"""CLI commands on the tiny pair: `treeserve agreement` (several drafters compared on the same target
answers) and `train-c2t`'s input checks."""

import json
import subprocess
import sys


def test_agreement_compares_drafters_on_the_same_answers(tiny_target_dir, tiny_drafter_dir):
    out = subprocess.run([sys.executable, "-m", "treeserve.services.cli", "agreement", "--target", str(tiny_target_dir),
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
    out = subprocess.run([sys.executable, "-m", "treeserve.services.cli", "agreement", "--target", str(tiny_target_dir),
                          "--drafter", str(tiny_drafter_dir), str(tiny_drafter_dir), "--write-card"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "exactly one --drafter" in out.stderr and "Traceback" not in out.stderr


def test_train_c2t_rejects_a_bad_prompts_file(tmp_path):
    """A bad --prompts-file is a CLI message naming the file, before any model is loaded."""
    bad = tmp_path / "prompts.json"
    bad.write_text('{"not": "a list"}')
    for path in (bad, tmp_path / "missing.json"):
        out = subprocess.run([sys.executable, "-m", "treeserve.services.cli", "train-c2t", "--prompts-file", str(path),
                              "--target", str(tmp_path / "no-model")], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "--prompts-file" in out.stderr and "Traceback" not in out.stderr
