"""The Ray dashboard and console of `treeserve serve` / `demo` (services/config/dashboard.py, services/launch.py): on
loopback by default, another address only with the API's explicit allowance, a taken port or a bad value refused
in one line before Ray starts."""

from __future__ import annotations

import argparse
import socket

import pytest

from treeserve.cli.main import main
from treeserve.cli.serve import add_console_arguments, dashboard_config
from treeserve.services import launch
from treeserve.services.config import DashboardConfig
from treeserve.services.launch import DEFAULT_CONFIG, _check_port_free


def test_loopback_by_default_and_its_url():
    parser = argparse.ArgumentParser()
    add_console_arguments(parser)
    config = dashboard_config(parser.parse_args([]))
    assert (config.enabled, config.host, config.port) == (True, "127.0.0.1", 8265)
    assert config.loopback_only and config.url == "http://127.0.0.1:8265"
    config.check(allow_insecure=False)
    assert not dashboard_config(parser.parse_args(["--no-dashboard"])).enabled
    assert DashboardConfig(host="0.0.0.0", port=8300).url == "http://127.0.0.1:8300"  # where a local browser goes
    assert DashboardConfig(host="::1").url == "http://[::1]:8265"


def test_a_reachable_address_needs_the_apis_allowance():
    reachable = DashboardConfig(host="0.0.0.0")
    with pytest.raises(ValueError, match="security.allow_insecure"):
        reachable.check(allow_insecure=False)
    reachable.check(allow_insecure=True)  # what lets a plaintext API listen beyond loopback
    DashboardConfig(enabled=False, host="0.0.0.0").check(allow_insecure=False)  # off: nothing to refuse
    with pytest.raises(ValueError, match="--dashboard-port: must be a TCP port"):
        DashboardConfig(port=70000).check(allow_insecure=False)


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_the_cli_refuses_in_one_line(command, capsys):
    """Refused before Ray starts: exit status 2, one line naming what to change, no traceback."""
    rc = main([command, "--config", str(DEFAULT_CONFIG), "--method", "autoregressive", "--dashboard-host",
               "0.0.0.0"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"treeserve {command}: error: --dashboard-host 0.0.0.0:" in err and "security.allow_insecure" in err
    assert "Traceback" not in err


def test_a_taken_port_is_named_with_the_flags_to_change():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"127.0.0.1:{port} .*--dashboard-port N, or --no-dashboard"):
            _check_port_free("127.0.0.1", port)
    _check_port_free("127.0.0.1", port)  # free again


def test_start_progress_reports_each_change_of_running_replicas(monkeypatch):
    """While serve.run waits, one line per change of the running / wanted replicas (serve.status()), none
    while nothing changes or before the application is known."""
    import time
    from types import SimpleNamespace

    from ray import serve

    def app(router, drafter, target):
        return SimpleNamespace(applications={"treeserve": SimpleNamespace(deployments={
            "Router": SimpleNamespace(replica_states=router), "Drafter": SimpleNamespace(replica_states=drafter),
            "Target": SimpleNamespace(replica_states=target)})})

    states = [SimpleNamespace(applications={}),
              app({"STARTING": 1}, {"STARTING": 1}, {"STARTING": 2}),
              app({"STARTING": 1}, {"STARTING": 1}, {"STARTING": 2}),
              app({"RUNNING": 1}, {"STARTING": 1}, {"RUNNING": 1, "STARTING": 1}),
              app({"RUNNING": 1}, {"RUNNING": 1}, {"RUNNING": 2})]
    monkeypatch.setattr(serve, "status", lambda: states.pop(0) if len(states) > 1 else states[0])
    monkeypatch.setattr(launch._ReplicaProgress, "PERIOD_S", 0.01)
    lines: list[str] = []
    with launch._ReplicaProgress("treeserve", lines.append):
        deadline = time.monotonic() + 10
        while len(lines) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert lines == ["replicas running: Router 0/1, Drafter 0/1, Target 0/2",
                     "replicas running: Router 1/1, Drafter 0/1, Target 1/2",
                     "replicas running: Router 1/1, Drafter 1/1, Target 2/2"]
    with launch._ReplicaProgress("treeserve", None) as idle:  # no callback: no thread
        assert not idle.thread.is_alive()

