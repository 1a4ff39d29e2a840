"""`treeserve train-eagle3`: train (or continue) the EAGLE-3 drafter on the self-distillation corpus."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from treeserve.engine.dev_prompts import REPO_ROOT
from treeserve.engine.devices import check_device, device_name
from treeserve.engine.drafters.models.eagle3 import is_eagle3_drafter
from treeserve.engine.drafters.models.formats import default_feature_layers
from treeserve.engine.drafters.registry import SHIPPED
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.models.paths import cache_root
from treeserve.tools.training.corpus import DEFAULT_CORPUS_DIR, compute_chunk_features, corpus_summary, features_path
from treeserve.tools.training.broad_mix import BROAD_KINDS
from treeserve.tools.training.eagle3 import Eagle3TrainConfig, load_corpus, train_eagle3
from .options import add_dataclass_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="default", help="target model: 'default', a model directory or a .gguf")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS_DIR,
                        help=f"corpus directory written by `treeserve make-corpus` "
                             f"(default: {DEFAULT_CORPUS_DIR.relative_to(REPO_ROOT)})")
    parser.add_argument("--features-dir", type=Path, default=None,
                        help="cached target features of the corpus (default: <cache>/corpus_features/<corpus name>); "
                             "chunks without them are computed first")
    parser.add_argument("--out", type=Path, default=SHIPPED["eagle3"].directory,
                        help=f"where the drafter is written (default: the shipped {SHIPPED['eagle3'].directory.name})")
    parser.add_argument("--max-chunks", type=int, default=None, help="train on the first N chunks only")
    parser.add_argument("--exclude-kinds", nargs="*", choices=BROAD_KINDS, default=[],
                        help="task kinds whose sequences are left out of training (a held-out evaluation: measure "
                             "them with `treeserve agreement --also-prompts FILE` from `make-corpus --held-out-eval`)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    parser.add_argument("--device", default="cpu",
                        help="torch device of the target, the corpus and the drafter while training: cpu or "
                             "cuda[:N] (default: cpu)")
    add_dataclass_options(parser, Eagle3TrainConfig, "EAGLE-3 training")


def run(args: argparse.Namespace) -> int:
    import torch

    config = Eagle3TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Eagle3TrainConfig)})
    previous = None  # read now: --out may be the --init-from directory
    if config.init_from and (Path(config.init_from) / "training.json").is_file():
        previous = json.loads((Path(config.init_from) / "training.json").read_text())
    if config.ttt_steps < 1 or config.draft_vocab_size < 2 or config.minutes <= 0:
        raise ValueError("--ttt-steps must be >= 1, --draft-vocab-size >= 2 and --minutes > 0")
    if config.init_from and not is_eagle3_drafter(Path(config.init_from)):
        raise ValueError(f"--init-from {config.init_from} is not an EAGLE-3 drafter directory")
    check_device(args.device)
    chunks = sorted(args.corpus.glob("chunk-*.safetensors"))[:args.max_chunks]
    if not chunks:
        raise FileNotFoundError(f"no corpus chunks in {args.corpus}; run `treeserve make-corpus` first")
    torch.set_num_threads(args.threads)
    target = load_causal_lm(args.target, args.device)
    features_dir = args.features_dir or cache_root() / "corpus_features" / args.corpus.name
    layers = default_feature_layers(target.model.config.num_hidden_layers)
    started = time.time()
    for chunk in chunks:
        if not features_path(features_dir, chunk).is_file():
            compute_chunk_features(target.model, chunk, features_dir, layers)
    feature_minutes = (time.time() - started) / 60
    corpus = load_corpus(chunks, features_dir, args.device, frozenset(args.exclude_kinds))
    specials = sorted({target.tokenizer.eos_token_id, *target.tokenizer.all_special_ids})
    drafter, stats = train_eagle3(target.model, corpus, config, specials)
    totals = corpus_summary(args.corpus, chunks)
    card = {"target": str(args.target), "corpus": args.corpus.name, "corpus_chunks_used": len(chunks),
            "excluded_kinds": sorted(args.exclude_kinds),
            "corpus_totals": {k: v for k, v in totals.items() if k != "kinds"},
            # A continued drafter's earlier runs, so its card can name every command that made it.
            "continued_from": previous,
            "feature_minutes": round(feature_minutes, 1), "training": stats, "device": device_name(args.device),
            "config": {**dataclasses.asdict(config),
                       "init_from": Path(config.init_from).name if config.init_from else ""}}
    drafter.save(args.out, card={"training": stats})
    (args.out / "training.json").write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps(stats, indent=2))
    print(f"EAGLE-3 drafter written to {args.out}; measure it with `treeserve agreement --drafter {args.out}`")
    return 0
