"""Drafter and Target scale on live sessions in every layout: their per-step traffic bypasses Serve."""

from pathlib import Path

import pytest

from treeserve.services.config import load_serve_config

LAYOUTS = sorted((Path(__file__).resolve().parents[2] / "deploy").glob("*.yaml"))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: p.stem)
def test_session_policy(layout):
    app = load_serve_config(layout).app
    for name in ("Drafter", "Target"):
        auto = app.deployment(name).autoscaling_config
        assert auto.policy.policy_function == "treeserve.services.app:session_autoscaling_policy"


def test_bad_policy_path_is_rejected():
    data = {"applications": [{"name": "treeserve", "import_path": "treeserve.services.app:build_app",
                              "deployments": [{"name": "Target", "autoscaling_config": {
                                  "min_replicas": 1, "max_replicas": 2, "policy": {"policy_function": "nocolon"}}}]}]}
    with pytest.raises(ValueError, match="policy_function"):
        load_serve_config(data)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: p.stem)
def test_app_builds_with_the_layouts_deployment_options(layout):
    from treeserve.services.app import build_app_from_config, config_to_args

    app = load_serve_config(layout).app
    assert build_app_from_config(app, config_to_args(app.args)) is not None
