"""The held-out evaluation's commands on tiny fixtures: `make-corpus --held-out-eval` writes prompts of the held-out
kinds from the reserved documents, `--write-card` cites every source, `train-eagle3 --exclude-kinds` (load_corpus)
drops the held-out sequences, and `agreement --also-prompts` measures them beside the dev prompts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from treeserve.cli.main import build_parser
from treeserve.cli.make_corpus import add_arguments, corpus_config, run
from treeserve.tools.training.corpus import (DEFAULT_CORPUS_DIR, CorpusConfig, build_corpus, chunk_stats,
                                              corpus_summary)
from treeserve.tools.training.corpus_card import card_text
from treeserve.tools.training.eagle3 import load_corpus
from treeserve.tools.training.heldout import split_library
from treeserve.tools.training.sources.registry import SOURCES, load_library
from treeserve.tools.training.sources.snapshot import fingerprint

TREE = Path(__file__).resolve().parent / "fixtures" / "sources"


def _make_corpus(argv: list[str]) -> int:
    parser, commands = build_parser()
    add_arguments(commands["make-corpus"])
    return run(parser.parse_args(["make-corpus", *argv]))


def test_held_out_eval_set_holds_only_its_kinds_from_reserved_documents(tmp_path, capsys):
    path = tmp_path / "heldout.jsonl"
    assert _make_corpus(["--out", str(tmp_path / "corpus"), "--sources-root", str(TREE), "--eval-fraction", "0.5",
                         "--held-out-eval", str(path), "--held-out-kinds", "translate", "rewrite",
                         "--held-out-prompts", "3"]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["category"] for r in rows] == ["translate"] * 3 + ["rewrite"] * 3
    assert all(r["turns"] and r["turns"][0].strip() for r in rows)
    evaluation = split_library(load_library(rebase=TREE), 0.5)[1]
    assert {r["doc_id"] for r in rows} <= {d.doc_id for d in evaluation.documents} | {p.doc_id for p in evaluation.pairs}
    assert "--also-prompts" in capsys.readouterr().out
    assert not (tmp_path / "corpus" / "corpus.json").exists()  # no corpus was started
    # The same set from a snapshot of the sources: written on the first run, read on the second.
    snapshot, again = tmp_path / "sources.jsonl.gz", tmp_path / "again.jsonl"
    for _ in range(2):
        assert _make_corpus(["--out", str(tmp_path / "corpus"), "--sources-root", str(TREE), "--eval-fraction", "0.5",
                             "--sources-snapshot", str(snapshot), "--held-out-eval", str(again),
                             "--held-out-kinds", "translate", "rewrite", "--held-out-prompts", "3"]) == 0
        assert snapshot.is_file() and again.read_text() == path.read_text()
    with pytest.raises(ValueError, match="broad corpus's recipe"):  # the committed stdlib corpus has no split
        _make_corpus(["--sources-root", str(TREE), "--held-out-eval", str(path)])


def test_corpus_card_cites_every_source_and_kind(tmp_path):
    out = tmp_path / "corpus"
    assert _make_corpus(["--out", str(out), "--sources-root", str(TREE), "--write-card",
                         "--exclude-kinds", "translate"]) == 0
    card = (out / "CARD.md").read_text()
    for spec in SOURCES:
        assert f"**{spec.name}**" in card and spec.licence in card and spec.citation in card
    assert "`summarise_long` (new, issue 61)" in card and "`translate`" not in card.split("## Task kinds")[1].split("##")[0]
    assert "| manpages | manpages," in card and "2 documents | de, en" in card


def _chunk(directory: Path, kinds: list[str], lengths: list[int], width: int = 4) -> Path:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    total = offsets[-1]
    path = directory / "chunk-00000.safetensors"
    save_file({"tokens": torch.arange(total, dtype=torch.int32), "seq_offsets": torch.tensor(offsets),
               "answer_mask": torch.ones(total, dtype=torch.uint8)}, str(path),
              metadata={"stats": json.dumps({"kinds": kinds})})
    features = directory / "features"
    features.mkdir()
    save_file({"features": torch.zeros(total, 3 * width, dtype=torch.float16),
               "last_hidden": torch.zeros(total, width, dtype=torch.float16)}, str(features / path.name),
              metadata={"feature_layers": json.dumps([1, 2, 3])})
    return path


def test_training_corpus_without_held_out_kinds(tmp_path):
    chunk = _chunk(tmp_path, ["translate", "math", "translate+follow_up", "rewrite"], [3, 4, 5, 2])
    everything = load_corpus([chunk], tmp_path / "features")
    assert everything.spans == [(0, 3), (3, 7), (7, 12), (12, 14)] and int(everything.answer_mask.sum()) == 14
    held = load_corpus([chunk], tmp_path / "features", exclude_kinds=frozenset({"translate"}))
    assert held.spans == [(3, 7), (12, 14)]
    assert held.answer_mask.tolist() == [False] * 3 + [True] * 4 + [False] * 5 + [True] * 2


def test_agreement_measures_held_out_prompts_beside_the_dev_prompts(tiny_target_dir, tmp_path):
    also = tmp_path / "heldout.jsonl"
    also.write_text("".join(json.dumps({"question_id": i, "category": kind, "turns": [text]}) + "\n" for i, (kind, text)
                            in enumerate([("translate", "Translate into German: the pump is busy."),
                                          ("rewrite", "Rewrite in plain English: valves open one at a time.")])))
    out = subprocess.run([sys.executable, "-m", "treeserve.cli.main", "agreement", "--target", str(tiny_target_dir),
                          "--drafter", str(tiny_target_dir), "--num-prompts", "2", "--max-new-tokens", "4",
                          "--also-prompts", str(also), "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    assert result["positions"] == 8 and result["also"]["positions"] == 8
    assert result["also"]["top1_by_category"] == {"rewrite": 1.0, "translate": 1.0}  # the target drafts itself


def test_the_committed_corpus_resumes_with_its_original_mix():
    """The shipped corpus's recipe predates the broad mix: a bare `make-corpus` resumes it as 'stdlib' with its
    768-token prompts, while a fresh --out starts a broad corpus."""
    parser, commands = build_parser()
    add_arguments(commands["make-corpus"])
    resumed = corpus_config(parser.parse_args(["make-corpus"]))
    assert (DEFAULT_CORPUS_DIR / "corpus.json").is_file()
    assert resumed.mix == "stdlib" and resumed.max_prompt_tokens == 768 and resumed.exclude_kinds == ()
    fresh = corpus_config(parser.parse_args(["make-corpus", "--out", "/nonexistent/broad", "--exclude-kinds",
                                             "translate"]))
    assert fresh.mix == "broad" and fresh.exclude_kinds == ("translate",) and fresh.max_prompt_tokens == 2304


def test_a_broad_chunk_records_kinds_tokens_and_documents(tiny_target_dir, tmp_path):
    """The tiny target answers one broad chunk: its stats hold the mix, the estimated and measured tokens per kind
    and the source documents (all from the training side), and the card reports the measured tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    config = CorpusConfig(num_conversations=6, chunk_size=6, batch_size=6, max_new_tokens=3, instruction_tokens=3,
                          max_prompt_tokens=200, eval_fraction=0.5, exclude_kinds=("self_instruct", "docs"))
    library = load_library(rebase=TREE)
    [chunk] = build_corpus(model, tokenizer, config, tmp_path, library=library)
    stats = chunk_stats(chunk)
    assert stats["mix"] == "broad" and sum(stats["answer_tokens_by_kind"].values()) == stats["answer_tokens"]
    assert stats["sources"] == fingerprint(library)
    assert set(stats["estimated_tokens_by_kind"]) == {k.split("+")[0] for k in stats["kinds"]}
    train = split_library(library, 0.5)[0]
    assert {d for d in stats["doc_ids"] if d} <= {d.doc_id for d in train.documents} | {p.doc_id for p in train.pairs}
    assert corpus_summary(tmp_path)["answer_tokens_by_kind"] == stats["answer_tokens_by_kind"]
    card = card_text(tmp_path, library, config)
    assert "1 chunks, " in card and all(f"| {k} | {v:,} |" in card for k, v in stats["answer_tokens_by_kind"].items())
