"""The README's "Install on Kubernetes" commands are exactly the ones rendered and checked here."""

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from treeserve.services.config import load_serve_config

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "treeserve"
HELM = next((c for c in (os.environ.get("HELM"), str(ROOT / ".cache/tools/helm/helm"), shutil.which("helm"))
             if c and os.access(c, os.X_OK)), None)
pytestmark = pytest.mark.skipif(HELM is None, reason="helm not found (make tools fetches it)")


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)


def readme_helm_installs() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Install on Kubernetes", 1)[1].split("\n## ", 1)[0]
    commands = []
    for line in re.findall(r"^helm install .*$", section, flags=re.M):
        args = shlex.split(line.split("#", 1)[0])
        if "helm/treeserve" in args:
            commands.append(args)
    return commands


def test_readme_install_commands_render_and_load():
    commands = readme_helm_installs()
    presets = {p.name for p in (CHART / "presets").glob("*.yaml")}
    assert {a[a.index("-f") + 1].rsplit("/", 1)[-1] for a in commands} == presets
    for args in commands:
        # `helm install NAME CHART -f VALUES` renders the same objects as `helm template NAME CHART -f VALUES`.
        assert args[:2] == ["helm", "install"]
        result = helm("template", *[str(ROOT / a) if a.startswith("helm/") else a for a in args[2:]])
        assert result.returncode == 0, result.stderr
        docs = {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(result.stdout) if d}
        service = docs[f"RayService/{args[2]}"]
        config = load_serve_config(yaml.safe_load(service["spec"]["serveConfigV2"]))
        assert config.app.args.target.path
        assert f"Service/{args[2]}-grpc" in docs  # the README's port-forward target exists
    readme = (ROOT / "README.md").read_text()
    assert "kubectl port-forward svc/treeserve-grpc 9000:9000" in readme
    # The dashboard's Service is KubeRay's own <rayservice>-head-svc (kuberay_sim.head_service_name).
    from kuberay_sim import head_service_name

    assert f"kubectl port-forward svc/{head_service_name('treeserve')} 8265:8265" in readme
    assert "helm test treeserve" in readme


def test_docs_commands_exist():
    """docs/kubernetes.md names make targets and presets that exist."""
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    for target in re.findall(r"\bmake ([a-z][\w-]*)", docs):
        assert re.search(rf"(?m)^{re.escape(target)}:", makefile), f"docs/kubernetes.md: no make target {target!r}"
    for name in re.findall(r"presets/([\w.-]+\.yaml)", docs):
        assert (CHART / "presets" / name).is_file(), name
