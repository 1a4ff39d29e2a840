"""`treeserve make-corpus`: the target answers >= 10k diverse conversations (resumable chunks on disk)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from treeserve.engine.dev_prompts import DEV_PROMPTS, REPO_ROOT
from treeserve.engine.devices import check_device
from treeserve.engine.drafters.models.compatibility import default_feature_layers
from treeserve.engine.models.loading import cache_root, load_causal_lm
from treeserve.engine.training.corpus import DEFAULT_CORPUS_DIR, CorpusConfig, build_corpus, corpus_summary
from treeserve.engine.training.prompt_mix import evaluation_texts
from .options import add_dataclass_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="default", help="target model: 'default', a model directory or a .gguf")
    parser.add_argument("--out", type=Path, default=DEFAULT_CORPUS_DIR,
                        help=f"corpus directory; existing chunks are kept and the next missing one is generated, "
                             f"with its corpus.json's settings wherever a corpus option below is not given "
                             f"(default: {DEFAULT_CORPUS_DIR.relative_to(REPO_ROOT)})")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 leaves a core free on a 2-core box; default: 1)")
    parser.add_argument("--device", default="cpu",
                        help="torch device of the target: cpu or cuda[:N] (a GPU takes a far larger --batch-size; "
                             "the batch size may differ from the corpus's recipe) (default: cpu)")
    parser.add_argument("--max-chunks", type=int, default=None,
                        help="stop after generating this many new chunks (default: until the corpus is complete)")
    parser.add_argument("--summary", action="store_true", help="only print the totals of the chunks on disk")
    parser.add_argument("--feature-layers", type=int, nargs="*", default=None,
                        help="target hidden_states indices captured while generating and cached for EAGLE-3 "
                             "training (default: EAGLE-3's 2, N/2, N-3; none given: no capture)")
    parser.add_argument("--features-dir", type=Path, default=None,
                        help="where captured features are cached (default: <cache>/corpus_features/<corpus name>)")
    add_dataclass_options(parser, CorpusConfig, "corpus")
    # Unset corpus options resume the recipe of an existing corpus (see `corpus_config`).
    parser.set_defaults(**{f.name: None for f in dataclasses.fields(CorpusConfig)})


def corpus_config(args: argparse.Namespace) -> CorpusConfig:
    """The corpus settings: those given on the command line, the rest from the recipe of the corpus at
    `--out` when one exists (so a bare `treeserve make-corpus` resumes it), else CorpusConfig's defaults."""
    recipe = args.out / "corpus.json"
    saved = json.loads(recipe.read_text()) if recipe.is_file() else {}
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(CorpusConfig) if getattr(args, f.name) is not None}
    config = CorpusConfig(**{**{k: v for k, v in saved.items() if k in CorpusConfig.__dataclass_fields__}, **given})
    if config.batch_size < 1 or config.chunk_size < 1 or config.num_conversations < 1:
        raise ValueError("--batch-size, --chunk-size and --num-conversations must be >= 1")
    return config


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    if args.summary:
        print(json.dumps(corpus_summary(args.out), indent=2))
        return 0
    config = corpus_config(args)
    check_device(args.device)
    torch.set_num_threads(args.threads)
    target = load_causal_lm(args.target)
    # SDPA: generation needs no tree mask, and batched decoding is faster under it than under eager.
    model = AutoModelForCausalLM.from_pretrained(target.path, local_files_only=True, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval().to(args.device)
    layers = (default_feature_layers(model.config.num_hidden_layers) if args.feature_layers is None
              else tuple(args.feature_layers))
    features_dir = args.features_dir or cache_root() / "corpus_features" / args.out.name
    build_corpus(model, target.tokenizer, config, args.out, exclude=evaluation_texts(DEV_PROMPTS),
                 max_chunks=args.max_chunks, features_dir=features_dir if layers else None,
                 feature_layers=layers or None)
    totals = corpus_summary(args.out)
    print(json.dumps({k: v for k, v in totals.items() if k != "kinds"}, indent=2))
    return 0
