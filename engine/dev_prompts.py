"""The vendored Spec-Bench dev questions (benchmarks/data/README.md) and a category-balanced loader.

Read by the bench, the agreement measurements, drafter checks and training's held-out evaluations; never used
as training data.
"""

from __future__ import annotations

import json
from pathlib import Path

# Inside the checkout: this file is engine/dev_prompts.py, so parents[1] is the repository root.
REPO_ROOT = Path(__file__).resolve().parents[1]
DEV_PROMPTS = REPO_ROOT / "benchmarks" / "data" / "spec_bench_dev.jsonl"


def load_prompts(path: Path, limit: int) -> list[dict]:
    """At most `limit` rows of a Spec-Bench-format jsonl, in file order, balanced over categories.

    Categories take turns adding a prompt until `limit` is reached (one that runs out drops out), and
    within a category the picks are spread over its rows. Spec-Bench's dev file holds 10 rows in eight
    categories and 80 in two, so a stride over the file gave 20 prompts of which 13 were qa /
    math_reasoning, one each for seven categories and none for extraction: per-category speedups were
    single-prompt readings, one category unmeasured."""
    if not path.is_file():
        hint = " (the checkout's benchmarks/data; pass --prompts FILE)" if Path(path) == DEV_PROMPTS else ""
        raise FileNotFoundError(f"prompt file {path} does not exist{hint}")
    if limit < 1:
        raise ValueError(f"the number of prompts must be >= 1, got {limit}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if limit >= len(rows):
        return rows
    groups: dict[str, list[int]] = {}
    for index, row in enumerate(rows):
        groups.setdefault(row.get("category", "all"), []).append(index)
    quota = dict.fromkeys(groups, 0)
    left = limit
    while left:
        for category, members in groups.items():
            if left and quota[category] < len(members):
                quota[category] += 1
                left -= 1
    picked = [members[int(j * len(members) / quota[category])]
              for category, members in groups.items() for j in range(quota[category])]
    return [rows[i] for i in sorted(picked)]
