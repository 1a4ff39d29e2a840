"""`treeserve train-drafter`: self-distil a drafter from the target (data generation + training + card)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from treeserve.engine.drafters.models.eagle import is_eagle_drafter
from treeserve.engine.drafters.registry import SHIPPED
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.models.paths import cache_root
from treeserve.tools.training.distill_data import DistillDataConfig, build_distill_data, load_distill_data
from treeserve.tools.training.drafter import DrafterTrainConfig, train_drafter
from treeserve.tools.training.eagle import EagleTrainConfig, target_features, train_eagle
from treeserve.tools.training.model_card import portable_card
from treeserve.tools.training.parallel import ParallelTrainConfig, train_parallel_drafter
from .options import add_dataclass_options


def add_arguments(parser: argparse.ArgumentParser) -> None:

    parser.add_argument("--kind", choices=["autoregressive", "parallel", "eagle"], default="autoregressive",
                        help="drafter kind: 'autoregressive' (a few target layers with a restricted-vocabulary head), "
                             "'parallel' (the same plus k [MASK] embeddings: k+1 tokens per forward, "
                             "group-wise training as in ParallelSpec) or 'eagle' (one layer reading the target's "
                             "features, as in EAGLE)")
    parser.add_argument("--target", default="default", help="target model: 'default', a model directory or a .gguf")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where the drafter is written (default: the shipped drafter of the kind, "
                             f"{SHIPPED['distilled'].directory} or {SHIPPED['parallel'].directory})")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="where generated training data is kept and resumed from (default: cache dir)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    add_dataclass_options(parser, DistillDataConfig, "training data")
    add_dataclass_options(parser, DrafterTrainConfig, "training", skip=("seed",))
    shared = {f.name for f in dataclasses.fields(DrafterTrainConfig)}
    add_dataclass_options(parser, ParallelTrainConfig, "parallel drafter (--kind parallel)", skip=shared)
    shared |= {f.name for f in dataclasses.fields(ParallelTrainConfig)}
    add_dataclass_options(parser, EagleTrainConfig, "EAGLE drafter (--kind eagle)", skip=shared)


def _distill_data(args: argparse.Namespace, target, data_config: DistillDataConfig):
    """The cached (or newly generated) self-distillation data, its path, generation minutes and special ids."""

    data_dir = args.data_dir or cache_root() / "distill" / f"{target.path.name}-seed{args.seed}"
    started = time.time()
    data_path = build_distill_data(target.model, target.tokenizer, data_config, data_dir)
    data_minutes = (time.time() - started) / 60
    specials = sorted({target.tokenizer.eos_token_id, *target.tokenizer.all_special_ids})
    return load_distill_data(data_path), data_path, data_minutes, specials


def _check_init(train_config, n_layers: int) -> None:
    """--init-from must name a drafter directory; otherwise --layers must be target layer indices."""
    if train_config.init_from and not (Path(train_config.init_from) / "config.json").is_file():
        raise ValueError(f"--init-from {train_config.init_from} is not a drafter directory")
    if not train_config.init_from and any(not 0 <= i < n_layers for i in train_config.layers):
        raise ValueError(f"--layers must be target layer indices in [0, {n_layers})")


def run(args: argparse.Namespace) -> int:
    import torch

    if args.kind == "parallel":
        return run_parallel(args)
    if args.kind == "eagle":
        return run_eagle(args)
    if args.out is None:
        args.out = SHIPPED["distilled"].directory
    torch.set_num_threads(args.threads)
    data_config = DistillDataConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DistillDataConfig)})
    train_config = DrafterTrainConfig(**{f.name: (tuple(getattr(args, f.name)) if f.name == "layers" else getattr(args, f.name))
                                         for f in dataclasses.fields(DrafterTrainConfig) if f.name != "seed"},
                                      seed=args.seed)
    target = load_causal_lm(args.target)
    target.tokenizer.padding_side = "left"
    _check_init(train_config, target.model.config.num_hidden_layers)
    data, data_path, data_minutes, specials = _distill_data(args, target, data_config)
    drafter, stats = train_drafter(target.model, data, train_config, specials)
    card = {"target": str(args.target), "data": dataclasses.asdict(data_config),
            "data_generation_minutes": round(data_minutes, 1), "training": stats}
    card = portable_card(card)
    drafter.save(args.out, card=card)
    (args.out / "training.json").write_text(json.dumps(card, indent=2))
    print(f"drafter written to {args.out}; measure dev agreement with `treeserve agreement --drafter {args.out}`")
    return 0


def run_parallel(args: argparse.Namespace) -> int:
    """`--kind parallel`: same cached self-distillation data, group-wise parallel training."""
    import torch

    torch.set_num_threads(args.threads)
    out = args.out or SHIPPED["parallel"].directory
    data_config = DistillDataConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DistillDataConfig)})
    train_config = ParallelTrainConfig(**{f.name: (tuple(getattr(args, f.name)) if f.name == "layers" else getattr(args, f.name))
                                          for f in dataclasses.fields(ParallelTrainConfig)})
    if train_config.num_masks < 1:
        raise ValueError("--num-masks must be >= 1")
    if not 0.0 < train_config.group_fraction <= 1.0:
        raise ValueError("--group-fraction must lie in (0, 1]")
    target = load_causal_lm(args.target)
    target.tokenizer.padding_side = "left"
    _check_init(train_config, target.model.config.num_hidden_layers)
    data, data_path, data_minutes, specials = _distill_data(args, target, data_config)
    drafter, stats = train_parallel_drafter(target.model, data, train_config, specials)
    card = {"target": str(args.target), "data_path": str(data_path), "data": dataclasses.asdict(data_config),
            "data_generation_minutes": round(data_minutes, 1), "training": stats}
    card = portable_card(card)
    drafter.save(out, card=card)
    (out / "training.json").write_text(json.dumps(card, indent=2))
    print(f"parallel drafter written to {out}; per-position dev agreement: "
          f"`treeserve agreement --kind parallel --drafter {out}`")
    return 0


def run_eagle(args: argparse.Namespace) -> int:
    """`--kind eagle`: the same cached self-distillation data, the target's features computed once (cached
    next to it), EAGLE's feature regression + token loss."""
    import torch

    torch.set_num_threads(args.threads)
    out = args.out or SHIPPED["eagle"].directory
    data_config = DistillDataConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DistillDataConfig)})
    train_config = EagleTrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EagleTrainConfig)})
    target = load_causal_lm(args.target)
    target.tokenizer.padding_side = "left"
    if not train_config.init_from and not 0 <= train_config.eagle_layer < target.model.config.num_hidden_layers:
        raise ValueError(f"--eagle-layer must be a target layer index in [0, {target.model.config.num_hidden_layers})")
    if train_config.init_from and not is_eagle_drafter(Path(train_config.init_from)):
        raise ValueError(f"--init-from {train_config.init_from} is not an EAGLE drafter directory")
    data, data_path, data_minutes, specials = _distill_data(args, target, data_config)
    started = time.time()
    features = target_features(target.model, data, train_config.max_seq_len,
                               data_path.parent / f"eagle_features_{train_config.max_seq_len}.safetensors")
    drafter, stats = train_eagle(target.model, data, features, train_config, specials)
    card = {"target": str(args.target), "data_path": str(data_path), "data": dataclasses.asdict(data_config),
            "data_generation_minutes": round(data_minutes, 1),
            "feature_minutes": round((time.time() - started) / 60 - stats["train_minutes"], 1), "training": stats,
            "config": dataclasses.asdict(train_config)}
    card = portable_card(card)
    drafter.save(out, card=card)
    (out / "training.json").write_text(json.dumps(card, indent=2))
    print(f"EAGLE drafter written to {out}; measure it with `treeserve bench --drafter {out}`")
    return 0
