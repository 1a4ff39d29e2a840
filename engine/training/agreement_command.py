"""`treeserve agreement`: how often the drafter's top-1 / top-k equals the target's greedy next token.

The target greedily answers each prompt (first turn, chat template); the drafter is then teacher-forced on
the same sequence, and at every answer position its top-1 and top-k are compared with the target's
token. This is the per-token acceptance a greedy chain sees, measured on prompts the drafter never saw.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEV_PROMPTS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "spec_bench_dev.jsonl"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="default", help="target model ('default', a directory or .gguf)")
    parser.add_argument("--drafter", default="default", help="drafter ('default' or a directory)")
    parser.add_argument("--prompts", type=Path, default=DEV_PROMPTS, help="Spec-Bench-format jsonl")
    parser.add_argument("--num-prompts", type=int, default=80, help="prompts used (spread over categories)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="target tokens generated per prompt")
    parser.add_argument("--top-k", type=int, default=4, help="also report top-k agreement")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--write-card", action="store_true",
                        help="(re)write the drafter directory's README.md model card with this measurement")


def load_prompts(path: Path, limit: int) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if limit < len(rows):
        step = len(rows) / limit  # spread over the file, hence over categories
        rows = [rows[int(i * step)] for i in range(limit)]
    return rows


def run(args: argparse.Namespace) -> int:
    import torch

    from treeserve.engine.models.drafter import load_drafter
    from treeserve.engine.models.loading import load_causal_lm

    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.top_k < 1:
        raise ValueError("--num-prompts, --max-new-tokens and --top-k must be >= 1")
    target = load_causal_lm(args.target)
    drafter = load_drafter(args.drafter, target.model)
    vocab_ids = getattr(drafter, "vocab_ids", None)
    hit1 = hitk = total = 0
    per_category: dict[str, list[int]] = {}
    with torch.inference_mode():
        for row in load_prompts(args.prompts, args.num_prompts):
            ids = target.tokenizer.apply_chat_template([{"role": "user", "content": row["turns"][0]}],
                                                       add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"]
            out = target.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=args.max_new_tokens,
                                        do_sample=False, top_p=None, top_k=None, temperature=None)[0]
            answer = out[len(ids):]
            logits = drafter(input_ids=out[None, :-1]).logits[0, len(ids) - 1:]
            top = logits.topk(args.top_k, dim=-1).indices
            if vocab_ids is not None:
                top = vocab_ids[top]
            hits = int((top[:, 0] == answer).sum())
            hit1 += hits
            hitk += int((top == answer[:, None]).any(-1).sum())
            total += len(answer)
            cat = per_category.setdefault(row.get("category", "all"), [0, 0])
            cat[0] += hits
            cat[1] += len(answer)
    result = {"prompts": args.num_prompts, "positions": total, "max_new_tokens": args.max_new_tokens,
              "top1": round(hit1 / total, 4), f"top{args.top_k}": round(hitk / total, 4),
              "top1_by_category": {k: round(h / n, 4) for k, (h, n) in sorted(per_category.items())}}
    if args.write_card:
        from treeserve.engine.models.drafter import DEFAULT_DRAFTER_DIR
        from treeserve.engine.training.model_card import write_drafter_card

        directory = DEFAULT_DRAFTER_DIR if args.drafter == "default" else Path(args.drafter)
        write_drafter_card(directory, result, args)
    print(json.dumps(result) if args.json else
          f"{total} positions over {args.num_prompts} prompts: top-1 agreement {hit1 / total:.1%}, "
          f"top-{args.top_k} {hitk / total:.1%}; top-1 by category: "
          + ", ".join(f"{k} {v:.0%}" for k, v in result["top1_by_category"].items()))
    return 0
