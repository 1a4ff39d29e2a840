"""Build the long-prompt evaluation set (issue 60 item 4): `benchmarks/data/long_prompts.jsonl`, Spec-Bench format.

The prompts are of kinds neither the dev set (benchmarks/data/spec_bench_dev.jsonl) nor the drafter's training
corpus holds, and are built from text neither contains: the long descriptions (README files) of Python packages the
project installs, read from their installed metadata (`importlib.metadata`; each under its package's licence,
listed in benchmarks/data/README.md). Three kinds, two thirds of them long as served traffic on a summarising or
retrieval-augmented product is:

- `summarise`: one package's description, a window of 450-850 tokens, "summarise it in a few sentences".
- `retrieval_qa`: four passages of 150-230 tokens from four packages, a question about one of them (which package
  does a thing the relevant passage states), the others distractors.
- `translate`: one sentence of a description, into French, German or Spanish (short prompts).

Deterministic for a given set of installed packages (a seeded shuffle); the committed file is the set the
measurements in docs/performance.md used. Prompt lengths are counted with the embedded model's tokenizer, chat
template included, and kept under the local layout's `limits.max_prompt_tokens` (1024):

    python benchmarks/long_prompts.py [--per-kind 8] [--out benchmarks/data/long_prompts.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from importlib import metadata
from pathlib import Path

from transformers import AutoTokenizer

from treeserve.engine.models.loading import chat_ids, resolve_model_dir

# Packages the project's own install brings (so every machine that runs TreeServe has them), with long READMEs.
PACKAGES = ("aiohttp", "attrs", "charset_normalizer", "fastapi", "frozenlist", "fsspec", "h11", "httpx2",
            "huggingface_hub", "mpmath", "opencensus", "propcache", "pydantic", "python_dotenv", "rich",
            "smart_open", "sympy", "tqdm", "typer", "xgrammar", "yarl")
LANGUAGES = ("French", "German", "Spanish")
MAX_PROMPT_TOKENS = 1000  # templated; deploy/local-cpu.yaml refuses prompts over 1024
MARKUP = re.compile(r"^\s*(\[!|!\[|<|\.\. |\||```|:|=+$|-+$|\*+$|#+\s*$)")
URL = re.compile(r"https?://\S+")


def description(package: str) -> str:
    """A package's long description as prose: markup-only lines, code fences' contents and URLs dropped."""
    text = metadata.distribution(package).metadata.get_payload() or ""
    lines, in_code = [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            in_code = not in_code
            continue
        if in_code or MARKUP.match(line):
            continue
        line = URL.sub("", line).rstrip()
        lines.append(line.lstrip("# "))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if len(p.split()) >= 12 and p.count("@") <= 2]  # not contributor lists


def window(paras: list[str], start: int, tokenizer, low: int, high: int) -> str | None:
    """Paragraphs from `start` on while the text stays under `high` tokens; None if it never reaches `low`."""
    chosen = []
    for para in paras[start:]:
        if len(tokenizer.encode("\n\n".join(chosen + [para]))) > high:
            break
        chosen.append(para)
    text = "\n\n".join(chosen)
    return text if chosen and len(tokenizer.encode(text)) >= low else None


def build(per_kind: int, tokenizer, seed: int) -> list[dict]:
    rng = random.Random(seed)
    docs = {p: paragraphs(description(p)) for p in PACKAGES}
    docs = {p: paras for p, paras in docs.items() if paras}
    names = sorted(docs)
    rows: list[dict] = []

    summaries = []
    for package in rng.sample(names, len(names)):
        text = window(docs[package], 0, tokenizer, 450, 850)
        if text:
            summaries.append(f"Here is the description of a software project.\n\n{text}\n\nSummarise this "
                             "description in four or five sentences for a reader who has never used the project.")
    rows += [{"category": "summarise", "turns": [t]} for t in summaries[:per_kind]]

    questions = []
    for _ in range(per_kind * 4):
        chosen = rng.sample(names, 4)
        passages = [window(docs[p], rng.randrange(max(1, len(docs[p]) // 2)), tokenizer, 150, 230) for p in chosen]
        if any(p is None for p in passages):
            continue
        relevant = rng.randrange(4)
        first = passages[relevant].split(". ")[0][:160]
        body = "\n\n".join(f"Passage {i + 1}:\n{p}" for i, p in enumerate(passages))
        questions.append(f"Answer the question from the passages below; only some of them are relevant.\n\n{body}\n\n"
                         f"Question: which passage says \"{first}\", and what does the software it describes do? "
                         "Explain briefly, citing the passage.")
        if len(questions) == per_kind:
            break
    rows += [{"category": "retrieval_qa", "turns": [q]} for q in questions]

    sentences = [s.strip() for p in names for para in docs[p] for s in re.split(r"(?<=[.!?])\s+", para)
                 if 12 <= len(s.split()) <= 30 and "`" not in s]
    for sentence in rng.sample(sentences, per_kind):
        rows.append({"category": "translate",
                     "turns": [f"Translate this sentence into {rng.choice(LANGUAGES)}:\n\n{sentence}"]})

    kept = [r for r in rows if len(chat_ids(tokenizer, r["turns"][0])) <= MAX_PROMPT_TOKENS]
    return [{"question_id": 9000 + i, **r} for i, r in enumerate(kept)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-kind", type=int, default=8)
    parser.add_argument("--seed", type=int, default=60)
    parser.add_argument("--out", default=str(Path(__file__).parent / "data" / "long_prompts.jsonl"))
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("default"), local_files_only=True)
    rows = build(args.per_kind, tokenizer, args.seed)
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    for kind in ("summarise", "retrieval_qa", "translate"):
        lengths = sorted(len(chat_ids(tokenizer, r["turns"][0])) for r in rows if r["category"] == kind)
        print(f"{kind}: {len(lengths)} prompts, {lengths[0]}-{lengths[-1]} tokens")


if __name__ == "__main__":
    main()
