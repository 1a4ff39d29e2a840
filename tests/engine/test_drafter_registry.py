"""engine/drafters/registry.py: drafter kinds, shipped names, and the deprecated name "default"."""

import logging

import pytest

from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.drafters.loading import DRAFTER_CLASSES
from treeserve.engine.drafters.parallel import ParallelTreeDrafter
from treeserve.engine.drafters.registry import (DEFAULT_DRAFTER, KINDS, SHIPPED, canonical_name, default_drafter,
                                                drafter_dir, kind_of)


def test_every_kind_names_its_drafter_class():
    assert DRAFTER_CLASSES["autoregressive"] is LocalDrafter
    assert DRAFTER_CLASSES["parallel"] is ParallelTreeDrafter
    assert set(DRAFTER_CLASSES) == set(KINDS) == {LocalDrafter.kind, ParallelTreeDrafter.kind}


def test_shipped_names_and_their_kinds():
    assert drafter_dir("distilled") == SHIPPED["distilled"].directory
    assert (kind_of("distilled"), kind_of("eagle"), kind_of("eagle3"), kind_of("parallel")) == \
        ("autoregressive",) * 3 + ("parallel",)
    with pytest.raises(ValueError, match="does not match the shipped drafter \"distilled\""):
        kind_of("distilled", "parallel")
    with pytest.raises(ValueError, match="drafter_kind must be one of"):
        kind_of("distilled", "x")


def test_default_is_a_deprecated_alias(caplog):
    """"default" still names the distilled drafter (the parallel one under kind parallel), with a warning that
    says what it is and which drafter is the default (EAGLE-3)."""
    with caplog.at_level(logging.WARNING), pytest.warns(DeprecationWarning, match='"default" is deprecated'):
        assert canonical_name("default") == "distilled"
    assert 'name it "distilled"' in caplog.text and 'the default drafter is "eagle3"' in caplog.text
    with pytest.warns(DeprecationWarning):
        assert drafter_dir("default") == drafter_dir("distilled")
    with pytest.warns(DeprecationWarning):
        assert kind_of("default", "parallel") == "parallel" and drafter_dir("default", "parallel") == drafter_dir("parallel")
    assert canonical_name("distilled") == "distilled"  # the new name: no warning (pytest would fail on none above)


def test_an_unset_drafter_is_the_kinds_default():
    """The default drafter is the shipped EAGLE-3 head (parallel drafting: the shipped parallel drafter); every
    kind's default and deprecated alias is a shipped drafter of that kind."""
    assert DEFAULT_DRAFTER == default_drafter() == default_drafter("autoregressive") == "eagle3"
    assert default_drafter("parallel") == "parallel"
    for kind in KINDS.values():
        assert SHIPPED[kind.default].kind == kind.name and SHIPPED[kind.deprecated_alias].kind == kind.name
    with pytest.raises(ValueError, match="drafter_kind must be one of"):
        default_drafter("x")
