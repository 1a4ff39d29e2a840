"""`treeserve train-c2t`: label full EAGLE-2 trees with the target, train the C2T classifier, save it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from pathlib import Path

from treeserve.engine.drafters.loading import drafter_classifier_path
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.drafters.models.loading import load_drafter, target_feature_layers
from treeserve.engine.models.loading import chat_ids, load_causal_lm
from treeserve.engine.runners.target import TargetRunner
from treeserve.tools.training import prompts as sources
from treeserve.tools.training.c2t import C2TTrainConfig, collect, train_classifier
from treeserve.tools.training.prompts import prompt_texts
from .options import add_dataclass_options


BUILT_IN_SOURCES = "built-in: Python docs passages, HumanEval prompts, Debian text packages if installed (never the dev set)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="default", help="target model ('default', a directory or .gguf)")
    parser.add_argument("--drafter", default="distilled",
                        help="drafter: a shipped name ('distilled', 'eagle', 'eagle3') or a directory")
    parser.add_argument("--out", type=Path, default=None,
                        help="classifier file (default: the drafter's own, c2t.safetensors in its directory, "
                             "which the engine then uses for that drafter)")
    parser.add_argument("--num-prompts", type=int, default=150,
                        help="training prompts (Python docs, HumanEval, Debian text; never the dev set)")
    parser.add_argument("--prompts-file", type=Path, default=None,
                        help="JSON list of prompt texts to label instead of the built-in sources (e.g. the "
                             "prompts.json of a `train-drafter` data directory; never the dev set)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    add_dataclass_options(parser, C2TTrainConfig, "classifier")


def run(args: argparse.Namespace) -> int:
    import torch

    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    given = prompt_texts(args.prompts_file) if args.prompts_file is not None else None  # before model loading
    torch.set_num_threads(args.threads)
    config = C2TTrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(C2TTrainConfig)})
    target = load_causal_lm(args.target)
    drafter = load_drafter(args.drafter, target.model)
    rng = random.Random(config.seed + 7)
    texts = given if given is not None else (sources.pydoc_passages(rng, 1000) + sources.humaneval_prompts(1000)
                                             + sources.debian_text_prompts(rng, 1000))
    rng.shuffle(texts)
    prompts = [chat_ids(target.tokenizer, t)[-384:] for t in texts[:args.num_prompts]]
    eos = {target.tokenizer.eos_token_id}
    # The target returns the features the drafter reads (an EAGLE-3 head: its fused layers, not the final state).
    layers = target_feature_layers(str(args.drafter), target.model.config.num_hidden_layers)
    features, labels = collect(TargetRunner(target.model, feature_layers=layers),
                               DrafterRunner(drafter, target.model.config.vocab_size), prompts, config, eos)
    model, stats = train_classifier(features, labels, config)
    if args.out is None:
        args.out = drafter_classifier_path(args.drafter)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model.save(args.out)
    card = {"prompts": min(args.num_prompts, len(texts)), "prompt_source": str(args.prompts_file or BUILT_IN_SOURCES),
            "drafter": str(args.drafter), "config": dataclasses.asdict(config), **stats}
    args.out.with_suffix(".json").write_text(json.dumps(card, indent=2))
    print(f"classifier written to {args.out}")
    return 0
