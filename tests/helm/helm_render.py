"""Rendering helm/treeserve for the chart tests: the helm binary, `helm template` into objects by kind/name,
the presets and what the rendered RayService holds (Serve config, worker groups, their Ray resources)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import kuberay_sim as kr  # tests/helm/kuberay_sim.py (this folder is on sys.path under pytest)
from treeserve.services.config import load_serve_config

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "treeserve"
PRESETS = sorted((CHART / "presets").glob("*.yaml"))
DEPLOY = ROOT / "deploy"
# preset -> the deploy/ layout it mirrors
MIRRORS = {"cpu-demo": "local-cpu", "llama2-70b-4xa100": "llama2-70b-4xa100",
           "llama2-70b-5xa100": "llama2-70b-5xa100", "vicuna-33b-4xa100": "vicuna-33b-4xa100",
           "llama2-70b-chat-eagle-4xa100": "llama2-70b-chat-eagle-4xa100",
           "vicuna-33b-eagle-4xa100": "vicuna-33b-eagle-4xa100",
           "llama3.3-70b-eagle3-4xa100": "llama3.3-70b-eagle3-4xa100",
           "llama3.3-70b-eagle3-4xh100": "llama3.3-70b-eagle3-4xh100",
           "qwen2.5-72b-4xh100": "qwen2.5-72b-4xh100",
           "qwen2.5-32b-1xh100": "qwen2.5-32b-1xh100", "qwen2.5-32b-1xh200": "qwen2.5-32b-1xh200"}
# GPU presets: GPUs of the node the target's pod fills, GPUs in the whole layout
GPU_PRESETS = {"llama2-70b-4xa100": (4, 4), "vicuna-33b-4xa100": (4, 4), "llama2-70b-5xa100": (4, 5),
               "llama2-70b-chat-eagle-4xa100": (4, 4), "vicuna-33b-eagle-4xa100": (4, 4),
               "llama3.3-70b-eagle3-4xa100": (4, 4), "llama3.3-70b-eagle3-4xh100": (4, 4),
               "qwen2.5-72b-4xh100": (4, 4), "qwen2.5-32b-1xh100": (1, 1), "qwen2.5-32b-1xh200": (1, 1)}
# Every optional feature at once: what a demanding install turns on.
EVERYTHING = ("dashboard.service.enabled=true", "metrics.serviceMonitor.enabled=true",
              "dashboard.grafanaHost=http://grafana.monitoring.svc", "dashboard.prometheusHost=http://prom.monitoring.svc:9090",
              "ray.head.priorityClassName=high", "ray.targetWorkers.priorityClassName=high",
              "ray.drafterWorkers.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].key=pool",
              "ray.drafterWorkers.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
              "extraEnv[0].name=HTTPS_PROXY", "extraEnv[0].value=http://proxy:3128",
              "ray.targetWorkers.env[0].name=NCCL_IB_DISABLE", "ray.targetWorkers.env[0].value=1",
              "podLabels.team=llm", "podAnnotations.owner=llm-team", "imagePullSecrets[0].name=ghcr",
              "ingress.enabled=true", "ingress.tls.secretName=treeserve-ingress-tls",
              "service.type=LoadBalancer", "service.nodePort=30900", "api.httpPort=9001", "service.httpNodePort=30901")
CLUSTER = "treeserve-raycluster-x7k2p"  # a RayCluster name as the RayService controller makes them


def _find_helm() -> str | None:
    candidates = [os.environ.get("HELM"), str(ROOT / ".cache" / "tools" / "helm" / "helm"), shutil.which("helm")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


HELM = _find_helm()
needs_helm = pytest.mark.skipif(
    HELM is None, reason="helm not found: set HELM, put it on PATH, or fetch it into .cache/tools/helm/helm "
                         "(`make tools`, see docs/kubernetes.md)")


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)


def _args(chart, values, sets) -> list[str]:
    args = ["template", "treeserve", str(chart)]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    return args


def render(*values, sets: tuple[str, ...] = (), chart: Path = CHART) -> dict[str, dict]:
    result = helm(*_args(chart, values, sets))
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def render_error(*values, sets: tuple[str, ...] = (), chart: Path = CHART) -> str:
    result = helm(*_args(chart, values, sets))
    assert result.returncode != 0, "expected helm to reject these values"
    return result.stderr


def preset(name: str) -> Path:
    return CHART / "presets" / f"{name}.yaml"


def serve_config(objs: dict):
    return load_serve_config(yaml.safe_load(objs["RayService/treeserve"]["spec"]["serveConfigV2"]))


def groups(objs: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in objs["RayService/treeserve"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def ray_resources(group: dict) -> dict[str, float]:
    """A worker group's custom Ray resources, parsed the way Ray's KubeRay autoscaler parses rayStartParams
    (ray/autoscaler/_private/kuberay/autoscaling_config.py _get_custom_resources)."""
    raw = group["rayStartParams"].get("resources")
    if raw is None:
        return {}
    parsed = json.loads(raw[1:-1].replace("\\", ""))
    assert all(isinstance(v, int) for v in parsed.values()), "the autoscaler accepts integer custom resources only"
    return parsed


def cluster_pods(objs: dict) -> list[dict]:
    """The pods KubeRay makes from the rendered RayService (tests/helm/kuberay_sim.py)."""
    return kr.cluster_pods(objs["RayService/treeserve"], CLUSTER)


def pod_specs(objs: dict) -> list[tuple[str, dict]]:
    """(name, pod spec) of the head, every worker group and the chart's own Pods (the `helm test` hook)."""
    rs = objs["RayService/treeserve"]["spec"]["rayClusterConfig"]
    out = [("head", rs["headGroupSpec"]["template"]["spec"])]
    out += [(g["groupName"], g["template"]["spec"]) for g in rs["workerGroupSpecs"]]
    out += [(k, v["spec"]) for k, v in objs.items() if k.startswith("Pod/")]
    return out
