"""deploy/grafana/treeserve.json (the chart ships the same file): every panel's query names metrics, and labels of
them, that a running service exports. The service is the session's `serve_service` (Router, Drafter, Target on
Ray Serve); the check reads Ray's Prometheus endpoint, so metrics added to services/metrics.py later are judged by
what the service exports then, not by a list kept here."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from treeserve.v1 import generation_pb2 as gen
from treeserve.v1 import generation_pb2_grpc as gen_grpc

ROOT = Path(__file__).resolve().parents[2]
BOARD = ROOT / "deploy" / "grafana" / "treeserve.json"
CHART_BOARD = ROOT / "helm" / "treeserve" / "dashboards" / "treeserve.json"

METRIC = re.compile(r"\bray_[A-Za-z0-9_:]+")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
MATCHER = re.compile(r"\{([^}]*)\}")
LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s")
SAMPLE_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="')


def board_queries(board: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            out.append((f"variable {variable['name']!r}", query["query"] if isinstance(query, dict) else query))
    return out


def references(expr: str) -> tuple[set[str], set[str]]:
    """The metric names of a query and the label names it groups or matches by."""
    labels = {name.strip() for group in GROUPING.findall(expr) for name in group.split(",") if name.strip()}
    labels |= {name for body in MATCHER.findall(expr) for name in LABEL.findall(body)}
    variable = re.match(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)", expr)
    if variable:
        labels.add(variable.group(2))
    return set(METRIC.findall(MATCHER.sub("{}", expr))), labels


def exported(text: str) -> dict[str, set[str]]:
    """metric name -> the label names its series carry, from Prometheus text."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match and not line.startswith("#"):
            out.setdefault(match.group(1), set()).update(SAMPLE_LABEL.findall(match.group(2) or ""))
    return out


def unresolved(board: dict, series: dict[str, set[str]]) -> list[str]:
    problems = []
    for where, expr in board_queries(board):
        metrics, labels = references(expr)
        if not metrics:
            problems.append(f"{where}: names no ray_* metric: {expr}")
        for metric in sorted(metrics):
            if metric not in series:
                problems.append(f"{where}: {metric} is not exported")
            elif labels - series[metric]:
                problems.append(f"{where}: {metric} has no label {sorted(labels - series[metric])}")
    return problems


def test_the_chart_ships_the_same_board():
    assert CHART_BOARD.read_bytes() == BOARD.read_bytes(), \
        "helm/treeserve/dashboards/treeserve.json and deploy/grafana/treeserve.json differ: copy one over the other"


def test_the_query_reader_finds_names_and_labels():
    metrics, labels = references('sum by (code) (rate(ray_treeserve_requests_total{code!="OK", '
                                 'application=~"$application"}[$__rate_interval])) / '
                                 'histogram_quantile(0.9, sum by (le) (rate(ray_x_bucket[5m])))')
    assert metrics == {"ray_treeserve_requests_total", "ray_x_bucket"}
    assert labels == {"code", "application", "le"}
    series = exported('# HELP ray_a a\nray_a{code="OK",x="1"} 1.0\nray_b 2.0\n')
    assert series == {"ray_a": {"code", "x"}, "ray_b": set()}
    board = {"panels": [{"title": "t", "targets": [{"refId": "A", "expr": "sum by (code) (ray_a) + ray_c"}]},
                        {"title": "u", "targets": [{"refId": "A", "expr": "sum by (code) (ray_b)"}]}],
             "templating": {"list": []}}
    assert unresolved(board, series) == ["panel 't' A: ray_c is not exported", "panel 'u' A: ray_b has no label ['code']"]


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def test_every_panel_query_resolves_against_a_live_scrape(serve_service, ray_session):
    """Requests of a speculative and the plain method, greedy (run-ahead drafting) and sampled, one refused, all
    on one prompt longer than a KV page (the later ones reuse its cached prefix); then every query's metrics
    and labels are in Ray's export (Serve's own series included)."""
    board = json.loads(BOARD.read_text())
    prompt = "Count these: " + ", ".join(f"item {i}" for i in range(40)) + "."
    with serve_service.channel() as channel:
        stub = gen_grpc.TreeServeStub(channel)
        for method in (gen.TREE_METHOD_DYSPEC, gen.TREE_METHOD_AUTOREGRESSIVE):
            for temperature in (0.0, 0.8):
                list(stub.GenerateStream(gen.GenerateRequest(
                    text=prompt, max_new_tokens=12, speculation=gen.SpeculationParams(method=method),
                    sampling=gen.SamplingParams(temperature=temperature)), timeout=60))
        with pytest.raises(grpc.RpcError):
            stub.Generate(gen.GenerateRequest(text="hi", max_new_tokens=0), timeout=30)
    deadline = time.monotonic() + 90
    while True:
        series = exported(_scrape(ray_session.metrics_port))
        problems = unresolved(board, series)
        if not problems or time.monotonic() > deadline:
            break
        time.sleep(2)  # the metrics agent exports every METRICS_REPORT_INTERVAL_MS
    names = sorted(name for name in series if name.startswith(("ray_treeserve_", "ray_serve_")))
    assert not problems, "\n".join(problems) + f"\nexported: {names}"
