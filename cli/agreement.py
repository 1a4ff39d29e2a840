"""`treeserve agreement`: how often the drafter's top-1 / top-k equals the target's greedy next token.

The target greedily answers each prompt (first turn, chat template); the drafter is then teacher-forced on
the same sequence, and at every answer position its top-1 and top-k are compared with the target's
token (tools/training/agreement.py). This is the per-token acceptance a greedy chain sees, measured on
prompts the drafter never saw.

`--kind parallel` measures a parallel drafter instead, per position 1..k+1 of one forward (position j+1 reads
[MASK]_j; tools/training/parallel.py dev_agreement), printed as one JSON object.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from treeserve.engine.dev_prompts import DEV_PROMPTS, load_prompts
from treeserve.engine.drafters.registry import SHIPPED_NAMES, drafter_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=["autoregressive", "parallel"], default="autoregressive",
                        help="drafter kind: 'autoregressive' (top-1 / top-k per answer position, acceptance by chain "
                             "depth) or 'parallel' (one parallel drafter, agreement per position of its forward; "
                             "default --drafter parallel)")
    parser.add_argument("--target", default="default", help="target model ('default', a directory or .gguf)")
    parser.add_argument("--drafter", nargs="+", default=None,
                        help="drafter(s): shipped names (default, eagle, eagle3) or directories; several are compared "
                             "on the same target answers (default: every shipped drafter)")
    parser.add_argument("--depth", type=int, default=5,
                        help="report the acceptance rate at chain depth 1..DEPTH given the tokens before were "
                             "accepted (EAGLE-3's n-alpha table; default: 5)")
    parser.add_argument("--prompts", type=Path, default=DEV_PROMPTS, help="Spec-Bench-format jsonl")
    parser.add_argument("--num-prompts", type=int, default=80, help="prompts used (balanced over categories)")
    parser.add_argument("--also-prompts", type=Path, default=None,
                        help="a second Spec-Bench-format jsonl measured in the same run and reported beside the dev "
                             "prompts, per category (the held-out kinds of `make-corpus --held-out-eval FILE`)")
    parser.add_argument("--also-num-prompts", type=int, default=40,
                        help="prompts used from --also-prompts (balanced over its categories; default: 40)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="target tokens generated per prompt")
    parser.add_argument("--top-k", type=int, default=4, help="also report top-k agreement")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--write-card", action="store_true",
                        help="(re)write the drafter directory's README.md model card with this measurement "
                             "(one drafter only)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from treeserve.engine.drafters.models.base import DrafterModel
    from treeserve.engine.drafters.models.loading import load_drafter
    from treeserve.engine.models.loading import chat_ids, load_causal_lm
    from treeserve.tools.training.agreement import Counts, depth_table, greedy_sequence
    from treeserve.tools.training.chain_acceptance import ChainCounts, chain_hits, target_features

    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.top_k < 1 or args.depth < 1:
        raise ValueError("--num-prompts, --max-new-tokens, --top-k and --depth must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.kind == "parallel":
        return run_parallel(args)
    if args.drafter is None:
        args.drafter = [n for n in SHIPPED_NAMES if (drafter_dir(n) / "config.json").is_file()]
    if args.write_card and len(args.drafter) != 1:
        raise ValueError("--write-card takes exactly one --drafter")
    target = load_causal_lm(args.target)
    drafters = {name: load_drafter(name, target.model) for name in args.drafter}
    counts = {name: Counts() for name in drafters}
    chains = {name: ChainCounts(args.depth) for name in drafters}
    also = load_prompts(args.also_prompts, args.also_num_prompts) if args.also_prompts else []
    also_counts = {name: Counts() for name in drafters}
    with torch.inference_mode():
        for row in tqdm(load_prompts(args.prompts, args.num_prompts), desc="agreement"):
            ids = chat_ids(target.tokenizer, row["turns"][0])
            out = greedy_sequence(target.model, ids, args.max_new_tokens)
            for name, drafter in drafters.items():
                counts[name].add(drafter, out, len(ids), args.top_k, row.get("category", "all"), target.model)
                features = (target_features(target.model, drafter, out)
                            if isinstance(drafter, DrafterModel) and drafter.reads_target_features else None)
                chains[name].add(*chain_hits(drafter, out, len(ids), args.depth, features))
        # The held-out prompts: counted apart, so the dev figure stays comparable with earlier runs.
        for row in tqdm(also, desc="agreement (also)"):
            ids = chat_ids(target.tokenizer, row["turns"][0])
            out = greedy_sequence(target.model, ids, args.max_new_tokens)
            for name, drafter in drafters.items():
                also_counts[name].add(drafter, out, len(ids), args.top_k, row.get("category", "all"), target.model)
    for name, c in counts.items():
        result = {**c.result(args.num_prompts, args.max_new_tokens, args.top_k), "acceptance_by_depth": chains[name].rates()}
        if also:
            result["also"] = {"prompts_file": str(args.also_prompts),
                              **also_counts[name].result(len(also), args.max_new_tokens, args.top_k)}
        if args.write_card:
            from treeserve.tools.training.model_card import write_drafter_card

            write_drafter_card(drafter_dir(name), result, args, name)
        label = f"{name}: " if len(counts) > 1 else ""
        print(json.dumps({"drafter": name, **result}) if args.json else
              f"{label}{c.total} positions over {args.num_prompts} prompts: top-1 agreement "
              f"{c.hit1 / c.total:.1%}, top-{args.top_k} {c.hitk / c.total:.1%}; top-1 by category: "
              + ", ".join(f"{k} {v:.0%}" for k, v in result["top1_by_category"].items())
              + (f"\n{label}beside them, {args.also_prompts.name}: top-1 {result['also']['top1']:.1%} over "
                 f"{result['also']['positions']} positions; by category: "
                 + ", ".join(f"{k} {v:.0%}" for k, v in result["also"]["top1_by_category"].items()) if also else ""))
    if not args.json:
        print(depth_table(chains, args.depth))
    return 0


def run_parallel(args: argparse.Namespace) -> int:
    """`--kind parallel`: per-position agreement of one parallel drafter, as JSON."""
    from treeserve.engine.drafters.models.loading import load_parallel_drafter
    from treeserve.engine.models.loading import load_causal_lm
    from treeserve.tools.training.parallel import dev_agreement

    drafters = args.drafter or ["parallel"]
    if len(drafters) != 1 or args.write_card:
        raise ValueError("--kind parallel measures exactly one --drafter and writes no card")
    target = load_causal_lm(args.target)
    drafter = load_parallel_drafter(drafters[0], target.model)
    result = dev_agreement(target.model, target.tokenizer, drafter, load_prompts(args.prompts, args.num_prompts),
                           args.max_new_tokens, args.top_k)
    print(json.dumps(result))
    return 0
