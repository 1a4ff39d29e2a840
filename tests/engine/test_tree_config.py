"""engine/tree_config.py: the one budget type every entry point parses, and the per-method defaults."""

import pytest

from treeserve.engine.tree_config import AUTO_BUDGET, C2T_DEFAULTS, parse_budget, tree_config


@pytest.mark.parametrize("value, parsed", [("auto", "auto"), (8, 8), ("8", 8), (1024, 1024)])
def test_a_budget_is_auto_or_a_positive_integer(value, parsed):
    assert parse_budget(value, maximum=1024) == parsed


@pytest.mark.parametrize("value", [0, "0", -3, "-3", "8.5", "eight", "", True, 2000])
def test_a_bad_budget_is_refused_naming_the_setting(value):
    with pytest.raises(ValueError, match=r"^speculation\.budget: must be 'auto' or an integer in 1\.\.1024"):
        parse_budget(value, "speculation.budget", maximum=1024)


def test_tree_config_states_the_budget_and_the_c2t_defaults_once():
    fixed, auto = tree_config("c2t+lookup", "12"), tree_config("c2t", AUTO_BUDGET)
    assert (fixed.budget, fixed.budget_auto, auto.budget_auto) == (12, False, True)
    assert (fixed.depth, fixed.top_k) == (C2T_DEFAULTS["depth"], C2T_DEFAULTS["top_k"])
    assert tree_config("chain", 5).depth == 5  # a chain's budget is its length
    with pytest.raises(ValueError, match="budget"):
        tree_config("dyspec", 0)
