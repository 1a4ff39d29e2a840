"""Tree method names (no torch import: the typed service config reads them too).

A method names a tree builder (engine/builders), "autoregressive" (no drafting), or a copy-from-context method
(engine/lookup/): "lookup" drafts candidates copied from the request's own tokens alone (no drafter model);
"<builder>+lookup" merges them with the drafter model's candidates in one tree shaped by that builder, and with
an auto budget the hardware-aware chooser may also draft a step from the lookup alone (engine/budget.py).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class Method:
    """A method name parsed (`parse`): the builder that shapes its trees ("lookup" for copies alone,
    "autoregressive" for no drafting) and whether candidates copied from the request's context join them.
    TreeConfig parses its method once (`TreeConfig.parsed_method`); a name outside METHODS parses too, and
    `make_builder` refuses it by name."""

    builder: str
    copies: bool

    @classmethod
    def parse(cls, name: str) -> Method:
        """The method `name` names: "c2t+lookup" -> Method("c2t", True), "lookup" -> Method("lookup", True),
        "c2t" -> Method("c2t", False)."""
        if name == LOOKUP:
            return cls(LOOKUP, True)
        if name.endswith(LOOKUP_SUFFIX):
            return cls(name[: -len(LOOKUP_SUFFIX)], True)
        return cls(name, False)

    @property
    def is_autoregressive(self) -> bool:
        """Plain decoding: the method "autoregressive", no drafting."""
        return self.builder == AUTOREGRESSIVE and not self.copies

    @property
    def lookup_only(self) -> bool:
        """Copies from the context alone: no drafter model ("lookup")."""
        return self.builder == LOOKUP

    @property
    def model_drafts(self) -> bool:
        """The drafter model drafts this method's trees (copies may join them)."""
        return not self.is_autoregressive and not self.lookup_only


def with_lookup(method: str, lookup: bool) -> str:
    """`method` with copy-from-context candidates added when `lookup` (unchanged for autoregressive, lookup and
    a method that has them already)."""
    parsed = Method.parse(method)
    if not lookup or parsed.is_autoregressive or parsed.copies:
        return method
    return method + LOOKUP_SUFFIX
