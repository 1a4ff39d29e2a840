"""`treeserve tune-c2t`: choose a trained C2T classifier's confidence threshold beta against EAGLE-2 on tuning
prompts (never the dev set), and record it in the classifier and its card (tools/training/c2t_tune.py)."""

from __future__ import annotations

import argparse
import warnings
from dataclasses import asdict
from pathlib import Path

from treeserve.engine.c2t_classifier import C2TClassifier
from treeserve.engine.drafters.loading import drafter_classifier_path
from treeserve.engine.drafters.registry import DEFAULT_DRAFTER  # torch-free
from treeserve.engine.factory import build_engine
from treeserve.tools.training.c2t_tune import DEFAULT_BETAS, TUNING_PROMPTS, choose_beta, record_beta, sweep_betas
from treeserve.tools.training.prompts import prompt_texts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="default", help="target model ('default', a directory or .gguf)")
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER,
                        help="drafter: a shipped one ('eagle3', 'eagle', 'distilled') or a directory (default: %(default)s)")
    parser.add_argument("--classifier", type=Path, default=None,
                        help="classifier file to tune and rewrite (default: the drafter's own c2t.safetensors)")
    parser.add_argument("--prompts-file", type=Path, default=None,
                        help="JSON list of tuning prompt texts (default: the built-in hand-written ones; never "
                             "the dev set)")
    parser.add_argument("--betas", type=float, nargs="+", default=list(DEFAULT_BETAS), help="thresholds to try")
    parser.add_argument("--budget", type=int, default=32, help="EAGLE-2's budget (the reference)")
    parser.add_argument("--c2t-budget", type=int, default=None, help="C2T's node cap (default: --budget)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per prompt")
    parser.add_argument("--candidate-fraction", type=float, default=0.8,
                        help="C2T may send at most this fraction of the reference's candidates per step")
    parser.add_argument("--dry-run", action="store_true", help="print the sweep, write nothing")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")


def run(args: argparse.Namespace) -> int:
    import torch

    if not all(0.0 < b < 1.0 for b in args.betas):
        raise ValueError(f"--betas must lie in (0, 1), got {args.betas}")
    cap = args.budget if args.c2t_budget is None else args.c2t_budget
    if min(args.budget, cap, args.max_new_tokens) < 1:
        raise ValueError("--budget, --c2t-budget and --max-new-tokens must be >= 1")
    if not 0.0 < args.candidate_fraction <= 1.0:
        raise ValueError(f"--candidate-fraction must lie in (0, 1], got {args.candidate_fraction}")
    texts = prompt_texts(args.prompts_file) if args.prompts_file is not None else list(TUNING_PROMPTS)
    path = args.classifier or drafter_classifier_path(args.drafter)
    if not path.is_file():
        raise FileNotFoundError(f"no classifier at {path}: train one with `treeserve train-c2t` first")
    classifier = C2TClassifier.load(path)
    torch.set_num_threads(args.threads)
    engine = build_engine(drafter_path=args.drafter, method="c2t", budget=cap, target_path=args.target)
    prompts = [engine.encode_chat(t) for t in texts]
    reference, sweep = sweep_betas(engine, prompts, args.budget, cap, args.betas, path, args.max_new_tokens)
    beta, reached = choose_beta(reference, sweep, args.candidate_fraction)
    print(f"eagle2:{args.budget}: MAL {reference.mal:.3f}, {reference.candidates:.1f} candidates per step")
    for p in sweep:
        mark = " <- chosen" if p.beta == beta else ""
        print(f"c2t:{cap} beta {p.beta:.3f}: MAL {p.mal:.3f}, {p.candidates:.1f} candidates per step "
              f"({p.candidates / max(reference.candidates, 1e-9):.0%} of EAGLE-2's){mark}")
    if not reached:
        warnings.warn(f"no beta within {args.candidate_fraction:.0%} of EAGLE-2's candidates reached its MAL "
                      f"{reference.mal:.3f}; chose beta {beta}")
    if args.dry_run:
        return 0
    record_beta(classifier, path, beta, {
        "chosen_beta": beta, "reached_reference": reached, "candidate_fraction": args.candidate_fraction,
        "prompts": len(prompts), "prompt_source": str(args.prompts_file or "built-in hand-written (never the dev set)"),
        "max_new_tokens": args.max_new_tokens, "budget": args.budget, "c2t_budget": cap, "drafter": str(args.drafter),
        "reference": asdict(reference), "sweep": [asdict(p) for p in sweep]})
    print(f"beta {beta} written to {path}")
    return 0
