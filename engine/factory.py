"""Assemble runnable pieces from paths and options: the target runner, the local drafter, the engine.

Every entry point (CLI `generate`/`bench`, the Target and Drafter deployments, tests on real models) builds
through these functions, so a model loads, a drafter is checked against its target, and the budget is
chosen the same way everywhere. An in-process engine's runners go behind their async adapters here
(`in_process_engine`; engine/parts.py); the served engine, over replica clients, is services/remote_engine.py's
`build_remote_engine`.
"""

from __future__ import annotations

import torch

from .drafters.base import Drafter
from .drafters.dtype_choice import AUTO as AUTO_DTYPE
from .drafters.loading import build_local_drafter
from .drafters.models.base import runner_forward
from .drafters.models.loading import target_feature_layers
from .drafters.lookup_only import LookupDrafter
from .drafters.registry import AUTOREGRESSIVE_KIND, NO_DRAFTER, canonical_name, default_drafter
from .hardware.profile import measure_profile
from .lookup import LookupSettings
from .methods import AUTOREGRESSIVE, DEFAULT_METHOD, LOOKUP, Method
from .models.loading import LoadedModel, load_causal_lm
from .parts import InProcessDrafter, InProcessTarget, LocalTarget
from .runners.step_settings import StaticStepSettings, default_static_step
from .runners.target import TargetRunner
from .speculative_engine import SpeculativeEngine
from .tree_config import AUTO_BUDGET, TreeBudget, TreeConfig, tree_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# With run-ahead, a session whose drafter cache lags its context by more than this (a prompt; a long stretch decoded
# plainly) catches up on the run-ahead thread instead of inside a step (speculation.catch_up_beside_tokens served).
CATCH_UP_BESIDE_TOKENS = 64


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def parse_drafter_dtype(name: str) -> torch.dtype | str:
    """A drafter dtype: a dtype name, or "auto" (kept: build_local_drafter measures it)."""
    if name == AUTO_DTYPE:
        return AUTO_DTYPE
    if name not in DTYPES:
        raise ValueError(f"drafter dtype must be {AUTO_DTYPE!r} or one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def build_engine(target_path: str = "default", drafter_path: str | None = None, method: str = DEFAULT_METHOD,
                 budget: TreeBudget = AUTO_BUDGET, device: str = "cpu", dtype: str = "float32",
                 max_context_tokens: int = 2048, target: LoadedModel | None = None,
                 drafter_kind: str | None = None, lookup: LookupSettings | None = None,
                 drafter_dtype: str | None = None, cuda_graphs: bool = True, cost_curve: str | None = None,
                 run_ahead: bool = False, fused_ops: bool = True, prefix_caching: bool = True,
                 **tree_overrides) -> SpeculativeEngine:
    """An in-process engine over the target (and drafter unless method is autoregressive); drafter_kind
    "parallel" drafts each tree from one parallel-drafter forward (engine/drafters/parallel.py), None takes
    the kind of the drafter's weights (engine/drafters/registry.py); drafter_path None is the kind's default
    drafter ("eagle3", or "parallel" for kind parallel); `lookup` sets copy-from-context drafting (methods
    "lookup" and "<builder>+lookup"; None: the defaults). `dtype` is the target's (it defines the output);
    `drafter_dtype` the drafter's: None = `dtype`, a dtype name, or "auto" (measured: dtype_choice.py).
    `cuda_graphs`: on a CUDA device the target and the drafter run the static-shape step replayed as CUDA graphs
    (engine/runners/static_step.py); False keeps the models' own eager forwards. `fused_ops`: that step's norms,
    rotary embedding and SiLU run as compiled fused kernels (engine/runners/fused_ops.py). `cost_curve`: budget "auto"
    reads the target's cost curve from this `treeserve profile` file (of this target, device and dtype).
    `run_ahead`: the drafter drafts the next step's trees on a thread while the target scores, and on that thread
    catches up on what a session's drafting lagged by more than CATCH_UP_BESIDE_TOKENS (a prompt)
    (engine/drafters/run_ahead.py; pays where the drafter has cores or a device of its own). `prefix_caching`:
    the target and the drafter start a request from the longest prefix of it they hold (engine/runners/kv_pages.py)."""
    torch_dtype = parse_dtype(dtype)
    drafter_torch_dtype = parse_drafter_dtype(drafter_dtype or dtype)
    parsed = Method.parse(method)
    if drafter_path is None and parsed.lookup_only:
        drafter_path = NO_DRAFTER  # copies alone: no drafter model to load (nor to fit this target)
    if drafter_path == NO_DRAFTER:
        static = default_static_step(device, cuda_graphs, fused_ops=fused_ops)
        return _engine_without_drafter(target_path, method, parsed, budget, device, torch_dtype, max_context_tokens,
                                       target, lookup, cost_curve, prefix_caching, static, tree_overrides)
    if drafter_path is None:
        drafter_path = default_drafter(drafter_kind)
    drafter_path = canonical_name(drafter_path, drafter_kind)
    if parsed.copies and drafter_kind not in (None, AUTOREGRESSIVE_KIND):
        raise ValueError(f"method {method!r} drafts copy-from-context candidates with the autoregressive drafter, "
                         f"not drafter_kind {drafter_kind!r}")
    target = target or load_causal_lm(target_path, device, torch_dtype)
    drafter = None
    static = default_static_step(device, cuda_graphs, fused_ops=fused_ops)
    if not parsed.is_autoregressive:
        drafter = build_local_drafter(drafter_path, target.model, device, drafter_torch_dtype, budget,
                                      drafter_kind=drafter_kind, lookup=lookup, target_dtype=torch_dtype,
                                      static=static, cost_curve=cost_curve, tokenizer=target.tokenizer,
                                      catch_up_beside=CATCH_UP_BESIDE_TOKENS if run_ahead else None)
    if drafter is not None and parsed.builder == "opt_tree" and "delta" not in tree_overrides:
        # OPT-Tree: a drafter step is worth it only while it adds more than mu expected tokens, whatever
        # the node budget (the profile is measured once per machine and cached).
        profile = drafter.budget.profile if drafter.budget is not None else \
            measure_profile(target.model, drafter.model, device, torch_dtype,
                            drafter_dtype=next(drafter.model.parameters()).dtype, static=static,
                            cost_curve=cost_curve, drafter_forward=runner_forward(drafter.model))
        tree_overrides["delta"] = profile.opt_tree_delta()
    # An EAGLE-3 head whose config names no layers reads EAGLE-3's default for this target's depth.
    feature_layers = (target_feature_layers(drafter_path, target.model.config.num_hidden_layers)
                      if drafter is not None else None)
    runner = TargetRunner(target.model, device, torch_dtype, feature_layers=feature_layers, static=static,
                          tokenizer=target.tokenizer)
    runner.lm.use_prefix_caching(prefix_caching)
    if drafter is not None:
        drafter.lm.use_prefix_caching(prefix_caching)
    return in_process_engine(runner, drafter, target.tokenizer, tree_config(method, budget, **tree_overrides),
                             max_context_tokens, eos_token_ids=target.eos_token_ids, run_ahead=run_ahead)


def in_process_engine(target: LocalTarget, drafter: Drafter | None, tokenizer, tree: TreeConfig,
                      max_context_tokens: int, **options) -> SpeculativeEngine:
    """An engine over a target and a drafter in this process, each behind its async adapter (engine/parts.py);
    `options`: SpeculativeEngine's."""
    return SpeculativeEngine(InProcessTarget(target), InProcessDrafter(drafter) if drafter is not None else None,
                             tokenizer, tree, max_context_tokens, **options)


def _engine_without_drafter(target_path: str, method: str, parsed: Method, budget: TreeBudget, device: str,
                            dtype: torch.dtype, max_context_tokens: int, target: LoadedModel | None,
                            lookup: LookupSettings | None, cost_curve: str | None, prefix_caching: bool,
                            static: StaticStepSettings | None, tree_overrides: dict) -> SpeculativeEngine:
    """An engine over the target alone: method "lookup" drafts copies from the context (engine/drafters/
    lookup_only.py), "autoregressive" none; any method drafting with a model is refused, naming the setting.
    `parsed`: `method` as build_engine parsed it."""
    if parsed.model_drafts:
        raise ValueError(f"method {method!r} drafts with a drafter model: with drafter {NO_DRAFTER!r} use method "
                         f"{LOOKUP!r} (copies from the context) or {AUTOREGRESSIVE!r}")
    target = target or load_causal_lm(target_path, device, dtype)
    drafter = None
    if parsed.lookup_only:
        profile = (measure_profile(target.model, None, device, dtype, static=static, cost_curve=cost_curve)
                   if budget == AUTO_BUDGET else None)
        drafter = LookupDrafter(lookup, profile)
    runner = TargetRunner(target.model, device, dtype, static=static, tokenizer=target.tokenizer)
    runner.lm.use_prefix_caching(prefix_caching)
    return in_process_engine(runner, drafter, target.tokenizer, tree_config(method, budget, **tree_overrides),
                             max_context_tokens, eos_token_ids=target.eos_token_ids)
