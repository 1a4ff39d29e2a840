"""Generalisation measured honestly (issue 61 item 3): whole task kinds kept out of training, and an evaluation
set of exactly those kinds, measured beside the dev prompts.

Two splits work together:
- by *kind*: the training corpus is built without the held-out kinds (`CorpusConfig.exclude_kinds`, a recipe
  setting of its own corpus), or an existing corpus is trained without them (`train-eagle3 --exclude-kinds`
  drops the sequences whose recorded kind is held out: chunk stats keep each sequence's kind);
- by *document*: a stable hash puts a share of the source documents (a page together with its translations,
  a catalogue with all its languages) on the evaluation side only; the training mix never draws them, so an
  evaluation prompt's text was never seen in training, in any language.

`evaluation_rows` writes prompts in the dev file's (Spec-Bench) format with the kind as category:
`treeserve agreement --prompts FILE` (or `--also-prompts FILE` beside the dev prompts) reports top-1 per kind.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from .broad_mix import BROAD_KINDS, BenchmarkGuard, MixSettings, MixSources, make_prompt
from .prompt_mix import SELF_INSTRUCT
from .sources.base import held_out
from .sources.registry import SourceLibrary

# Share of documents kept for evaluation. 10% of ~20k pages and guides, and of ~100 catalogues, leaves
# thousands of evaluation documents and costs training little.
DEFAULT_EVAL_FRACTION = 0.1
# Held-out evaluation prompts are drawn from seeds far from any corpus chunk's (seed * 100_003 + index).
EVAL_SEED_BASE = 7_000_000_019


@dataclass(frozen=True)
class HeldOutSplit:
    """Which kinds are held out of training, and which share of documents is reserved for evaluation."""

    kinds: tuple[str, ...] = ()
    eval_fraction: float = DEFAULT_EVAL_FRACTION

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(BROAD_KINDS)
        if unknown:
            raise ValueError(f"unknown task kinds {sorted(unknown)}; kinds: {', '.join(BROAD_KINDS)}")
        if SELF_INSTRUCT in self.kinds:
            # Its prompts are written by the target while the corpus is made: there is no fixed set to evaluate on.
            raise ValueError("self_instruct cannot be held out: its prompts exist only inside a corpus run")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError("the evaluation share of documents must be in [0, 1)")


def split_library(library: SourceLibrary, fraction: float = DEFAULT_EVAL_FRACTION
                  ) -> tuple[SourceLibrary, SourceLibrary]:
    """(training side, evaluation side) of the library, by the stable hash of each document's id."""
    train = SourceLibrary([d for d in library.documents if not held_out(d.doc_id, fraction)],
                          [p for p in library.pairs if not held_out(p.doc_id, fraction)], list(library.missing))
    evaluation = SourceLibrary([d for d in library.documents if held_out(d.doc_id, fraction)],
                               [p for p in library.pairs if held_out(p.doc_id, fraction)], list(library.missing))
    return train, evaluation


def evaluation_rows(evaluation: SourceLibrary, kinds: tuple[str, ...], per_kind: int, seed: int = 0,
                    guard: BenchmarkGuard = BenchmarkGuard(), settings: MixSettings = MixSettings()) -> list[dict]:
    """`per_kind` prompts of each kind from the evaluation side of the library, as Spec-Bench rows
    (`category` = kind; a second turn where the kind has one), deterministic in the arguments."""
    HeldOutSplit(kinds)  # validates the kinds
    if not (evaluation.documents or evaluation.pairs) and set(kinds) - {"docs", "code", "math"}:
        raise ValueError("the evaluation side of the library is empty: no source installed, or no document "
                         "reserved (eval_fraction 0)")
    sources = MixSources.of(evaluation)
    rows: list[dict] = []
    for kind in kinds:
        rng = random.Random(EVAL_SEED_BASE + seed * 1_009 + BROAD_KINDS.index(kind))
        made, tries = 0, 0
        while made < per_kind:
            tries += 1
            if tries > 100 * per_kind + 100:
                raise RuntimeError(f"could not draw {per_kind} {kind} prompts the benchmark guard allows")
            text, meta = make_prompt(kind, sources, rng, settings)
            if not guard.allows(text):
                continue
            turns = [text] + ([meta["follow_up"]] if "follow_up" in meta else [])
            rows.append({"question_id": f"heldout-{kind}-{made}", "category": kind, "turns": turns,
                         "doc_id": meta.get("doc_id", "")})
            made += 1
    return rows


def write_evaluation_set(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path


def kind_of(label: str) -> str:
    """The task kind of a sequence label recorded in chunk stats ("translate+follow_up" -> "translate")."""
    return label.split("+", 1)[0]


def kept_sequences(labels: list[str], excluded: frozenset[str]) -> list[bool]:
    """Per sequence of a chunk, whether training keeps it (its kind is not held out)."""
    return [kind_of(label) not in excluded for label in labels]
