"""The checkout is self-contained: nothing in it refers to a path outside it, and a clone with nothing beside it
finds its default prompt file inside itself (a fresh `git clone` must pass `make test`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Spelled in pieces so that this file does not match itself.
FORBIDDEN = ("/" + "work/", ".." + "/shared", "shared" + "/data", "shared" + "/papers", "parents[3]" + " / \"shared\"")

needs_git = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                               reason="not a git checkout")


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True)
    return [ROOT / name for name in out.stdout.decode().split("\0") if name]


@needs_git
def test_no_tracked_file_refers_outside_the_checkout():
    offenders = []
    for path in tracked_files():
        if not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary (weights, images)
            continue
        text = data.decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            offenders += [f"{path.relative_to(ROOT)}:{number}: {bad!r}" for bad in FORBIDDEN if bad in line]
    assert not offenders, "paths outside the checkout:\n" + "\n".join(offenders)


def _strings(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def test_shipped_drafter_cards_hold_no_absolute_paths():
    """training.json / config.json of the shipped drafters name data and starting points relative to the cache
    ($TREESERVE_CACHE/...) or the checkout, never as paths of the machine they were trained on."""
    cards = sorted((ROOT / "engine" / "drafters" / "weights").glob("*/*.json"))
    assert any(p.name == "training.json" for p in cards)
    bad = [(str(p.relative_to(ROOT)), s) for p in cards for s in _strings(json.loads(p.read_text()))
           if os.path.isabs(s) or s.startswith("~")]
    assert not bad, bad


def test_trainers_write_portable_paths(tmp_path, monkeypatch):
    from treeserve.engine.models.loading import portable_path
    from treeserve.tools.training.model_card import portable_card

    cache = tmp_path / "cache"
    monkeypatch.setenv("TREESERVE_CACHE", str(cache))
    assert portable_path(cache / "distill" / "v3" / "teacher.safetensors") == "$TREESERVE_CACHE/distill/v3/teacher.safetensors"
    assert portable_path(ROOT / "engine" / "drafters" / "weights" / "distilled") == "engine/drafters/weights/distilled"
    assert portable_path(tmp_path / "runs" / "eagle_run2") == "eagle_run2"  # elsewhere: the name only
    assert portable_path("default") == "default" and portable_path("") == ""
    card = {"target": "default", "data_path": str(cache / "distill" / "v2" / "teacher.safetensors"),
            "training": {"continued_from": {"path": str(tmp_path / "first"), "steps": 3}},
            "config": {"init_from": str(tmp_path / "first"), "lr": 0.001}}
    assert portable_card(card) == {"target": "default", "data_path": "$TREESERVE_CACHE/distill/v2/teacher.safetensors",
                                   "training": {"continued_from": {"path": "first", "steps": 3}},
                                   "config": {"init_from": "first", "lr": 0.001}}


@needs_git
def test_a_clone_finds_its_default_prompts_inside_itself(tmp_path):
    """Clone into an empty directory (no sibling folders beside it) and resolve the default prompt file of the
    clone's own code: it must exist and lie inside the clone."""
    clone = tmp_path / "alone" / "treeserve"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    code = ("import runpy, sys; ns = runpy.run_path(sys.argv[1]); "
            "print(ns['DEV_PROMPTS'].resolve()); print(ns['DEV_PROMPTS'].is_file())")
    out = subprocess.run([sys.executable, "-c", code, str(clone / "engine" / "dev_prompts.py")],
                         capture_output=True, text=True, check=True, timeout=60)
    resolved, exists = out.stdout.split()
    assert Path(resolved).is_relative_to(clone.resolve()), resolved
    assert exists == "True", f"{resolved} is missing from a fresh clone"
    rows = [json.loads(line) for line in Path(resolved).read_text().splitlines() if line.strip()]
    assert len(rows) == 240 and {"question_id", "category", "turns"} <= set(rows[0])
