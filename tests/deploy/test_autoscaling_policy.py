"""Every deployment scales on a load Serve cannot see itself, in every layout: Drafter and Target on live sessions
(their per-step traffic bypasses Serve), the Router on requests in flight (its APIs are its own servers)."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from treeserve.services.config import load_serve_config

LAYOUTS = sorted((Path(__file__).resolve().parents[2] / "deploy").glob("*.yaml"))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: p.stem)
def test_session_policy(layout):
    app = load_serve_config(layout).app
    for name in ("Drafter", "Target"):
        auto = app.deployment(name).autoscaling_config
        assert auto.policy.policy_function == "treeserve.services.app:session_autoscaling_policy"


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: p.stem)
def test_router_policy(layout):
    auto = load_serve_config(layout).app.deployment("Router").autoscaling_config
    assert auto.policy.policy_function == "treeserve.services.app:router_autoscaling_policy"


def _context(metrics: dict, target: float, low: int = 1, high: int = 4):
    return SimpleNamespace(aggregated_metrics=metrics, config=SimpleNamespace(target_ongoing_requests=target),
                           capacity_adjusted_min_replicas=low, capacity_adjusted_max_replicas=high,
                           policy_state={})


def test_router_policy_scales_on_requests_in_flight():
    from treeserve.services.app import router_autoscaling_policy

    busy = {"in_flight_requests": {"router-a": 9.0, "router-b": 7.0}}
    assert router_autoscaling_policy(_context(busy, target=8))[0] == 2  # ceil(16 / 8)
    assert router_autoscaling_policy(_context(busy, target=2))[0] == 4  # 8 wanted, capped at max_replicas
    assert router_autoscaling_policy(_context({}, target=8))[0] == 1  # idle: min_replicas
    # the sessions of Drafter / Target replicas are not the Router's load
    assert router_autoscaling_policy(_context({"active_sessions": {"x": 30.0}}, target=8))[0] == 1


def test_router_reports_its_requests_in_flight():
    from treeserve.services.router import Router

    router = Router.__new__(Router)  # the metric reads only the queues: no engine needed
    router._active, router._waiting, router._preempted = [object()] * 3, [object()] * 2, [object()]
    assert router.record_autoscaling_stats() == {"in_flight_requests": 6.0}  # a preempted request still counts


def test_a_router_autoscaling_config_without_policy_gets_the_router_policy():
    from treeserve.services.app import _deployment_options

    data = {"applications": [{"deployments": [{"name": "Router", "autoscaling_config": {
        "min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8}}]}]}
    options = _deployment_options(load_serve_config(data).app.deployment("Router"), {})
    assert options["autoscaling_config"]["policy"] == {
        "policy_function": "treeserve.services.app:router_autoscaling_policy"}


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
