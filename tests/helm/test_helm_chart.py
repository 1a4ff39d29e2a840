"""helm/treeserve: lint and render every preset, validate the RayService against KubeRay's own CRD schemas, load
the embedded serveConfigV2 with the same parser the service uses, and refuse bad values clearly. Skipped when no
helm binary is available (as are the other tests/helm/test_helm_*.py)."""

from __future__ import annotations

import copy

import pytest
import yaml

from crd_schema import load_schema, problems, vendored_tags
from helm_render import (needs_helm, EVERYTHING, CHART, PRESETS, DEPLOY, MIRRORS, helm, render, render_error,
                         preset, serve_config, groups)
from treeserve.services.config import load_serve_config

pytestmark = needs_helm


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
@pytest.mark.parametrize("content, message", [
    ("target: {tensorParallelSize: four}", "target.tensorParallelSize: Invalid type"),
    ("serve: {router: {minReplicas: -1}}", "serve.router.minReplicas: Must be greater than or equal to 0"),
    ("ray: {targetWorkers: {replicas: -2}}", "ray.targetWorkers.replicas: Must be greater than or equal to 0"),
    ("speculation: {method: medusa}", "speculation.method"),
    ("speculation: {budget: 5000}", "speculation.budget"),
    ("speculation: {lookupSharedTokens: -5}", "speculation.lookupSharedTokens"),
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


def test_cross_request_lookup_index_reaches_the_serve_config():
    """On (per tenant) in every preset; `speculation.lookupSharedTokens` sizes the drafter's index of recent
    outputs (0: off)."""
    assert serve_config(render(preset("cpu-demo"))).app.args.speculation.lookup.shared_tokens == 16384
    objs = render(preset("cpu-demo"), sets=("speculation.method=c2t+lookup", "speculation.lookupSharedTokens=65536"))
    speculation = serve_config(objs).app.args.speculation
    assert (speculation.method, speculation.lookup.shared_tokens) == ("c2t+lookup", 65536)


def test_host_path_volume():
    objs = render(preset("vicuna-33b-4xa100"), sets=("modelVolume.type=hostPath", "modelVolume.hostPath=/data/models"))
    pod = groups(objs)["target"]["template"]
    assert {"name": "models", "hostPath": {"path": "/data/models", "type": "Directory"}} in pod["spec"]["volumes"]


def test_grafana_dashboard_configmap_for_the_sidecar():
    """The board ships as a ConfigMap with the label Grafana's dashboard sidecar selects by, its JSON the file in
    deploy/ (what the served test checks against a live scrape); its namespace, labels and off switch follow
    the values."""
    import json

    objs = render(preset("cpu-demo"))
    configmap = objs["ConfigMap/treeserve-grafana-dashboard"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "namespace" not in configmap["metadata"]
    board = json.loads(configmap["data"]["treeserve.json"])
    assert board == json.loads((DEPLOY / "grafana" / "treeserve.json").read_text())
    assert board["uid"] == "treeserve" and len([p for p in board["panels"] if p["type"] != "row"]) >= 10
    objs = render(preset("cpu-demo"), sets=("metrics.grafanaDashboard.namespace=monitoring",
                                            "metrics.grafanaDashboard.labels.grafana_dashboard=null",
                                            "metrics.grafanaDashboard.labels.dashboards=treeserve",
                                            "metrics.grafanaDashboard.annotations.grafana_folder=TreeServe"))
    metadata = objs["ConfigMap/treeserve-grafana-dashboard"]["metadata"]
    assert metadata["namespace"] == "monitoring" and metadata["annotations"] == {"grafana_folder": "TreeServe"}
    assert metadata["labels"]["dashboards"] == "treeserve" and "grafana_dashboard" not in metadata["labels"]
    assert "ConfigMap/treeserve-grafana-dashboard" not in render(
        preset("cpu-demo"), sets=("metrics.grafanaDashboard.enabled=false",))


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
