"""Build a ready `Drafter` for a target from a kind and a path: the registry picks the class, the path the weights.

Every entry point (the in-process engine factory, the Drafter deployment, bench, tests) builds a local drafter
through `build_local_drafter`, so the kind/path check, the C2T classifier and the budget chooser are chosen the
same way everywhere.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..budget import BudgetChooser
from ..c2t_classifier import C2TClassifier
from ..hardware.profile import measure_profile
from ..lookup import LookupSettings
from ..runners.step_settings import StaticStepSettings
from ..tree_config import AUTO_BUDGET, TreeBudget, parse_budget
from .autoregressive import LocalDrafter
from .base import ModelDrafter
from .dtype_choice import AUTO, fastest_dtype
from .model_runner import DrafterRunner
from .models.base import runner_forward
from .models.loading import load_drafter, load_parallel_drafter
from .parallel import ParallelTreeDrafter
from .registry import AUTOREGRESSIVE_KIND, PARALLEL_KIND, canonical_name, drafter_dir, kind_of

# The class that drafts with each kind the registry names.
DRAFTER_CLASSES: dict[str, type[ModelDrafter]] = {AUTOREGRESSIVE_KIND: LocalDrafter, PARALLEL_KIND: ParallelTreeDrafter}
C2T_CLASSIFIER_FILE = "c2t.safetensors"  # a drafter directory's own C2T classifier (trained on its trees)


def drafter_classifier_path(drafter_path: str) -> Path:
    """Where the C2T classifier of a drafter lives: `c2t.safetensors` in its directory (shipped names stand for
    their weights directory). C2T's confidences are calibrated on one drafter's trees, so each drafter carries
    its own (`treeserve train-c2t --drafter ...` writes it there)."""
    return drafter_dir(drafter_path) / C2T_CLASSIFIER_FILE


def load_classifier(path: str | None = "default", drafter_path: str = "distilled") -> C2TClassifier:
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


def _chooser(budget: TreeBudget, target: torch.nn.Module, model: torch.nn.Module, device: str,
             target_dtype: torch.dtype, dtype: torch.dtype, static: StaticStepSettings | None = None,
             cost_curve: str | None = None) -> BudgetChooser | None:
    """Budget "auto": a chooser over the measured cost curve of this pair on the step both run (cached per
    machine; `cost_curve`: the target's from a `treeserve profile` file); an integer: none."""
    if parse_budget(budget) == AUTO_BUDGET:
        return BudgetChooser(measure_profile(target, model, device, target_dtype, drafter_dtype=dtype,
                                             static=static, cost_curve=cost_curve,
                                             drafter_forward=runner_forward(model)))
    return None


def build_local_drafter(drafter_path: str, target: torch.nn.Module, device: str = "cpu",
                        dtype: torch.dtype | str = torch.float32, budget: TreeBudget = AUTO_BUDGET,
                        classifier_path: str | None = "default", drafter_kind: str | None = None,
                        lookup: LookupSettings | None = None, target_dtype: torch.dtype | None = None,
                        static: StaticStepSettings | None = None, cost_curve: str | None = None,
                        tokenizer=None, catch_up_beside: int | None = None) -> ModelDrafter:
    """The drafter of `drafter_kind` over the weights at `drafter_path`, for `target`; budget "auto" measures
    the hardware and chooses per step.

    `dtype` is the drafter's: a torch dtype, or "auto" for the faster of the target's dtype and bfloat16 on
    this machine (engine/drafters/dtype_choice.py). `target_dtype` is the dtype the target runs in (default:
    its parameters'), timed for budget "auto".

    `drafter_kind` None takes the kind the weights are (a directory's config.json, a shipped name's own); a
    stated kind that disagrees with them is a ValueError (engine/drafters/registry.py). Kind "parallel" gives a
    ParallelTreeDrafter (k+1 positions per forward), "autoregressive" a LocalDrafter with the drafter's own C2T
    classifier and `lookup`'s copy-from-context settings (None: the defaults). `static`: its drafter model's
    forwards (either kind) run as the static-shape step (CUDA graphs on a GPU; engine/runners/static_step.py),
    and budget "auto" measures the target on that step too; `cost_curve`: the target's curve from a `treeserve
    profile` file of this target and device instead of measuring it; `tokenizer`: the target's, for requests with a
    grammar (the drafters mask their rows as the target's: engine/grammar/); `catch_up_beside`: the autoregressive
    drafter leaves a session lagging its context by more than this many tokens to catch up beside the target's score
    (`LocalDrafter.catch_up`; None: inline)."""
    drafter_path = canonical_name(drafter_path, drafter_kind)  # the deprecated "default" warns once, here
    kind = kind_of(drafter_path, drafter_kind)
    target_dtype = target_dtype or next(target.parameters()).dtype
    load = load_parallel_drafter if kind == PARALLEL_KIND else load_drafter
    if dtype == AUTO:
        dtype, model = fastest_dtype(lambda candidate: load(drafter_path, target, device, candidate), device,
                                     target_dtype)
    elif isinstance(dtype, torch.dtype):
        model = load(drafter_path, target, device, dtype)
    else:
        raise ValueError(f"drafter dtype must be a torch dtype or {AUTO!r}, got {dtype!r}")
    chooser = _chooser(budget, target, model, device, target_dtype, dtype, static, cost_curve)
    if kind == PARALLEL_KIND:
        return ParallelTreeDrafter(model, target.config.vocab_size, device, dtype, budget=chooser, static=static,
                                   tokenizer=tokenizer)
    runner = DrafterRunner(model, target.config.vocab_size, device, dtype, static=static, tokenizer=tokenizer)
    return LocalDrafter(runner, classifier=load_classifier(classifier_path, drafter_path), budget=chooser,
                        lookup=lookup, catch_up_beside=catch_up_beside)
