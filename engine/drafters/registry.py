"""The drafter registry: which drafter kinds exist and the shipped drafters' names (engine/drafters/loading.py
maps a kind to the class that drafts with it).

A drafter is chosen by two settings: its `kind` (how it drafts: "autoregressive" = one drafter forward per tree
depth, `LocalDrafter`; "parallel" = all depths from one forward, ParallelSpec's `ParallelTreeDrafter`) and its
`path` (the weights: a shipped name below, or a directory). The two must agree: a directory's config.json says
which kind of model it holds, and a mismatch is refused here, before anything loads (config validation reads
this module, so it imports no torch).

Shipped drafters (engine/drafters/weights/<name>): "distilled" (a 4-layer LM distilled from SmolLM2-135M,
restricted vocabulary), "eagle" (TreeServe's EAGLE head), "eagle3" (TreeServe's EAGLE-3 head) and
"parallel" (the parallel drafter). A drafter path left unset is the kind's default: "eagle3" (it agrees with the
target most often: engine/drafters/weights/eagle3/README.md), "parallel" for kind parallel. "default" is the old
name of "distilled" (of "parallel" for kind parallel): still accepted, with a deprecation warning, and not
redirected to "eagle3", so a config that said "default" keeps the drafter it was written for.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

from .models.compatibility import LAYOUT_NAMES, detect_layout, read_config

log = logging.getLogger(__name__)

AUTOREGRESSIVE_KIND = "autoregressive"
PARALLEL_KIND = "parallel"
WEIGHTS_DIR = Path(__file__).parent / "weights"
DEPRECATED_NAME = "default"
# No drafter model at all: only copy-from-context drafting (method "lookup"; engine/drafters/lookup_only.py).
NO_DRAFTER = "none"


@dataclass(frozen=True)
class DrafterKind:
    """One way of drafting."""

    name: str  # what `drafter.kind` and `--drafter-kind` say
    layouts: tuple[str, ...]  # drafter directory layouts it drafts with (compatibility.detect_layout)
    default: str  # the shipped drafter an unset drafter path stands for under this kind
    deprecated_alias: str  # the shipped drafter the deprecated name "default" stands for under this kind


KINDS: dict[str, DrafterKind] = {k.name: k for k in (
    # One drafter forward per tree depth: the distilled LM, EAGLE, EAGLE-3, published heads, any causal LM.
    DrafterKind(AUTOREGRESSIVE_KIND, ("restricted", "treeserve_eagle", "eagle3", "eagle", "causal_lm"),
                "eagle3", "distilled"),
    # Every tree depth from one forward (ParallelSpec's [MASK] tokens).
    DrafterKind(PARALLEL_KIND, ("parallel",), "parallel", "parallel"),
)}
DRAFTER_KINDS = tuple(KINDS)
DEFAULT_DRAFTER = KINDS[AUTOREGRESSIVE_KIND].default  # what the CLI, the Serve configs and the Helm chart draft with


def default_drafter(kind: str | None = None) -> str:
    """The shipped drafter an unset drafter path stands for under `kind` (default autoregressive)."""
    return check_kind(kind or AUTOREGRESSIVE_KIND).default


@dataclass(frozen=True)
class ShippedDrafter:
    """A drafter shipped in the package under a name."""

    name: str
    kind: str
    train_hint: str  # how to (re)create it when its weights are missing

    @property
    def directory(self) -> Path:
        return WEIGHTS_DIR / self.name


SHIPPED: dict[str, ShippedDrafter] = {s.name: s for s in (
    ShippedDrafter("distilled", AUTOREGRESSIVE_KIND, "treeserve train-drafter"),
    ShippedDrafter("eagle", AUTOREGRESSIVE_KIND, "treeserve train-drafter --kind eagle"),
    ShippedDrafter("eagle3", AUTOREGRESSIVE_KIND, "treeserve train-eagle3"),
    ShippedDrafter("parallel", PARALLEL_KIND, "treeserve train-drafter --kind parallel"),
)}
SHIPPED_NAMES = tuple(SHIPPED)


def check_kind(kind: str) -> DrafterKind:
    if kind not in KINDS:
        raise ValueError(f"drafter_kind must be one of {DRAFTER_KINDS}, got {kind!r}")
    return KINDS[kind]


def canonical_name(path: str, kind: str | None = None) -> str:
    """`path` with the deprecated name "default" replaced by the shipped drafter it stands for (a warning says so)."""
    if path != DEPRECATED_NAME:
        return path
    name = check_kind(kind or AUTOREGRESSIVE_KIND).deprecated_alias
    message = (f'drafter "{DEPRECATED_NAME}" is deprecated: it is the shipped "{name}" drafter (the default drafter '
               f'is "{KINDS[AUTOREGRESSIVE_KIND].default}"); name it "{name}"')
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    log.warning(message)
    return name


def drafter_dir(path: str, kind: str | None = None) -> Path:
    """The directory a drafter path stands for: a shipped name's weights, else the path itself."""
    path = canonical_name(path, kind)
    return SHIPPED[path].directory if path in SHIPPED else Path(path).expanduser()


def is_shipped(path: str) -> bool:
    return path in SHIPPED or path == DEPRECATED_NAME


def kind_of(path: str, kind: str | None = None) -> str:
    """The drafter kind for `path`, checked against `kind` when one is given: a shipped name's own kind, else
    what a readable directory's config.json holds; an unreadable directory takes `kind` (default
    autoregressive). ValueError when the stated kind and the weights disagree."""
    if kind is not None:
        check_kind(kind)
    name = canonical_name(path, kind)
    if name in SHIPPED:
        found, what = SHIPPED[name].kind, f'the shipped drafter "{name}"'
    else:
        directory = Path(name).expanduser()
        raw = read_config(directory)
        if raw is None:
            return kind or AUTOREGRESSIVE_KIND
        layout = detect_layout(directory, raw)
        found = next(k.name for k in KINDS.values() if layout in k.layouts)
        what = f"{directory} (a {LAYOUT_NAMES[layout]})"
    if kind is not None and kind != found:
        raise ValueError(f"drafter kind {kind!r} does not match {what}, which is of kind {found!r}: set the kind "
                         f"to {found!r} or name a drafter of kind {kind!r}")
    return found
