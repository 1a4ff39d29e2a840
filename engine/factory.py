"""Assemble runnable pieces from paths and options: the target runner, the local drafter, the engine.

Every entry point (CLI `generate`/`bench`, the Target and Drafter deployments, tests on real models) builds
through these functions, so a model loads, a drafter is checked against its target, and the budget is
chosen the same way everywhere.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from treeserve.engine.budget import BudgetChooser, measure_profile
from treeserve.engine.builders import DEFAULT_METHOD, TreeConfig, split_method
from treeserve.engine.c2t_classifier import C2TClassifier
from treeserve.engine.drafting import AUTOREGRESSIVE, LocalDrafter
from treeserve.engine.speculative_engine import SpeculativeEngine
from treeserve.engine.models.drafter import drafter_dir, load_drafter, target_feature_layers
from treeserve.engine.models.loading import LoadedModel, load_causal_lm
from treeserve.engine.runners.drafter import DrafterRunner
from treeserve.engine.runners.target import TargetRunner

C2T_CLASSIFIER_FILE = "c2t.safetensors"  # a drafter directory's own C2T classifier (trained on its trees)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def drafter_classifier_path(drafter_path: str) -> Path:
    """Where the C2T classifier of a drafter lives: `c2t.safetensors` in its directory ("default" and
    "eagle" name the shipped drafters). C2T's confidences are calibrated on one drafter's trees, so each
    drafter carries its own (`treeserve train-c2t --drafter ...` writes it there)."""
    return drafter_dir(drafter_path) / C2T_CLASSIFIER_FILE


def load_classifier(path: str | None = "default", drafter_path: str = "default") -> C2TClassifier:
    """The C2T classifier: "default" = the drafter's own (a joint-probability prior where it has none),
    None = that prior, or a classifier file."""
    if path == "default":
        own = drafter_classifier_path(drafter_path)
        return C2TClassifier.load(own) if own.is_file() else C2TClassifier.joint_prob_prior()
    if path is None:
        return C2TClassifier.joint_prob_prior()
    if not Path(path).is_file():
        raise FileNotFoundError(f"C2T classifier {path} does not exist")
    return C2TClassifier.load(path)


DRAFTER_KINDS = ("autoregressive", "parallel")


def build_local_drafter(drafter_path: str, target: torch.nn.Module, device: str = "cpu",
                        dtype: torch.dtype = torch.float32, budget: int | str = "auto",
                        classifier_path: str | None = "default", drafter_kind: str = "autoregressive"):
    """A LocalDrafter for `target`; budget "auto" measures the hardware and chooses per step.

    drafter_kind "parallel": a ParallelTreeDrafter over a parallel drafter (k+1 positions per forward;
    `drafter_path` "default" is then the shipped default parallel drafter). A directory holding a parallel
    drafter is recognised as such whatever the kind (so a service configured with its path uses it)."""
    if drafter_kind not in DRAFTER_KINDS:
        raise ValueError(f"drafter_kind must be one of {DRAFTER_KINDS}, got {drafter_kind!r}")
    if drafter_path != "default":
        from treeserve.engine.models.parallel_drafter import is_parallel_drafter

        if is_parallel_drafter(Path(drafter_path).expanduser()):
            drafter_kind = "parallel"
    if drafter_kind == "parallel":
        from treeserve.engine.models.parallel_drafter import load_parallel_drafter
        from treeserve.engine.parallel_drafting import ParallelTreeDrafter

        model = load_parallel_drafter(drafter_path, target, device, dtype)
        if budget == "auto":
            chooser = BudgetChooser(measure_profile(target, model, device, dtype))
        elif not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget must be 'auto' or an integer >= 1, got {budget!r}")
        else:
            chooser = None
        return ParallelTreeDrafter(model, target.config.vocab_size, device, dtype, budget=chooser)
    model = load_drafter(drafter_path, target, device, dtype)
    chooser = None
    if budget == "auto":
        chooser = BudgetChooser(measure_profile(target, model, device, dtype))
    elif not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be 'auto' or an integer >= 1, got {budget!r}")
    return LocalDrafter(DrafterRunner(model, target.config.vocab_size, device, dtype),
                        classifier=load_classifier(classifier_path, drafter_path), budget=chooser)


# C2T's own defaults (paper section 5.1: K = 15, up to 10 layers). The confidence threshold beta is the
# classifier's own (C2TClassifier.beta, chosen per drafter; see c2t.json next to each shipped classifier).
C2T_DEFAULTS = {"depth": 10, "top_k": 15}


def tree_config(method: str, budget: int | str, **overrides) -> TreeConfig:
    """TreeConfig for `method`; an integer budget is fixed (for a chain: its length), "auto" leaves it
    to the drafter's hardware-aware chooser."""
    base = split_method(method)[0]  # "c2t+lookup" shapes its tree as "c2t" does
    if base == "c2t":
        overrides = {**C2T_DEFAULTS, **overrides}
    config = TreeConfig(method=method, **overrides)
    if isinstance(budget, int):
        config = replace(config, budget=budget, depth=budget if base == "chain" else config.depth)
    else:
        config = replace(config, budget_auto=True)
    return config


def build_engine(target_path: str = "default", drafter_path: str = "default", method: str = DEFAULT_METHOD,
                 budget: int | str = "auto", device: str = "cpu", dtype: str = "float32",
                 max_context_tokens: int = 2048, target: LoadedModel | None = None,
                 drafter_kind: str = "autoregressive", **tree_overrides) -> SpeculativeEngine:
    """An in-process engine over the target (and drafter unless method is autoregressive); drafter_kind
    "parallel" drafts each tree from one parallel-drafter forward (engine.parallel_drafting)."""
    torch_dtype = parse_dtype(dtype)
    base, lookup = split_method(method)
    if lookup and drafter_kind != "autoregressive":
        raise ValueError(f"method {method!r} drafts copy-from-context candidates with the autoregressive drafter, "
                         f"not drafter_kind {drafter_kind!r}")
    target = target or load_causal_lm(target_path, device, torch_dtype)
    drafter = None
    if method != AUTOREGRESSIVE:
        drafter = build_local_drafter(drafter_path, target.model, device, torch_dtype, budget,
                                      drafter_kind=drafter_kind)
    if drafter is not None and base == "opt_tree" and "delta" not in tree_overrides:
        # OPT-Tree: a drafter step is worth it only while it adds more than mu expected tokens, whatever
        # the node budget (the profile is measured once per machine and cached).
        profile = drafter.budget.profile if drafter.budget is not None else \
            measure_profile(target.model, drafter.model, device, torch_dtype)
        tree_overrides["delta"] = profile.opt_tree_delta()
    # An EAGLE-3 head whose config names no layers reads EAGLE-3's default for this target's depth.
    feature_layers = (target_feature_layers(drafter_path, target.model.config.num_hidden_layers)
                      if drafter is not None else None)
    return SpeculativeEngine(TargetRunner(target.model, device, torch_dtype, feature_layers=feature_layers),
                             drafter, target.tokenizer,
                             tree_config(method, budget, **tree_overrides), max_context_tokens)
