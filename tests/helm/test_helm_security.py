"""The chart's security and operations values: TLS and tokens (generated or existing secrets), the OpenAI HTTP
port, ingress, the `helm test` hook, pod values, the ServiceMonitor, the KubeRay version check."""

from __future__ import annotations

import base64
import copy
import shutil
from pathlib import Path

import pytest
import yaml

import kuberay_sim as kr  # tests/helm/kuberay_sim.py (this folder is on sys.path under pytest)
from crd_schema import load_schema, problems, vendored_tags
from helm_render import (needs_helm, EVERYTHING, CHART, render, render_error, preset, serve_config, groups,
                         ray_resources, cluster_pods, pod_specs)

pytestmark = needs_helm


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
        pods = [p for p in cluster_pods(objs) if kr.selects(svc["selector"], p["labels"])]
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
    env = {name: {e["name"]: e.get("value") for e in spec["containers"][0]["env"]} for name, spec in pod_specs(objs)
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
