"""helm/treeserve: lint and render every preset, validate the RayService against KubeRay's own CRD schemas,
check what KubeRay will make of it (pod labels vs every Service's selector, GPUs and CPUs per pod), and load
the embedded serveConfigV2 with the same parser the service uses. Skipped when no helm binary is available."""

from __future__ import annotations

import base64
import copy
import itertools
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import kuberay_sim as kr  # tests/helm/kuberay_sim.py (this folder is on sys.path under pytest)
from crd_schema import load_schema, problems, vendored_tags
from treeserve.services.config import load_serve_config

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "treeserve"
PRESETS = sorted((CHART / "presets").glob("*.yaml"))
DEPLOY = ROOT / "deploy"
# preset -> the deploy/ layout it mirrors
MIRRORS = {"cpu-demo": "local-cpu", "llama2-70b-4xa100": "llama2-70b-4xa100",
           "llama2-70b-5xa100": "llama2-70b-5xa100", "vicuna-33b-4xa100": "vicuna-33b-4xa100",
           "llama2-70b-chat-eagle-4xa100": "llama2-70b-chat-eagle-4xa100",
           "vicuna-33b-eagle-4xa100": "vicuna-33b-eagle-4xa100"}
# GPU presets: GPUs of the node the target's pod fills, GPUs in the whole layout
GPU_PRESETS = {"llama2-70b-4xa100": (4, 4), "vicuna-33b-4xa100": (4, 4), "llama2-70b-5xa100": (4, 5),
               "llama2-70b-chat-eagle-4xa100": (4, 4), "vicuna-33b-eagle-4xa100": (4, 4)}
CLUSTER = "treeserve-raycluster-x7k2p"  # a RayCluster name as the RayService controller makes them


def _find_helm() -> str | None:
    candidates = [os.environ.get("HELM"), str(ROOT / ".cache" / "tools" / "helm" / "helm"), shutil.which("helm")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


HELM = _find_helm()
pytestmark = pytest.mark.skipif(
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


# ------------------------------------------------------------------------------------------ render + lint
def test_presets_exist():
    assert {p.stem for p in PRESETS} == set(MIRRORS)


@pytest.mark.parametrize("values", [None, *PRESETS], ids=lambda p: "defaults" if p is None else p.stem)
def test_lint(values):
    result = helm("lint", str(CHART), "--strict", *(["-f", str(values)] if values else []))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", PRESETS, ids=lambda p: p.stem)
def test_render_preset(values):
    objs = render(values)
    v = yaml.safe_load(values.read_text())
    rs = objs["RayService/treeserve"]
    assert rs["apiVersion"] == "ray.io/v1"

    # The serve config is exactly what the service parses, and says what the preset says.
    serve = serve_config(objs)
    args = serve.app.args
    tp = v["target"]["tensorParallelSize"]
    assert args.target.path == v["target"]["path"] and args.target.tensor_parallel_size == tp
    assert args.target.num_attention_heads == v["target"]["numAttentionHeads"]
    assert args.speculation.method == v["speculation"]["method"]
    assert args.speculation.budget == v["speculation"]["budget"]
    assert args.limits.max_batch_size == v["limits"]["maxBatchSize"]
    assert serve.logging_config.enable_access_log is False
    assert serve.grpc_options.grpc_servicer_functions == []  # Serve's own gRPC proxy stays off
    assert (args.api.host, args.api.port) == ("0.0.0.0", 9000)
    assert args.security.tls and args.security.auth_token_file == "/etc/treeserve/auth/tokens"
    for name, key in (("Router", "router"), ("Drafter", "drafter"), ("Target", "target")):
        auto = serve.app.deployment(name).autoscaling_config
        want = v["serve"][key]
        assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (
            want["minReplicas"], want["maxReplicas"], want["targetOngoingRequests"])

    # It is the deploy/ layout it mirrors: same models, KV pools, memory shares, method, limits, API, and on GPUs
    # the same GPU shares and placement resources.
    layout = load_serve_config(DEPLOY / f"{MIRRORS[values.stem]}.yaml").app
    for role in ("target", "drafter"):
        mine, theirs = getattr(args, role), getattr(layout.args, role)
        assert (mine.path, mine.dtype, mine.device, mine.tensor_parallel_size, mine.max_context_tokens,
                mine.gpu_memory_fraction) == (theirs.path, theirs.dtype, theirs.device, theirs.tensor_parallel_size,
                                              theirs.max_context_tokens, theirs.gpu_memory_fraction)
        assert args.kv_sessions(role) == layout.args.kv_sessions(role)
    # the chat template and a published head's declared layout travel into the serve config
    assert (args.target.chat_template, args.drafter.layout) == (layout.args.target.chat_template,
                                                                layout.args.drafter.layout)
    assert args.speculation == layout.args.speculation and args.limits == layout.args.limits
    assert args.api.port == layout.args.api.port
    assert args.api.http_port == layout.args.api.http_port == v.get("api", {}).get("httpPort")  # OpenAI HTTP API
    if args.target.device == "cuda":
        assert args.security == layout.args.security  # the same mount paths as the layout's
        for name in ("Router", "Drafter", "Target"):
            mine, theirs = serve.app.deployment(name), layout.deployment(name)
            assert mine.rank_gpu_shares() == theirs.rank_gpu_shares()
            assert mine.ray_actor_options.num_gpus == theirs.ray_actor_options.num_gpus
            assert mine.ray_actor_options.resources == theirs.ray_actor_options.resources
            assert mine.placement_group_bundles == theirs.placement_group_bundles
            assert mine.autoscaling_config.max_replicas == theirs.autoscaling_config.max_replicas

    # Pods: probes, metrics, image variant, model volume.
    cluster = rs["spec"]["rayClusterConfig"]
    cuda = v["target"]["device"] == "cuda"
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    for pod in [head["template"], *(g["template"] for g in groups(objs).values())]:
        ctr = pod["spec"]["containers"][0]
        assert ctr["livenessProbe"]["httpGet"]
        assert ctr["readinessProbe"].get("httpGet") or ctr["readinessProbe"].get("tcpSocket")
        assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        assert {p["name"] for p in ctr["ports"]} >= {"serve", "metrics"}
        assert ctr["image"].endswith("-cuda" if cuda else "-cpu")
        mounts = {m["name"]: m for m in ctr["volumeMounts"]}
        assert ("models" in mounts) == (v["modelVolume"]["type"] != "none")
    assert {"name": "dashboard", "containerPort": 8265} in head["template"]["spec"]["containers"][0]["ports"]

    svc = objs["Service/treeserve-grpc"]
    want_ports = {"grpc": 9000} if args.api.http_port is None else {"grpc": 9000, "http": args.api.http_port}
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == want_ports


@pytest.mark.parametrize("values", PRESETS, ids=lambda p: p.stem)
def test_serve_config_accepted_by_ray_serve_schema(values):
    schema = pytest.importorskip("ray.serve.schema")
    text = render(values)["RayService/treeserve"]["spec"]["serveConfigV2"]
    schema.ServeDeploySchema.model_validate(yaml.safe_load(text))


# ------------------------------------------------------------------------------------------ KubeRay's CRD
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


@pytest.mark.parametrize("tag", vendored_tags())
@pytest.mark.parametrize("values, sets", [(None, ()), *((p, ()) for p in PRESETS), (None, EVERYTHING),
                                          (preset("llama2-70b-4xa100"), EVERYTHING)],
                         ids=["defaults", *(p.stem for p in PRESETS), "defaults+everything", "4xa100+everything"])
def test_rayservice_passes_kuberay_crd_schema(tag, values, sets):
    """No field rejected, none silently dropped, by the API server with KubeRay `tag`'s RayService CRD."""
    rs = render(*([values] if values else []), sets=sets)["RayService/treeserve"]
    schema = load_schema(tag)
    assert schema["group"] == "ray.io" and schema["kind"] == "RayService" and schema["served"]
    assert problems(rs, schema["openAPIV3Schema"]) == []


def test_the_crd_check_finds_dropped_and_rejected_fields():
    rs = render()["RayService/treeserve"]
    bad = copy.deepcopy(rs)
    worker = bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    worker["template"]["spec"]["containers"][0]["gpus"] = 1  # no such container field
    worker["replicas"] = "1"  # a string where the CRD wants an integer
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # rayStartParams are strings
    found = problems(bad, load_schema("v1.7.0")["openAPIV3Schema"])
    assert any("containers[0].gpus: not in the CRD schema" in p for p in found)
    assert any("workerGroupSpecs[0].replicas: must be integer" in p for p in found)
    assert any("rayStartParams.num-cpus: must be string" in p for p in found)
    # A field only newer KubeRay knows is dropped by the oldest supported one.
    newer = copy.deepcopy(rs)
    newer["spec"]["upgradeStrategy"] = {"type": "NewCluster"}
    assert problems(newer, load_schema("v1.7.0")["openAPIV3Schema"]) == []
    assert problems(newer, load_schema("v1.1.0")["openAPIV3Schema"]) == [
        "spec.upgradeStrategy: not in the CRD schema (the API server would drop it)"]


def test_vendored_crds_state_their_source_and_the_chart_its_minimum():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    minimum = chart["annotations"]["treeserve.io/kuberay-min-version"]
    tags = vendored_tags()
    assert f"v{minimum}" in tags and len(tags) >= 2  # the oldest supported and a current release
    for tag in tags:
        source = load_schema(tag)["source"]
        assert source["repository"] == "https://github.com/ray-project/kuberay" and source["tag"] == tag
        assert source["path"] == "helm-chart/kuberay-operator/crds/ray.io_rayservices.yaml"
        assert len(source["commit"]) == 40 and len(source["sha256"]) == 64
    assert tags[0] == f"v{minimum}"
    assert minimum in (CHART / "templates" / "_helpers.tpl").read_text()
    # The live check's marker field exists from the minimum version on (and so in every later one).
    for tag in tags:
        items = load_schema(tag)["openAPIV3Schema"]["properties"]["spec"]["properties"]["rayClusterConfig"][
            "properties"]["workerGroupSpecs"]["items"]["properties"]
        assert "numOfHosts" in items


# ------------------------------------------------------------------------- labels vs Services' selectors
def _pods(objs: dict) -> list[dict]:
    return kr.cluster_pods(objs["RayService/treeserve"], CLUSTER)


@pytest.mark.parametrize("values", [None, *PRESETS], ids=lambda p: "defaults" if p is None else p.stem)
def test_every_service_selects_the_pods_it_serves(values):
    objs = render(*([values] if values else []), sets=("dashboard.service.enabled=true", "metrics.serviceMonitor.enabled=true"))
    pods = _pods(objs)
    head = next(p for p in pods if p["node_type"] == "head")
    workers = [p for p in pods if p["node_type"] == "worker"]

    # KubeRay's own Services: <rayservice>-head-svc (the dashboard's, `kubectl port-forward` in NOTES.txt) and
    # the RayCluster's head Service select the head pod; the serve Service selects healthy proxies.
    assert kr.selects(kr.rayservice_head_service_selector(CLUSTER), head["labels"])
    assert kr.selects(kr.raycluster_head_service_selector(CLUSTER, head["template"]["metadata"]["labels"]),
                      head["labels"])
    assert not any(kr.selects(kr.rayservice_head_service_selector(CLUSTER), w["labels"]) for w in workers)

    # The chart's API Service: exactly the router group's pods, never the head or another group.
    config = serve_config(objs)
    router_group = next(g for g in groups(objs).values() if ray_resources(g).get("TreeServeRouter"))
    api = objs["Service/treeserve-grpc"]["spec"]["selector"]
    assert [p["group"] for p in pods if kr.selects(api, p["labels"])] == [router_group["groupName"]]
    assert config.app.deployment("Router").ray_actor_options.resources == {"TreeServeRouter": 1.0}
    router_pod = next(p for p in workers if p["group"] == router_group["groupName"])
    ctr = router_pod["template"]["spec"]["containers"][0]
    assert {"name": "api", "containerPort": 9000} in ctr["ports"]  # the Service's targetPort
    assert objs["Service/treeserve-grpc"]["spec"]["ports"][0]["targetPort"] == "api"
    # ready only once a Router listens there: pods of the group without one get no API traffic
    assert ctr["readinessProbe"]["tcpSocket"]["port"] == 9000

    # The chart's dashboard Service and metrics Services.
    assert [p["group"] for p in pods if kr.selects(objs["Service/treeserve-dashboard"]["spec"]["selector"],
                                                   p["labels"])] == [kr.HEAD_GROUP]
    assert {p["group"] for p in pods if kr.selects(objs["Service/treeserve-metrics"]["spec"]["selector"],
                                                   p["labels"])} == {p["group"] for p in pods}
    assert [p["group"] for p in pods if kr.selects(objs["Service/treeserve-head-metrics"]["spec"]["selector"],
                                                   p["labels"])] == [kr.HEAD_GROUP]
    for name in ("treeserve-dashboard", "treeserve-metrics", "treeserve-head-metrics"):
        svc = objs[f"Service/{name}"]
        selected = [p for p in pods if kr.selects(svc["spec"]["selector"], p["labels"])]
        port_names = {p["name"] for pod in selected for p in pod["template"]["spec"]["containers"][0]["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names, name


def test_relabelling_the_pods_app_name_would_orphan_the_dashboard_service():
    """What the chart used to do (pods labelled app.kubernetes.io/name: treeserve): KubeRay's RayService head
    Service then matches no pod. The chart now refuses that label."""
    rs = render()["RayService/treeserve"]
    rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] = "treeserve"
    head = kr.cluster_pods(rs, CLUSTER)[0]
    assert not kr.selects(kr.rayservice_head_service_selector(CLUSTER), head["labels"])
    assert "podLabels.app.kubernetes.io/name" in render_error(sets=("podLabels.app\\.kubernetes\\.io/name=treeserve",))


def test_notes_point_at_services_that_exist(tmp_path):
    """NOTES.txt, rendered (as a ConfigMap in a copy of the chart: `helm template` skips NOTES.txt)."""
    chart = tmp_path / "treeserve"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "notes.txt")
    (chart / "templates" / "notes-under-test.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n  notes: |\n'
        '{{ tpl (.Files.Get "notes.txt") . | indent 4 }}\n')
    objs = render(preset("cpu-demo"), chart=chart)
    notes = objs["ConfigMap/notes"]["data"]["notes"]
    assert "kubectl port-forward -n default svc/treeserve-grpc 9000:9000" in notes
    assert f"svc/{kr.head_service_name('treeserve')} 8265:8265" in notes
    assert "--tls-ca treeserve-ca.crt --token-file treeserve-token" in notes
    assert "kubectl get secret treeserve-tls" in notes and "kubectl get secret treeserve-auth" in notes
    assert "helm test treeserve" in notes
    # the preset's OpenAI-compatible HTTP API: its own port-forward and a curl with the same CA and token
    assert "kubectl port-forward -n default svc/treeserve-grpc 9001:9001" in notes
    assert ('curl --cacert treeserve-ca.crt -H "Authorization: Bearer $(cat treeserve-token)" '
            "https://localhost:9001/v1/chat/completions") in notes
    assert "base_url https://localhost:9001/v1" in notes
    without_http = render(preset("cpu-demo"), sets=("api.httpPort=null",), chart=chart)["ConfigMap/notes"]["data"]["notes"]
    assert "9001" not in without_http and "curl" not in without_http
    with_service = render(preset("cpu-demo"), sets=("dashboard.service.enabled=true",), chart=chart)
    assert "svc/treeserve-dashboard 8265:8265" in with_service["ConfigMap/notes"]["data"]["notes"]


# --------------------------------------------------------------------------------- GPUs and CPUs per pod
def _fits_any_order(gpus: int, requests: list[float]) -> bool:
    """Ray's GPU instance allocation, every arrival order: a whole-GPU request takes free GPUs, a fractional one
    the first GPU with room."""
    for order in set(itertools.permutations(requests)):
        free = [1.0] * gpus
        for request in order:
            if request >= 1:
                whole = [i for i, f in enumerate(free) if f >= 1 - 1e-9][:int(request)]
                if len(whole) < request:
                    return False
                for i in whole:
                    free[i] = 0.0
            elif request > 0:
                room = next((i for i, f in enumerate(free) if f >= request - 1e-9), None)
                if room is None:
                    return False
                free[room] -= request
    return True


def _pod_worst_case(objs: dict, group: dict) -> tuple[float, list[float]]:
    """CPUs and GPU requests of everything that can land on one pod of `group` at once: the custom resources
    it advertises bound how many replicas of each deployment it takes."""
    app = serve_config(objs).app
    slots = ray_resources(group)
    cpus, gpus = 0.0, []
    for name, resource in (("Target", "TreeServeTarget"), ("Drafter", "TreeServeDrafter"), ("Router", "TreeServeRouter")):
        d = app.deployment(name)
        bundles = d.placement_group_bundles
        needs = bundles[0].get(resource, 0) if bundles else d.ray_actor_options.resources.get(resource, 0)
        assert needs == 1, f"{name} must ask for {resource}"
        for _ in range(int(slots.get(resource, 0))):
            if bundles:
                cpus += sum(b.get("CPU", 0) for b in bundles)
                gpus += [b["GPU"] for b in bundles if b.get("GPU")]
            else:
                cpus += d.ray_actor_options.num_cpus
                gpus += [d.ray_actor_options.num_gpus] if d.ray_actor_options.num_gpus else []
    return cpus, gpus


@pytest.mark.parametrize("values", [None, *PRESETS], ids=lambda p: "defaults" if p is None else p.stem)
def test_whatever_lands_on_a_pod_fits_it(values):
    objs = render(*([values] if values else []))
    app = serve_config(objs).app
    capacity = {"Target": 0, "Drafter": 0, "Router": 0}
    for group in groups(objs).values():
        ctr = group["template"]["spec"]["containers"][0]
        pod_gpus = int(ctr["resources"]["limits"].get("nvidia.com/gpu", 0))
        assert int(group["rayStartParams"].get("num-gpus", 0)) == pod_gpus
        assert int(ctr["resources"]["requests"].get("nvidia.com/gpu", 0)) == pod_gpus
        cpus, gpu_requests = _pod_worst_case(objs, group)
        assert cpus <= int(group["rayStartParams"]["num-cpus"]), group["groupName"]
        assert _fits_any_order(pod_gpus, gpu_requests), (group["groupName"], pod_gpus, gpu_requests)
        slots = ray_resources(group)
        for name, resource in (("Target", "TreeServeTarget"), ("Drafter", "TreeServeDrafter"), ("Router", "TreeServeRouter")):
            capacity[name] += slots.get(resource, 0) * group["maxReplicas"]
    for name, can in capacity.items():
        assert app.deployment(name).autoscaling_config.max_replicas <= can, name


@pytest.mark.parametrize("name", sorted(GPU_PRESETS))
def test_gpu_presets_fill_their_nodes(name):
    node_gpus, layout_gpus = GPU_PRESETS[name]
    objs = render(preset(name))
    app = serve_config(objs).app
    g = groups(objs)
    target_pod = g["target"]["template"]["spec"]["containers"][0]
    assert target_pod["resources"]["limits"]["nvidia.com/gpu"] == node_gpus == app.args.target.tensor_parallel_size
    total = sum(int(x["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0)) for x in g.values())
    assert total == layout_gpus
    drafter = app.deployment("Drafter").ray_actor_options
    if layout_gpus == node_gpus:
        # One node: no drafter pod; the drafter shares the last rank's GPU, and that GPU is exactly full.
        assert set(g) == {"target"}
        shares = app.deployment("Target").rank_gpu_shares()
        assert shares[-1] + drafter.num_gpus == pytest.approx(1.0) and sum(shares) + drafter.num_gpus == node_gpus
        assert ray_resources(g["target"]) == {"TreeServeTarget": 1, "TreeServeDrafter": 1, "TreeServeRouter": 2}
        assert g["target"]["maxReplicas"] == 1  # exactly one node
    else:
        # The drafter's pod advertises no target slot, the target's pod no drafter slot.
        assert ray_resources(g["target"]) == {"TreeServeTarget": 1}
        assert "TreeServeTarget" not in ray_resources(g["drafter"]) and drafter.num_gpus == 1
    # One target replica is one STRICT_PACK group on one pod.
    assert app.deployment("Target").placement_group_strategy == "STRICT_PACK"


def test_tp1_target_on_cuda_gets_its_gpu_on_the_replica_itself():
    """A TP=1 target runs in the replica process: no placement group; the replica holds the GPU (or its share)."""
    objs = render(preset("llama2-70b-4xa100"), sets=("target.path=/models/Llama-2-7b-hf", "target.tensorParallelSize=1",
                                                      "target.numAttentionHeads=32", "target.numKeyValueHeads=32"))
    target = serve_config(objs).app.deployment("Target")
    assert target.placement_group_bundles is None
    assert target.ray_actor_options.num_gpus == pytest.approx(0.55)
    assert target.ray_actor_options.resources == {"TreeServeTarget": 1.0}


# --------------------------------------------------------------------------------- security, pods, hooks
def _pod_specs(objs: dict) -> list[tuple[str, dict]]:
    rs = objs["RayService/treeserve"]["spec"]["rayClusterConfig"]
    out = [("head", rs["headGroupSpec"]["template"]["spec"])]
    out += [(g["groupName"], g["template"]["spec"]) for g in rs["workerGroupSpecs"]]
    out += [(k, v["spec"]) for k, v in objs.items() if k.startswith("Pod/")]
    return out


@pytest.mark.parametrize("values", [None, *PRESETS], ids=lambda p: "defaults" if p is None else p.stem)
def test_pods_run_non_root_on_a_read_only_root(values):
    objs = render(*([values] if values else []))
    for name, spec in _pod_specs(objs):
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 1000
        for ctr in spec["containers"]:
            ctx = ctr["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
            assert ctx["capabilities"]["drop"] == ["ALL"]
            # the image's writable paths, each an emptyDir
            mounts = {m["mountPath"]: m["name"] for m in ctr["volumeMounts"]}
            volumes = {v["name"]: v for v in spec["volumes"]}
            for path in ("/tmp", "/home/ray") + (("/opt/treeserve/cache/profiles",) if name != "Pod/treeserve-test-generate" else ()):
                assert "emptyDir" in volumes[mounts[path]], (name, path)
    auto = objs["RayService/treeserve"]["spec"]["rayClusterConfig"]["autoscalerOptions"]
    assert auto["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in auto["volumeMounts"]} == {"/tmp", "/home/ray"}


def test_generated_tls_certificate_and_token(tmp_path):
    x509 = pytest.importorskip("cryptography.x509")
    objs = render(preset("cpu-demo"))
    tls = objs["Secret/treeserve-tls"]
    assert tls["type"] == "kubernetes.io/tls" and set(tls["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    cert = x509.load_pem_x509_certificate(base64.b64decode(tls["data"]["tls.crt"]))
    ca = x509.load_pem_x509_certificate(base64.b64decode(tls["data"]["ca.crt"]))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert {"treeserve-grpc.default.svc", "treeserve-grpc.default.svc.cluster.local", "localhost"} <= set(names)
    assert cert.issuer == ca.subject
    ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes,
                           __import__("cryptography.hazmat.primitives.asymmetric.padding", fromlist=["PKCS1v15"]).PKCS1v15(),
                           cert.signature_hash_algorithm)
    token = base64.b64decode(objs["Secret/treeserve-auth"]["data"]["tokens"]).decode().strip()
    assert len(token) == 48 and token.isalnum()

    # Mounted read-only into the router pods only, at the paths the serve config names.
    args = serve_config(objs).app.args
    for group in groups(objs).values():
        ctr = group["template"]["spec"]["containers"][0]
        mounts = {m["name"]: m for m in ctr["volumeMounts"]}
        routes = ray_resources(group).get("TreeServeRouter", 0) > 0
        assert ("api-tls" in mounts) == routes and ("api-auth" in mounts) == routes
        if routes:
            assert args.security.tls_cert_file == mounts["api-tls"]["mountPath"] + "/tls.crt"
            assert args.security.auth_token_file == mounts["api-auth"]["mountPath"] + "/tokens"
            assert mounts["api-tls"]["readOnly"] is True


def test_existing_secrets_are_used_as_given():
    objs = render(sets=("security.tls.secretName=my-cert", "security.tls.clientCaFile=client-ca.crt",
                        "security.auth.secretName=my-tokens", "security.auth.tokenFile=api-tokens"))
    assert "Secret/treeserve-tls" not in objs and "Secret/treeserve-auth" not in objs
    volumes = {v["name"]: v for v in groups(objs)["drafter"]["template"]["spec"]["volumes"]}
    assert volumes["api-tls"]["secret"]["secretName"] == "my-cert"
    assert volumes["api-auth"]["secret"]["secretName"] == "my-tokens"
    security = serve_config(objs).app.args.security
    assert security.tls_client_ca_file == "/etc/treeserve/tls/client-ca.crt"
    assert security.auth_token_file == "/etc/treeserve/auth/api-tokens"


def test_plaintext_needs_an_explicit_choice():
    assert "security.allowInsecure" in render_error(sets=("security.tls.enabled=false",))
    objs = render(sets=("security.tls.enabled=false", "security.allowInsecure=true", "security.auth.enabled=false"))
    security = serve_config(objs).app.args.security
    assert not security.tls and security.allow_insecure and security.auth_token_file is None
    assert "Secret/treeserve-tls" not in objs
    assert objs["Service/treeserve-grpc"]["spec"]["ports"][0]["appProtocol"] == "kubernetes.io/h2c"


def test_openai_http_api_port_when_enabled_only():
    """api.httpPort: off by default (no http_port in the serve config, no container or Service port); on, the
    Router's HTTP server port reaches the serve config, the router group's pods (only those) and the API Service,
    whose TLS / token settings it shares."""
    off = render()
    assert serve_config(off).app.args.api.http_port is None
    assert "http_port" not in off["RayService/treeserve"]["spec"]["serveConfigV2"]
    assert [p["name"] for p in off["Service/treeserve-grpc"]["spec"]["ports"]] == ["grpc"]
    for group in groups(off).values():
        assert "openai" not in {p["name"] for p in group["template"]["spec"]["containers"][0]["ports"]}

    for router in ("drafterWorkers", "targetWorkers"):
        objs = render(sets=("api.httpPort=9001", f"placement.router={router}", "placement.drafter=drafterWorkers"))
        args = serve_config(objs).app.args
        assert (args.api.host, args.api.port, args.api.http_port) == ("0.0.0.0", 9000, 9001)
        assert args.security.tls and args.security.auth_token_file == "/etc/treeserve/auth/tokens"
        router_group = next(g for g in groups(objs).values() if ray_resources(g).get("TreeServeRouter"))
        assert router_group["groupName"] == router.removesuffix("Workers")
        for name, group in groups(objs).items():
            ports = group["template"]["spec"]["containers"][0]["ports"]
            assert ({"name": "openai", "containerPort": 9001} in ports) == (group is router_group), name
        svc = objs["Service/treeserve-grpc"]["spec"]
        http = next(p for p in svc["ports"] if p["name"] == "http")
        assert http == {"name": "http", "port": 9001, "targetPort": "openai", "appProtocol": "https"}
        # the Service's selector picks exactly the pods that declare the named targetPort
        pods = [p for p in _pods(objs) if kr.selects(svc["selector"], p["labels"])]
        assert pods and all({"api", "openai"} <= {c["name"] for c in p["template"]["spec"]["containers"][0]["ports"]}
                            for p in pods)

    plain = render(sets=("api.httpPort=9001", "security.tls.enabled=false", "security.allowInsecure=true"))
    assert next(p for p in plain["Service/treeserve-grpc"]["spec"]["ports"] if p["name"] == "http")["appProtocol"] == "http"
    assert not serve_config(plain).app.args.security.tls
    # the ClusterIP default ignores a fixed node port
    assert "nodePort" not in render(sets=("api.httpPort=9001", "service.httpNodePort=30901"))[
        "Service/treeserve-grpc"]["spec"]["ports"][1]


@pytest.mark.parametrize("tag", vendored_tags())
def test_openai_http_api_passes_kuberay_crd_schema(tag):
    rs = render(sets=("api.httpPort=9001",))["RayService/treeserve"]
    assert problems(rs, load_schema(tag)["openAPIV3Schema"]) == []


def test_ingress_requires_tls_and_re_encrypts():
    assert "ingress.enabled needs ingress.tls.enabled" in render_error(
        sets=("ingress.enabled=true", "ingress.tls.enabled=false"))
    assert "ingress.tls.enabled needs ingress.tls.secretName" in render_error(sets=("ingress.enabled=true",))
    objs = render(sets=("ingress.enabled=true", "ingress.tls.secretName=treeserve-ingress-tls"))
    ingress = objs["Ingress/treeserve-grpc"]
    assert ingress["spec"]["tls"][0]["secretName"] == "treeserve-ingress-tls"
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPCS"
    assert ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"] == {
        "name": "treeserve-grpc", "port": {"name": "grpc"}}
    assert "Ingress/treeserve-grpc" not in render()


def test_helm_test_hook_calls_the_api_like_a_client():
    objs = render(preset("cpu-demo"))
    pod = objs["Pod/treeserve-test-generate"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    ctr = pod["spec"]["containers"][0]
    command = ctr["command"]
    assert command[:2] == ["treeserve", "generate"]
    svc = objs["Service/treeserve-grpc"]
    assert f"--address=treeserve-grpc.default.svc:{svc['spec']['ports'][0]['port']}" in command
    mounts = {m["name"]: m["mountPath"] for m in ctr["volumeMounts"]}
    assert f"--tls-ca={mounts['api-tls']}/ca.crt" in command
    assert f"--token-file={mounts['api-auth']}/tokens" in command
    assert ctr["image"] == groups(objs)["drafter"]["template"]["spec"]["containers"][0]["image"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["api-tls"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]  # never the server key
    # The generated certificate names the address the hook dials.
    x509 = pytest.importorskip("cryptography.x509")
    cert = x509.load_pem_x509_certificate(base64.b64decode(objs["Secret/treeserve-tls"]["data"]["tls.crt"]))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert "treeserve-grpc.default.svc" in names


def test_pod_values_land_where_they_belong():
    objs = render(sets=EVERYTHING)
    rs = objs["RayService/treeserve"]["spec"]["rayClusterConfig"]
    head = rs["headGroupSpec"]["template"]
    g = groups(objs)
    assert head["spec"]["priorityClassName"] == "high" and g["target"]["template"]["spec"]["priorityClassName"] == "high"
    assert "priorityClassName" not in g["drafter"]["template"]["spec"]
    assert "nodeAffinity" in g["drafter"]["template"]["spec"]["affinity"] and "affinity" not in g["target"]["template"]["spec"]
    env = {name: {e["name"]: e.get("value") for e in spec["containers"][0]["env"]} for name, spec in _pod_specs(objs)
           if not name.startswith("Pod/")}
    assert all(e["HTTPS_PROXY"] == "http://proxy:3128" for e in env.values())
    assert env["target"]["NCCL_IB_DISABLE"] == "1" and "NCCL_IB_DISABLE" not in env["drafter"]
    # The dashboard's metrics graphs: Grafana and Prometheus hosts on the head (where the dashboard runs).
    assert env["head"]["RAY_GRAFANA_HOST"] == "http://grafana.monitoring.svc"
    assert env["head"]["RAY_GRAFANA_IFRAME_HOST"] == "http://grafana.monitoring.svc"
    assert env["head"]["RAY_PROMETHEUS_HOST"] == "http://prom.monitoring.svc:9090"
    assert "RAY_GRAFANA_HOST" not in env["target"]
    for template in [head, *(x["template"] for x in g.values())]:
        assert template["metadata"]["labels"]["team"] == "llm"
        assert template["metadata"]["annotations"]["owner"] == "llm-team"
        assert template["spec"]["imagePullSecrets"] == [{"name": "ghcr"}]
    svc = objs["Service/treeserve-grpc"]["spec"]
    assert svc["type"] == "LoadBalancer" and svc["ports"][0]["nodePort"] == 30900
    assert {p["name"]: p["nodePort"] for p in svc["ports"]} == {"grpc": 30900, "http": 30901}


def test_service_monitor_scrapes_every_ray_pod_and_the_head_extras():
    objs = render(sets=("metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prometheus"))
    monitor = objs["ServiceMonitor/treeserve"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["labels"]["release"] == "prometheus"
    selected = [o for k, o in objs.items() if k.startswith("Service/") and
                all(o["metadata"]["labels"].get(a) == b for a, b in monitor["spec"]["selector"]["matchLabels"].items())]
    assert {o["metadata"]["name"] for o in selected} == {"treeserve-metrics", "treeserve-head-metrics"}
    ports = {p["name"] for o in selected for p in o["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == ports == {"metrics", "as-metrics", "dash-metrics"}
    assert all(o["spec"]["clusterIP"] == "None" for o in selected)
    assert "ServiceMonitor/treeserve" not in render()


def test_kuberay_version_is_checked_against_the_clusters_crd(tmp_path):
    """`lookup` returns nothing under `helm template`; a copy of the chart reads the 'cluster's' CRD from a
    value instead, so the check's logic runs against the vendored schemas (and a pre-1.1 one)."""
    chart = tmp_path / "treeserve"
    shutil.copytree(CHART, chart)
    (chart / "values.schema.json").unlink()
    helpers = chart / "templates" / "_helpers.tpl"
    text = helpers.read_text()
    call = 'lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" "rayservices.ray.io"'
    assert text.count(call) == 1
    helpers.write_text(text.replace(call, ".Values.fakeClusterCRD"))

    def crd_values(schema: dict) -> Path:
        path = tmp_path / f"crd-{len(list(tmp_path.iterdir()))}.yaml"
        path.write_text(yaml.safe_dump({"fakeClusterCRD": {"spec": {"versions": [
            {"name": "v1", "schema": {"openAPIV3Schema": schema}}]}}}))
        return path

    current = load_schema("v1.7.0")["openAPIV3Schema"]
    assert "RayService/treeserve" in render(crd_values(current), chart=chart)
    assert "RayService/treeserve" in render(crd_values(load_schema("v1.1.0")["openAPIV3Schema"]), chart=chart)
    old = copy.deepcopy(load_schema("v1.1.0")["openAPIV3Schema"])  # KubeRay 1.0: no numOfHosts yet
    del old["properties"]["spec"]["properties"]["rayClusterConfig"]["properties"]["workerGroupSpecs"]["items"]["properties"]["numOfHosts"]
    err = render_error(crd_values(old), chart=chart)
    assert "older than KubeRay 1.1.0" in err and "kuberay.verifyVersion=false" in err
    assert "RayService/treeserve" in render(crd_values(old), sets=("kuberay.verifyVersion=false",), chart=chart)


# ------------------------------------------------------------------------------------ values that fail
@pytest.mark.parametrize("content, message", [
    ("target: {tensorParallelSize: four}", "target.tensorParallelSize: Invalid type"),
    ("serve: {router: {minReplicas: -1}}", "serve.router.minReplicas: Must be greater than or equal to 0"),
    ("ray: {targetWorkers: {replicas: -2}}", "ray.targetWorkers.replicas: Must be greater than or equal to 0"),
    ("speculation: {method: medusa}", "speculation.method"),
    ("speculation: {budget: 5000}", "speculation.budget"),
    ("target: {path: meta-llama/Llama-2-70b-hf}", "target.path"),
    ("target: {path: eagle}", "target.path"),  # "eagle" names a shipped drafter, not a target
    ("drafter: {path: medusa}", "drafter.path"),
    ("target: {gpuMemoryFraction: 1.5}", "target.gpuMemoryFraction"),
    ("target: {tensorParallelSize: 2}", "target.tensorParallelSize=2 must divide target.numAttentionHeads=9"),
    ("target: {tensorParallelSize: 4, numAttentionHeads: 64, numKeyValueHeads: 6}",
     "target.tensorParallelSize=4 must divide target.numKeyValueHeads=6"),
    ("target: {path: /models/x}", "needs a model volume"),
    ("modelVolume: {type: pvc}", "modelVolume.type=pvc needs modelVolume.claimName"),
    ("tagret: {}", "tagret"),
    ("target: {maxSessions: 2}", "target.maxSessions=2 is below limits.maxBatchSize=4"),
    ("serve: {target: {maxReplicas: 3}}", "serve.target.maxReplicas=3 exceeds ray.targetWorkers.maxReplicas=2"),
    ("serve: {drafter: {maxReplicas: 3}}", "serve.drafter.maxReplicas=3 exceeds what placement.drafter=drafterWorkers holds"),
    ("serve: {router: {maxReplicas: 4}}", "serve.router.maxReplicas=4 exceeds what placement.router=drafterWorkers holds"),
    ("serve: {router: {numCpus: 2}}", "ray.drafterWorkers pods have 2 Ray CPUs (resources.limits.cpu) but the replicas placed there ask for 2.50"),
    ("drafter: {device: cuda}\nserve: {drafter: {numGpus: 1}}", "need 1 GPUs per drafter pod, ray.drafterWorkers.gpus=0"),
    ("serve: {drafter: {numGpus: 1}}", "serve.drafter.numGpus > 0 needs drafter.device=cuda"),
    ("placement: {drafter: targetWorkers}\ndrafter: {device: cuda}\nserve: {drafter: {numGpus: 0.5}}",
     "needs target.device=cuda and 0 < serve.drafter.numGpus < 1"),
    ("security: {tls: {enabled: false}}", "security.allowInsecure=true"),
    ("security: {tls: {generate: false}}", "security.tls.enabled needs security.tls.secretName"),
    ("podLabels: {app.kubernetes.io/created-by: me}", "podLabels.app.kubernetes.io/created-by"),
    ("api: {httpPort: 70000}", "api.httpPort: Must be less than or equal to 65535"),
    ("api: {httpPort: http}", "api.httpPort: Invalid type"),
    ("api: {httpPort: 9000}", "api.httpPort=9000 is api.port's port too"),
    ("api: {httpPort: 8000}", "api.httpPort=8000 is serve.httpPort's port too"),
    ("api: {httpPort: 8080}", "api.httpPort=8080 is ray.metricsPort's port too"),
    ("api: {httpPort: 9001}\nsecurity: {tls: {enabled: false}}", "security.allowInsecure=true"),
    ("service: {httpNodePort: 80}", "service.httpNodePort: Must be greater than or equal to 30000"),
])
def test_invalid_values_fail_clearly(tmp_path, content, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(content + "\n")
    assert message in render_error(bad)


@pytest.mark.parametrize("content, message", [
    ("target: {tensorParallelSize: 3}", "target.tensorParallelSize=3 must divide target.numAttentionHeads=64"),
    ("target: {gpuMemoryFraction: 0.6}", "target.gpuMemoryFraction must be set and at most 0.55"),
    ("drafter: {gpuMemoryFraction: 0.5}", "drafter.gpuMemoryFraction must be set and at most serve.drafter.numGpus=0.45"),
    ("serve: {drafter: {numGpus: 1}}", "needs target.device=cuda and 0 < serve.drafter.numGpus < 1"),
    ("serve: {target: {maxReplicas: 2}}", "serve.target.maxReplicas=2 exceeds ray.targetWorkers.maxReplicas=1"),
    ("placement: {routersPerPod: 3}", "ray.targetWorkers pods have 16 Ray CPUs (resources.limits.cpu) but the replicas placed there ask for 17.00"),
])
def test_one_node_preset_guards(tmp_path, content, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(content + "\n")
    assert message in render_error(preset("llama2-70b-4xa100"), bad)


def test_host_path_volume():
    objs = render(preset("vicuna-33b-4xa100"), sets=("modelVolume.type=hostPath", "modelVolume.hostPath=/data/models"))
    pod = groups(objs)["target"]["template"]
    assert {"name": "models", "hostPath": {"path": "/data/models", "type": "Directory"}} in pod["spec"]["volumes"]


# ------------------------------------------------------------------------------------ documentation
def test_readme_values_table_is_generated_from_values_yaml():
    import values_doc

    readme = (CHART / "README.md").read_text()
    assert values_doc.readme_table(readme) == values_doc.table(), \
        "helm/treeserve/README.md's values table is stale: run `python tests/helm/values_doc.py --write`"


def test_every_value_has_a_helm_docs_comment():
    import values_doc

    text = (CHART / "values.yaml").read_text()
    documented = values_doc.comments(text)
    missing = [k for k, _ in values_doc.leaves(yaml.safe_load(text)) if not documented.get(k)]
    assert not missing, f"values.yaml: no `# --` comment for {missing}"
