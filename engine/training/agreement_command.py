"""`treeserve agreement`: how often the drafter's top-1 / top-k equals the target's greedy next token.

The target greedily answers each prompt (first turn, chat template); the drafter is then teacher-forced on
the same sequence, and at every answer position its top-1 and top-k are compared with the target's
token. This is the per-token acceptance a greedy chain sees, measured on prompts the drafter never saw.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# The vendored Spec-Bench dev questions (benchmarks/data/README.md), inside the checkout: this file is
# engine/training/agreement_command.py, so parents[2] is the repository root.
REPO_ROOT = Path(__file__).resolve().parents[2]
DEV_PROMPTS = REPO_ROOT / "benchmarks" / "data" / "spec_bench_dev.jsonl"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="default", help="target model ('default', a directory or .gguf)")
    parser.add_argument("--drafter", nargs="+", default=None,
                        help="drafter(s): shipped names (default, eagle, eagle3) or directories; several are compared "
                             "on the same target answers (default: every shipped drafter)")
    parser.add_argument("--depth", type=int, default=5,
                        help="report the acceptance rate at chain depth 1..DEPTH given the tokens before were "
                             "accepted (EAGLE-3's n-alpha table; default: 5)")
    parser.add_argument("--prompts", type=Path, default=DEV_PROMPTS, help="Spec-Bench-format jsonl")
    parser.add_argument("--num-prompts", type=int, default=80, help="prompts used (balanced over categories)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="target tokens generated per prompt")
    parser.add_argument("--top-k", type=int, default=4, help="also report top-k agreement")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--write-card", action="store_true",
                        help="(re)write the drafter directory's README.md model card with this measurement "
                             "(one drafter only)")


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


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from treeserve.engine.models.drafter import SHIPPED_DRAFTERS, drafter_dir, load_drafter
    from treeserve.engine.models.loading import chat_ids, load_causal_lm
    from treeserve.engine.training.chain_acceptance import ChainCounts, chain_hits, target_features

    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.top_k < 1 or args.depth < 1:
        raise ValueError("--num-prompts, --max-new-tokens, --top-k and --depth must be >= 1")
    if args.drafter is None:
        args.drafter = [n for n in SHIPPED_DRAFTERS if (drafter_dir(n) / "config.json").is_file()]
    if args.write_card and len(args.drafter) != 1:
        raise ValueError("--write-card takes exactly one --drafter")
    target = load_causal_lm(args.target)
    drafters = {name: load_drafter(name, target.model) for name in args.drafter}
    counts = {name: Counts() for name in drafters}
    chains = {name: ChainCounts(args.depth) for name in drafters}
    with torch.inference_mode():
        for row in tqdm(load_prompts(args.prompts, args.num_prompts), desc="agreement"):
            ids = chat_ids(target.tokenizer, row["turns"][0])
            out = target.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=args.max_new_tokens,
                                        do_sample=False, top_p=None, top_k=None, temperature=None)[0]
            for name, drafter in drafters.items():
                counts[name].add(drafter, out, len(ids), args.top_k, row.get("category", "all"), target.model)
                features = (target_features(target.model, drafter, out)
                            if getattr(drafter, "reads_target_features", False) else None)
                chains[name].add(*chain_hits(drafter, out, len(ids), args.depth, features))
    for name, c in counts.items():
        result = {**c.result(args), "acceptance_by_depth": chains[name].rates()}
        if args.write_card:
            from treeserve.engine.models.drafter import drafter_dir
            from treeserve.engine.training.model_card import write_drafter_card

            write_drafter_card(drafter_dir(name), result, args, name)
        label = f"{name}: " if len(counts) > 1 else ""
        print(json.dumps({"drafter": name, **result}) if args.json else
              f"{label}{c.total} positions over {args.num_prompts} prompts: top-1 agreement "
              f"{c.hit1 / c.total:.1%}, top-{args.top_k} {c.hitk / c.total:.1%}; top-1 by category: "
              + ", ".join(f"{k} {v:.0%}" for k, v in result["top1_by_category"].items()))
    if not args.json:
        print(depth_table(chains, args.depth))
    return 0


def depth_table(chains: dict, depth: int) -> str:
    """Markdown table: acceptance at chain depth 1..depth (EAGLE-3's n-alpha, n = depth - 1) per drafter."""
    head = "| drafter | " + " | ".join(f"depth {d} ({d - 1}-alpha)" for d in range(1, depth + 1)) + " |"
    lines = [head, "|---" * (depth + 1) + "|"]
    for name, counts in chains.items():
        cells = [f"{r:.1%} ({n})" if r is not None else "-" for r, n in zip(counts.rates(), counts.reached)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


class Counts:
    """Top-1 / top-k hits of one drafter over the target's answer positions."""

    def __init__(self) -> None:
        self.hit1 = self.hitk = self.total = 0
        self.per_category: dict[str, list[int]] = {}

    def add(self, drafter, sequence, prompt_len: int, top_k: int, category: str, target=None) -> None:
        """Teacher-force `drafter` on prompt + target answer `sequence` [T] and count its hits (`target`: the
        target model, whose features an EAGLE drafter reads)."""
        import torch

        answer = sequence[prompt_len:]
        inputs = {"input_ids": sequence[None, :-1]}
        if getattr(drafter, "reads_target_features", False):
            # EAGLE: every position reads the target's feature of the position before (the first token
            # of a draft tree, whose parent is the root, sees exactly this); EAGLE-3 fuses several layers.
            from treeserve.engine.training.chain_acceptance import target_features

            features = target_features(target, drafter, sequence[:-1])[None]
            if hasattr(drafter, "project_target_features"):
                features = drafter.project_target_features(features)
            inputs["parent_features"] = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)
        logits = drafter(**inputs).logits[0, prompt_len - 1:]
        top = logits.topk(top_k, dim=-1).indices
        vocab_ids = getattr(drafter, "vocab_ids", None)
        if vocab_ids is not None:
            top = vocab_ids[top]
        hits = int((top[:, 0] == answer).sum())
        self.hit1 += hits
        self.hitk += int((top == answer[:, None]).any(-1).sum())
        self.total += len(answer)
        cat = self.per_category.setdefault(category, [0, 0])
        cat[0] += hits
        cat[1] += len(answer)

    def result(self, args) -> dict:
        return {"prompts": args.num_prompts, "positions": self.total, "max_new_tokens": args.max_new_tokens,
                "top1": round(self.hit1 / self.total, 4), f"top{args.top_k}": round(self.hitk / self.total, 4),
                "top1_by_category": {k: round(h / n, 4) for k, (h, n) in sorted(self.per_category.items())}}
