"""Tree method names (no torch import: the typed service config reads them too).

A method names a tree builder (engine/builders), "autoregressive" (no drafting), or a copy-from-context method
(engine/lookup/): "lookup" drafts candidates copied from the request's own tokens alone (no drafter model);
"<builder>+lookup" merges them with the drafter model's candidates in one tree shaped by that builder, and with
an auto budget the hardware-aware chooser may also draft a step from the lookup alone (engine/budget.py).
"""

from __future__ import annotations

AUTOREGRESSIVE = "autoregressive"
BUILDERS = ("chain", "static", "eagle2", "dyspec", "dyspec_threshold", "opt_tree", "c2t", "c2t_chain")
LOOKUP = "lookup"
LOOKUP_SUFFIX = "+lookup"
HYBRID_BUILDERS = ("chain", "eagle2", "dyspec", "dyspec_threshold", "opt_tree", "c2t", "c2t_chain")
# Every TreeConfig.method.
METHODS = BUILDERS + (LOOKUP,) + tuple(b + LOOKUP_SUFFIX for b in HYBRID_BUILDERS)
# What a request, the CLI and the Serve config may name at batch size 1 (c2t_chain is the batched drafting mode).
SERVED_METHODS = (AUTOREGRESSIVE,) + tuple(m for m in METHODS if not m.startswith("c2t_chain"))
# The method of `treeserve generate --in-process`, the typed Serve config and a drafter replica when none is
# named (deploy/*.yaml and the Helm presets name theirs: the same). The hybrid: C2T's pruned trees over the
# drafter's and the context's candidates; it beat every model-only and lookup-only method and HF prompt lookup
# on the dev bench (docs/performance.md section 1).
DEFAULT_METHOD = "c2t+lookup"


def split_method(method: str) -> tuple[str, bool]:
    """(builder name, whether lookup candidates join the tree): "c2t+lookup" -> ("c2t", True), "lookup" ->
    ("lookup", True), "c2t" -> ("c2t", False)."""
    if method == LOOKUP:
        return LOOKUP, True
    if method.endswith(LOOKUP_SUFFIX):
        return method[: -len(LOOKUP_SUFFIX)], True
    return method, False


def uses_lookup(method: str) -> bool:
    return split_method(method)[1]


def with_lookup(method: str, lookup: bool) -> str:
    """`method` with copy-from-context candidates added when `lookup` (unchanged for autoregressive, lookup and
    a method that has them already)."""
    if not lookup or method == AUTOREGRESSIVE or uses_lookup(method):
        return method
    return method + LOOKUP_SUFFIX
