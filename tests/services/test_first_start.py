"""A first start (services/launch.py): the embedded target's conversion starts in a child process before Ray does,
announced; on a Ray instance started here the replicas start beside it and wait for it on the cache's lock, a
joined cluster's only after it; a failed conversion is its own one-line error; the commands that start the
service import no torch of their own before they bind the replicas."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import ray.serve
from fake_conversion import CONVERTS  # tests/fake_conversion.py

from treeserve.engine.models import conversion
from treeserve.engine.models.paths import gguf_and_cache_dir, is_current
from treeserve.services import app as service_app
from treeserve.services import launch
from treeserve.services.launch import DEFAULT_CONFIG, load_config


def test_a_first_start_says_it_converts_the_embedded_target(tmp_path, monkeypatch):
    """With an empty model cache a start announces the one-off conversion, which runs in a child process while Ray
    starts (load_config converts nothing); with the cache current there is nothing to convert or say."""
    started: list = []

    def start(path):  # the real launcher, with tests/fake_conversion.py's child instead of a real conversion
        started.append(path)
        return conversion.start_conversion(path, CONVERTS)

    monkeypatch.setenv("TREESERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(launch, "start_conversion", start)
    args = load_config(str(DEFAULT_CONFIG), method="autoregressive").app.args
    assert not is_current(*gguf_and_cache_dir("default"))
    lines: list[str] = []
    converting = launch._prepare_target(args, lines.append)
    assert converting.result(timeout=60) == tmp_path / "models" / "smollm2-135m-instruct"
    assert len(lines) == 1 and "converting the target's GGUF" in lines[0] and started == ["default"]
    assert launch._prepare_target(args, lines.append) is None  # cached: nothing to convert or say
    assert len(lines) == 1 and is_current(*gguf_and_cache_dir("default"))


def test_the_commands_that_start_the_service_import_without_torch():
    """`treeserve serve` / `demo` load torch only when they bind the replicas, or never for a start with nothing to
    convert before Ray starts: their modules, the launcher and its conversion's starter import none of the heavy
    libraries (the conversion's torch is its child process's)."""
    code = ("import sys\nimport treeserve.cli.serve, treeserve.cli.demo, treeserve.services.launch\n"
            "print(sorted(m for m in ('torch', 'transformers', 'ray', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


class _Conversion:
    """What _run_app reads of a conversion: done() and result(); records when it was waited for."""

    def __init__(self, events: list[str], done: bool, error: Exception | None = None):
        self.events, self.finished, self.error = events, done, error

    def done(self) -> bool:
        return self.finished

    def result(self, timeout=None):
        self.events.append("conversion waited for")
        self.finished = True
        if self.error is not None:
            raise self.error
        return "model dir"


@pytest.fixture
def serve_run(monkeypatch):
    """serve.run and the application it gets, recorded instead of run; each callable put in `during` runs inside
    serve.run (an exception it raises is serve.run's)."""
    events: list[str] = []
    during: list = []

    def run(application, name, route_prefix):
        events.append("serve.run")
        for call in during:
            call()

    monkeypatch.setattr(ray.serve, "run", run)
    monkeypatch.setattr(service_app, "build_app_from_config", lambda app, args: "application")
    return events, during


def _app():
    return load_config(str(DEFAULT_CONFIG), method="autoregressive").app


def test_a_local_start_starts_the_replicas_beside_the_conversion(serve_run):
    events, _ = serve_run
    lines: list[str] = []
    launch._run_app(_app(), _Conversion(events, done=False), False, lines.append)
    assert events == ["serve.run"]  # not waited for: the replicas wait on the cache's lock themselves
    assert lines == ["starting the replicas (Router, Drafter, Target); they load the target once it is converted ..."]


def test_a_joined_cluster_starts_the_replicas_after_the_conversion(serve_run):
    events, _ = serve_run
    lines: list[str] = []
    launch._run_app(_app(), _Conversion(events, done=False), True, lines.append)
    assert events == ["conversion waited for", "serve.run"]
    assert lines == ["Ray started; waiting for the target's conversion ...",
                     "starting the replicas (Router, Drafter, Target) ..."]


def test_a_conversion_that_already_failed_stops_the_start_before_the_replicas(serve_run):
    events, _ = serve_run
    with pytest.raises(ValueError, match="not a readable GGUF"):
        launch._run_app(_app(), _Conversion(events, True, ValueError("x.gguf is not a readable GGUF model")), False,
                        None)
    assert events == ["conversion waited for"]


def test_a_conversion_failing_under_the_replicas_is_the_error_shown(serve_run):
    """The replicas fail after it (each finds no model); what the start reports is the conversion's reason."""
    events, during = serve_run
    converting = _Conversion(events, done=False, error=ValueError("x.gguf is not a readable GGUF model"))

    def replicas_fail():
        converting.finished = True  # it ended (badly) while the replicas started
        raise RuntimeError("Deploying application treeserve failed: ... many lines")

    during.append(replicas_fail)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        launch._run_app(_app(), converting, False, None)
    assert events == ["serve.run", "conversion waited for"]


def test_the_progress_says_once_when_the_conversion_has_ended(monkeypatch):
    monkeypatch.setattr(ray.serve, "status", lambda: SimpleNamespace(applications={}))
    monkeypatch.setattr(launch._ReplicaProgress, "PERIOD_S", 0.01)
    converting = _Conversion([], done=False)
    lines: list[str] = []
    with launch._ReplicaProgress("treeserve", lines.append, converting):
        time.sleep(0.05)
        assert lines == []  # still converting
        converting.finished = True
        deadline = time.monotonic() + 10
        while not lines and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
    assert lines == ["the target's conversion has ended; the replicas load it"]
