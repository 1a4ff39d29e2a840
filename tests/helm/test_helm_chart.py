"""helm/treeserve: lint and render every preset, check the rendered objects, and load the embedded
serveConfigV2 with the same parser the service uses. Skipped when no helm binary is available."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from treeserve.services.config import load_serve_config

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "treeserve"
PRESETS = sorted((CHART / "presets").glob("*.yaml"))
DEPLOY = ROOT / "deploy"
# preset -> the deploy/ layout it mirrors
MIRRORS = {"cpu-demo": "local-cpu", "llama2-70b-4xa100": "llama2-70b-4xa100", "vicuna-33b-4xa100": "vicuna-33b-4xa100"}


def _find_helm() -> str | None:
    candidates = [os.environ.get("HELM"), str(ROOT / ".cache" / "tools" / "helm" / "helm"), shutil.which("helm")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


HELM = _find_helm()
pytestmark = pytest.mark.skipif(
    HELM is None, reason="helm not found: set HELM, put it on PATH, or fetch it into .cache/tools/helm/helm "
                         "(see docs/kubernetes.md)")


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)


def render(*values: str, sets: tuple[str, ...] = ()) -> dict[str, dict]:
    args = ["template", "treeserve", str(CHART)]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    result = helm(*args)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def render_error(*values: str, sets: tuple[str, ...] = ()) -> str:
    args = ["template", "treeserve", str(CHART)]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    result = helm(*args)
    assert result.returncode != 0, "expected helm to reject these values"
    return result.stderr


def test_presets_exist():
    assert {p.stem for p in PRESETS} == set(MIRRORS)


@pytest.mark.parametrize("preset", [None, *PRESETS], ids=lambda p: "defaults" if p is None else p.stem)
def test_lint(preset):
    result = helm("lint", str(CHART), "--strict", *(["-f", str(preset)] if preset else []))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_render_preset(preset):
    objs = render(preset)
    values = yaml.safe_load(preset.read_text())
    rs = objs["RayService/treeserve"]
    assert rs["apiVersion"] == "ray.io/v1"

    # The serve config is exactly what the service parses, and says what the preset says.
    serve = load_serve_config(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    args = serve.app.args
    tp = values["target"]["tensorParallelSize"]
    assert args.target.path == values["target"]["path"] and args.target.tensor_parallel_size == tp
    assert args.target.num_attention_heads == values["target"]["numAttentionHeads"]
    assert args.speculation.method == values["speculation"]["method"]
    assert args.speculation.budget == values["speculation"]["budget"]
    assert args.limits.max_batch_size == values["limits"]["maxBatchSize"]
    assert serve.grpc_options.port == 9000 and serve.logging_config.enable_access_log is False
    for name, key in (("Router", "router"), ("Drafter", "drafter"), ("Target", "target")):
        auto = serve.app.deployment(name).autoscaling_config
        want = values["serve"][key]
        assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (
            want["minReplicas"], want["maxReplicas"], want["targetOngoingRequests"])

    # It matches the deploy/ layout it mirrors (same models, TP, method, limits).
    layout = load_serve_config(DEPLOY / f"{MIRRORS[preset.stem]}.yaml").app.args
    assert (args.target.path, args.target.dtype, args.target.device, args.target.tensor_parallel_size,
            args.target.max_context_tokens) == (layout.target.path, layout.target.dtype, layout.target.device,
                                                layout.target.tensor_parallel_size, layout.target.max_context_tokens)
    assert (args.drafter.path, args.drafter.device) == (layout.drafter.path, layout.drafter.device)
    assert args.speculation == layout.speculation and args.limits == layout.limits

    # Pods: GPU counts follow TP, probes and metrics everywhere.
    cluster = rs["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"target", "drafter"}
    cuda = values["target"]["device"] == "cuda"
    target_ctr = groups["target"]["template"]["spec"]["containers"][0]
    gpus = target_ctr["resources"]["limits"].get("nvidia.com/gpu", 0)
    assert gpus == (tp if cuda else 0)
    assert serve.app.deployment("Target").gpus_per_replica() == (tp if cuda else 0)
    drafter_ctr = groups["drafter"]["template"]["spec"]["containers"][0]
    assert drafter_ctr["resources"]["limits"].get("nvidia.com/gpu", 0) == (1 if cuda else 0)
    assert groups["target"]["replicas"] == values["ray"]["targetWorkers"]["replicas"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    for pod in [head["template"], *(g["template"] for g in groups.values())]:
        ctr = pod["spec"]["containers"][0]
        assert ctr["readinessProbe"]["httpGet"] and ctr["livenessProbe"]["httpGet"]
        assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        assert {p["name"] for p in ctr["ports"]} >= {"grpc", "serve", "metrics"}
        assert ctr["image"].endswith("-cuda" if cuda else "-cpu")
        mounts = {m["name"]: m for m in ctr["volumeMounts"]}
        assert ("models" in mounts) == (values["modelVolume"]["type"] != "none")
    assert {"name": "dashboard", "containerPort": 8265} in head["template"]["spec"]["containers"][0]["ports"]

    svc = objs["Service/treeserve-grpc"]
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 9000, "http": 8000}
    assert svc["spec"]["selector"]["app.kubernetes.io/instance"] == "treeserve"


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_serve_config_accepted_by_ray_serve_schema(preset):
    schema = pytest.importorskip("ray.serve.schema")
    text = render(preset)["RayService/treeserve"]["spec"]["serveConfigV2"]
    schema.ServeDeploySchema.model_validate(yaml.safe_load(text))


def test_gpu_preset_placement():
    serve = load_serve_config(yaml.safe_load(
        render(CHART / "presets" / "llama2-70b-4xa100.yaml")["RayService/treeserve"]["spec"]["serveConfigV2"]))
    target = serve.app.deployment("Target")
    assert target.placement_group_strategy == "STRICT_PACK" and len(target.placement_group_bundles) == 5


def test_tls_ingress():
    objs = render(sets=("ingress.enabled=true", "ingress.tls.enabled=true", "ingress.tls.secretName=treeserve-tls"))
    ingress = objs["Ingress/treeserve-grpc"]
    assert ingress["spec"]["tls"][0]["secretName"] == "treeserve-tls"
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"
    assert "Ingress/treeserve-grpc" not in render()
    assert "ingress.tls.enabled needs ingress.tls.secretName" in render_error(
        sets=("ingress.enabled=true", "ingress.tls.enabled=true"))


def test_host_path_volume():
    objs = render(CHART / "presets" / "vicuna-33b-4xa100.yaml",
                  sets=("modelVolume.type=hostPath", "modelVolume.hostPath=/data/models"))
    pod = objs["RayService/treeserve"]["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]
    assert {"name": "models", "hostPath": {"path": "/data/models", "type": "Directory"}} in pod["spec"]["volumes"]


@pytest.mark.parametrize("content, message", [
    ("target: {tensorParallelSize: four}", "target.tensorParallelSize: Invalid type"),
    ("serve: {router: {minReplicas: -1}}", "serve.router.minReplicas: Must be greater than or equal to 0"),
    ("ray: {targetWorkers: {replicas: -2}}", "ray.targetWorkers.replicas: Must be greater than or equal to 0"),
    ("speculation: {method: medusa}", "speculation.method"),
    ("speculation: {budget: 5000}", "speculation.budget"),
    ("target: {path: meta-llama/Llama-2-70b-hf}", "target.path"),
    ("target: {path: eagle}", "target.path"),  # "eagle" names a shipped drafter, not a target
    ("drafter: {path: medusa}", "drafter.path"),
    ("target: {tensorParallelSize: 2}", "target.tensorParallelSize=2 must divide target.numAttentionHeads=9"),
    ("target: {tensorParallelSize: 4, numAttentionHeads: 64, numKeyValueHeads: 6}",
     "target.tensorParallelSize=4 must divide target.numKeyValueHeads=6"),
    ("target: {path: /models/x}", "needs a model volume"),
    ("modelVolume: {type: pvc}", "modelVolume.type=pvc needs modelVolume.claimName"),
    ("tagret: {}", "tagret"),
])
def test_invalid_values_fail_clearly(tmp_path, content, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(content + "\n")
    assert message in render_error(bad)


def test_tp_not_dividing_heads_in_gpu_preset(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: {tensorParallelSize: 3}\n")
    err = render_error(CHART / "presets" / "llama2-70b-4xa100.yaml", bad)
    assert "target.tensorParallelSize=3 must divide target.numAttentionHeads=64" in err


def test_readme_documents_every_value():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()

    def leaves(d, prefix=""):
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and v and k not in ("resources", "env", "annotations"):
                yield from leaves(v, key + ".")
            else:
                yield key
    missing = [k for k in leaves(values) if f"`{k}`" not in readme]
    assert not missing, f"helm/treeserve/README.md lacks {missing}"


def test_every_value_has_a_helm_docs_comment():
    """Each value (a key with a scalar, list or inline map) is introduced by a `# --` comment."""
    import re
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing maps
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z][\w.-]*):(.*)$", line)
        if not m:
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3).strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        opaque = any(k in ("resources", "env", "annotations") for _, k in stack)
        stack.append((indent, key))
        if opaque or not rest and key not in ("resources", "env", "annotations"):
            continue  # a section header, or a key inside a free-form map documented by its parent
        above = lines[i - 1].strip()
        assert above.startswith("# --") or (above.startswith("#") and any(
            lines[j].strip().startswith("# --") for j in range(max(0, i - 4), i))), \
            f"values.yaml:{i + 1}: `{key}` has no `# --` comment"
