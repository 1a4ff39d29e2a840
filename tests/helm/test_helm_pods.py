"""What KubeRay will make of the chart: pod labels against every Service's selector, GPUs and CPUs per pod for
whatever Serve may place there, the GPU presets filling their nodes, non-root pods on a read-only root."""

from __future__ import annotations

import shutil

import pytest

import kuberay_sim as kr  # tests/helm/kuberay_sim.py (this folder is on sys.path under pytest)
from helm_render import (needs_helm, CHART, PRESETS, GPU_PRESETS, CLUSTER, render, render_error, preset,
                         serve_config, groups, ray_resources, cluster_pods, pod_specs)

pytestmark = needs_helm


@pytest.mark.parametrize("values", [None, *PRESETS], ids=lambda p: "defaults" if p is None else p.stem)
def test_every_service_selects_the_pods_it_serves(values):
    objs = render(*([values] if values else []), sets=("dashboard.service.enabled=true", "metrics.serviceMonitor.enabled=true"))
    pods = cluster_pods(objs)
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
    # the Grafana board's ConfigMap, where it is and the label the sidecar needs
    assert "ConfigMap treeserve-grafana-dashboard in namespace default" in notes and "grafana_dashboard=1" in notes
    elsewhere = render(preset("cpu-demo"), sets=("metrics.grafanaDashboard.namespace=monitoring",), chart=chart)
    assert "in namespace monitoring" in elsewhere["ConfigMap/notes"]["data"]["notes"]
    without_board = render(preset("cpu-demo"), sets=("metrics.grafanaDashboard.enabled=false",), chart=chart)
    assert "grafana-dashboard" not in without_board["ConfigMap/notes"]["data"]["notes"]


# --------------------------------------------------------------------------------- GPUs and CPUs per pod
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
def test_whatever_lands_on_a_pod_fits_it(values, fits_any_order):
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
        assert fits_any_order(pod_gpus, gpu_requests), (group["groupName"], pod_gpus, gpu_requests)
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
        # One node: no drafter pod; the drafter shares the last rank's GPU (or sits on the pod's CPUs), and that
        # GPU is exactly full. A TP=1 target holds its GPU share on the replica itself (no placement group).
        assert set(g) == {"target"}
        target = app.deployment("Target")
        shares = target.rank_gpu_shares() or [target.ray_actor_options.num_gpus]
        assert shares[-1] + drafter.num_gpus == pytest.approx(1.0) and sum(shares) + drafter.num_gpus == node_gpus
        assert ray_resources(g["target"]) == {"TreeServeTarget": 1, "TreeServeDrafter": 1, "TreeServeRouter": 2}
        assert g["target"]["maxReplicas"] == 1  # exactly one node
    else:
        # The drafter's pod advertises no target slot, the target's pod no drafter slot.
        assert ray_resources(g["target"]) == {"TreeServeTarget": 1}
        assert "TreeServeTarget" not in ray_resources(g["drafter"]) and drafter.num_gpus == 1
    # One target replica is one STRICT_PACK group on one pod (TP=1: the replica itself).
    if app.args.target.tensor_parallel_size > 1:
        assert app.deployment("Target").placement_group_strategy == "STRICT_PACK"
    else:
        assert app.deployment("Target").placement_group_bundles is None


def test_tp1_target_on_cuda_gets_its_gpu_on_the_replica_itself():
    """A TP=1 target runs in the replica process: no placement group; the replica holds the GPU (or its share)."""
    objs = render(preset("llama2-70b-4xa100"), sets=("target.path=/models/Llama-2-7b-hf", "target.tensorParallelSize=1",
                                                      "target.numAttentionHeads=32", "target.numKeyValueHeads=32"))
    target = serve_config(objs).app.deployment("Target")
    assert target.placement_group_bundles is None
    assert target.ray_actor_options.num_gpus == pytest.approx(0.55)
    assert target.ray_actor_options.resources == {"TreeServeTarget": 1.0}


# --------------------------------------------------------------------------------- security, pods, hooks
@pytest.mark.parametrize("values", [None, *PRESETS], ids=lambda p: "defaults" if p is None else p.stem)
def test_pods_run_non_root_on_a_read_only_root(values):
    objs = render(*([values] if values else []))
    for name, spec in pod_specs(objs):
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


