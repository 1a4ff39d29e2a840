"""`treeserve make-corpus`: the target answers >= 10k diverse conversations (resumable chunks on disk).

Beside generation, three steps that need no model (issue 61):
- `--install-sources`: apt-get install the broad mix's Debian packages (best effort, warns where it cannot);
- `--held-out-eval FILE --held-out-kinds K...`: write an evaluation set of task kinds held out of training,
  drawn from the documents reserved for evaluation, for `treeserve agreement --also-prompts FILE`;
- `--write-card`: (re)write the corpus card (sources, citations, licences, kinds, token counts) in --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from pathlib import Path

from treeserve.engine.dev_prompts import DEV_PROMPTS, REPO_ROOT
from treeserve.engine.devices import check_device
from treeserve.engine.drafters.models.formats import default_feature_layers
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.models.paths import cache_root
from treeserve.tools.training.broad_mix import BROAD_KINDS, BenchmarkGuard
from treeserve.tools.training.corpus import (BROAD_CORPUS_DIR, DEFAULT_CORPUS_DIR, LEGACY_RECIPE, CorpusConfig,
                                              build_corpus, corpus_summary)
from treeserve.tools.training.corpus_card import write_corpus_card
from treeserve.tools.training.heldout import HeldOutSplit, evaluation_rows, split_library, write_evaluation_set
from treeserve.tools.training.prompt_mix import evaluation_texts
from treeserve.tools.training.sources.install import install_sources
from treeserve.tools.training.sources.registry import SourceLibrary, load_library
from treeserve.tools.training.sources.snapshot import load_snapshot, save_snapshot
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
    sources = parser.add_argument_group("broad sources and held-out evaluation (issue 61)")
    sources.add_argument("--install-sources", action="store_true",
                         help="apt-get install the Debian packages of the broad mix's sources first (needs root; "
                              "skipped with a warning elsewhere)")
    sources.add_argument("--sources-root", type=Path, default=None,
                         help="read the sources under this directory instead of / (a fixture tree)")
    sources.add_argument("--sources-snapshot", type=Path, default=None,
                         help="a gzipped JSON-lines copy of the read sources: read from it when it exists, else "
                              "written after reading them (seconds instead of minutes; carries the sources to a "
                              "machine without them, such as one lent for its GPU)")
    sources.add_argument("--exclude-kinds", nargs="*", choices=BROAD_KINDS, default=None,
                         help="task kinds kept out of this corpus (a held-out evaluation; a recipe setting)")
    sources.add_argument("--held-out-eval", type=Path, default=None,
                         help="only write an evaluation set (Spec-Bench jsonl) of --held-out-kinds from the documents "
                              "reserved for evaluation, and exit")
    sources.add_argument("--held-out-kinds", nargs="+", choices=BROAD_KINDS, default=["translate", "retrieval_qa"],
                         help="kinds of --held-out-eval (default: translate retrieval_qa)")
    sources.add_argument("--held-out-prompts", type=int, default=20, help="prompts per held-out kind (default: 20)")
    sources.add_argument("--write-card", action="store_true",
                         help="only (re)write the corpus card CARD.md in --out from the sources here and its chunks")
    add_dataclass_options(parser, CorpusConfig, "corpus", skip=("exclude_kinds",))
    # Unset corpus options resume the recipe of an existing corpus (see `corpus_config`).
    parser.set_defaults(**{f.name: None for f in dataclasses.fields(CorpusConfig)})


def corpus_config(args: argparse.Namespace) -> CorpusConfig:
    """The corpus settings: those given on the command line, the rest from the recipe of the corpus at
    `--out` when one exists (so a bare `treeserve make-corpus` resumes it; a recipe from before a setting
    existed means LEGACY_RECIPE's value), else CorpusConfig's defaults."""
    recipe = args.out / "corpus.json"
    saved = {**LEGACY_RECIPE, **json.loads(recipe.read_text())} if recipe.is_file() else {}
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(CorpusConfig) if getattr(args, f.name) is not None}
    config = CorpusConfig(**{**{k: v for k, v in saved.items() if k in CorpusConfig.__dataclass_fields__}, **given})
    if config.batch_size < 1 or config.chunk_size < 1 or config.num_conversations < 1:
        raise ValueError("--batch-size, --chunk-size and --num-conversations must be >= 1")
    return config


def source_library(root: Path | None, snapshot: Path | None) -> SourceLibrary:
    """The broad mix's sources: from the snapshot when there is one, else read (and snapshotted if asked)."""
    if snapshot is not None and snapshot.is_file():
        return load_snapshot(snapshot)
    library = load_library(rebase=root)
    if snapshot is not None:
        save_snapshot(library, snapshot)
    return library


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    if args.summary:
        print(json.dumps(corpus_summary(args.out), indent=2))
        return 0
    config = corpus_config(args)
    check_device(args.device)  # before minutes of reading sources for a run that cannot start
    if (args.held_out_eval or config.exclude_kinds) and (config.mix != "broad" or config.eval_fraction <= 0):
        # The document split is part of a broad corpus's recipe: the evaluation must reserve what it trains without.
        raise ValueError(f"--held-out-eval and --exclude-kinds need a broad corpus's recipe with --eval-fraction > 0; "
                         f"{args.out} holds mix {config.mix!r}, eval_fraction {config.eval_fraction} (pass --out "
                         f"{BROAD_CORPUS_DIR.relative_to(REPO_ROOT)} or a new directory)")
    if args.install_sources:
        print(json.dumps(dataclasses.asdict(install_sources())))
    library = (source_library(args.sources_root, args.sources_snapshot)
               if config.mix == "broad" or args.held_out_eval or args.write_card else None)
    if args.held_out_eval is not None:
        split = HeldOutSplit(tuple(args.held_out_kinds), config.eval_fraction)
        evaluation = split_library(library, split.eval_fraction)[1]
        rows = evaluation_rows(evaluation, split.kinds, args.held_out_prompts, config.seed,
                               BenchmarkGuard(evaluation_texts(DEV_PROMPTS)), config.mix_settings())
        write_evaluation_set(args.held_out_eval, rows)
        print(f"{len(rows)} held-out prompts ({', '.join(split.kinds)}) written to {args.held_out_eval}; train "
              f"without them (`treeserve train-eagle3 --exclude-kinds {' '.join(split.kinds)}`), then measure with "
              f"`treeserve agreement --also-prompts {args.held_out_eval}`")
        return 0
    if args.write_card:
        print(f"corpus card written to {write_corpus_card(args.out, library, config)}")
        return 0
    if library is not None and not (library.documents or library.pairs):
        warnings.warn("no broad source is installed (run with --install-sources); the mix falls back to its "
                      "stdlib kinds")
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
                 feature_layers=layers or None, library=library)
    if library is not None:
        write_corpus_card(args.out, library, config)
    totals = corpus_summary(args.out)
    print(json.dumps({k: v for k, v in totals.items() if k != "kinds"}, indent=2))
    return 0
