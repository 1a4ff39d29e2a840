"""engine/tree_settings.py: each builder's own typed settings, parsed from a TreeConfig (torch-free: no builder is
made here; tests/engine/test_builders.py checks what make_builder makes of them)."""

from dataclasses import fields, replace

import pytest

from treeserve.engine.methods import BUILDERS, LOOKUP, METHODS, Method
from treeserve.engine.tree_config import C2T_DEFAULTS, TreeConfig, tree_config
from treeserve.engine.tree_settings import (SETTINGS, C2TChainSettings, C2TSettings, ChainSettings, DySpecSettings,
                                            DySpecThresholdSettings, Eagle2Settings, LookupTreeSettings,
                                            OptTreeSettings, StaticSettings)

# What each builder reads of a TreeConfig, and nothing else.
FIELDS = {
    LOOKUP: {"budget"},
    "chain": {"depth", "chain_sampled"},
    "static": {"static_tree", "static_paths", "acceptance_by_rank", "budget", "depth"},
    "eagle2": {"budget", "depth", "top_k", "rerank"},
    "dyspec": {"budget", "max_depth", "prefetch"},
    "dyspec_threshold": {"threshold", "budget", "max_depth"},
    "opt_tree": {"budget", "delta", "max_depth"},
    "c2t": {"budget", "depth", "top_k", "beta", "c2t_classifier_path"},
    "c2t_chain": {"depth", "beta", "c2t_classifier_path"},
}


def test_every_builder_has_settings_holding_only_its_own_fields():
    assert set(SETTINGS) == {LOOKUP, *BUILDERS} == set(FIELDS)
    config_fields = {f.name for f in fields(TreeConfig)}
    for builder, cls in SETTINGS.items():
        names = {f.name for f in fields(cls)}
        assert names == FIELDS[builder], builder
        assert names <= config_fields, f"{cls.__name__}: a field TreeConfig does not have"
        assert all(f.metadata.get("help") for f in fields(cls)), f"{cls.__name__}: a field without help"


@pytest.mark.parametrize("method", METHODS)
def test_a_config_parses_into_its_builders_settings(method):
    config = TreeConfig(method=method, budget=12, depth=4, top_k=3, threshold=0.1, delta=0.3, beta=0.6,
                        prefetch=5, max_depth=7, chain_sampled=False, rerank=False, static_tree="binary")
    settings = config.settings
    assert type(settings) is SETTINGS[Method.parse(method).builder]  # "c2t+lookup" is shaped by c2t's
    assert all(getattr(settings, f.name) == getattr(config, f.name) for f in fields(settings))
    assert config.settings is settings  # parsed once, like parsed_method
    assert replace(config, budget=9).settings is not settings  # a new config parses its own


def test_tree_config_defaults_reach_the_settings():
    assert tree_config("c2t", 12).settings == C2TSettings(budget=12, depth=C2T_DEFAULTS["depth"],
                                                           top_k=C2T_DEFAULTS["top_k"], beta=None,
                                                           c2t_classifier_path=None)
    assert tree_config("chain", 5).settings == ChainSettings(depth=5, chain_sampled=True)  # its budget is its length
    assert tree_config("dyspec", "auto").settings == DySpecSettings(budget=64, max_depth=None, prefetch=16)
    assert TreeConfig(method="lookup", budget=5).settings == LookupTreeSettings(budget=5)
    assert TreeConfig(method="c2t_chain").settings == C2TChainSettings(depth=6, beta=None, c2t_classifier_path=None)
    assert TreeConfig(method="static").settings == StaticSettings(static_tree="mc_sim_7b_63", static_paths=None,
                                                                  acceptance_by_rank=None, budget=64, depth=6)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (TreeConfig(method="lookup", budget=0), "budget"),
        (TreeConfig(method="chain", depth=0), "depth"),
        (TreeConfig(method="chain", depth=0), "length"),
        (TreeConfig(method="static", static_tree="nope"), "static_tree"),
        (TreeConfig(method="static", static_tree="sequoia"), "acceptance_by_rank"),
        (TreeConfig(method="eagle2", budget=0), "budget"),
        (TreeConfig(method="eagle2", depth=0), "depth"),
        (TreeConfig(method="eagle2", top_k=0), "top_k"),
        (TreeConfig(method="dyspec", budget=0), "budget"),
        (TreeConfig(method="dyspec", max_depth=0), "max_depth"),
        (TreeConfig(method="dyspec", prefetch=0), "prefetch"),
        (TreeConfig(method="dyspec_threshold", threshold=0.0), "threshold"),
        (TreeConfig(method="dyspec_threshold", threshold=1.5), "threshold"),
        (TreeConfig(method="dyspec_threshold", max_depth=0), "max_depth"),
        (TreeConfig(method="opt_tree", delta=-1.0), "delta"),
        (TreeConfig(method="opt_tree", delta=float("inf")), "delta"),
        (TreeConfig(method="opt_tree", max_depth=0), "max_depth"),
        (TreeConfig(method="c2t", beta=1.0), "beta"),
        (TreeConfig(method="c2t", depth=0), "depth"),
        (TreeConfig(method="c2t", top_k=0), "top_k"),
        (TreeConfig(method="c2t+lookup", budget=0), "budget"),
        (TreeConfig(method="c2t_chain", beta=0.0), "beta"),
        (TreeConfig(method="c2t_chain", depth=0), "depth"),
        (TreeConfig(method="medusa"), "method"),
        (TreeConfig(method="autoregressive"), "method"),
        (TreeConfig(method="static+lookup"), "method"),
    ],
)
def test_a_value_its_builder_cannot_take_is_refused_naming_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        config.settings


def test_fields_a_builder_does_not_read_are_not_its_concern():
    assert TreeConfig(method="dyspec", top_k=0, depth=0, beta=2.0).settings.budget == 64
    assert TreeConfig(method="chain", budget=0).settings.depth == 6  # a chain's length is its depth
    # explicit paths override the named tree, which is then not checked
    paths = ((0,), (1,))
    assert TreeConfig(method="static", static_tree="nope", static_paths=paths).settings.static_paths == paths


def test_settings_are_frozen_and_validate_when_made_directly():
    settings = Eagle2Settings(budget=8, depth=3, top_k=2, rerank=True)
    with pytest.raises(AttributeError):
        settings.budget = 9  # type: ignore[misc]
    with pytest.raises(ValueError, match="top_k"):
        Eagle2Settings(budget=8, depth=3, top_k=0, rerank=True)
    with pytest.raises(ValueError, match="delta"):
        OptTreeSettings(budget=8, delta=-0.5, max_depth=None)
    with pytest.raises(ValueError, match="threshold"):
        DySpecThresholdSettings(threshold=1.0, budget=8, max_depth=None)
