"""What the KubeRay operator makes of a rendered RayService: its pods' labels and its Services' selectors.

Transcribed from ray-project/kuberay (ray-operator/controllers/ray), v1.7.0 (commit 59d663ae), the same in
v1.1.0 (commit 8adc5387) for every label the chart sets:

- common/pod.go `labelPod`: every Ray pod gets ray.io/is-ray-node=yes, ray.io/cluster=<RayCluster name>,
  ray.io/node-type=head|worker, ray.io/group=<group> ("headgroup" for the head), ray.io/identifier=
  <cluster>-<node type>, app.kubernetes.io/name=kuberay, app.kubernetes.io/created-by=kuberay-operator; the
  pod template's labels override these, except ray.io/node-type, ray.io/group and ray.io/cluster.
- common/service.go `HeadServiceLabels` / `BuildServiceForHeadPod`: the head Service selects exactly the keys
  ray.io/cluster, ray.io/node-type=head, ray.io/identifier, app.kubernetes.io/name=kuberay,
  app.kubernetes.io/created-by=kuberay-operator; for a RayService (`BuildHeadServiceForRayService`, the Service
  <rayservice>-head-svc, utils `GenerateHeadServiceName`) with those default values whatever the pod template
  says; for a RayCluster's own head Service app.kubernetes.io/name follows the head template's label.
- common/service.go `BuildServeService`: <rayservice>-serve-svc selects ray.io/cluster and ray.io/serve=true,
  the label KubeRay puts on pods whose Serve proxy is healthy.
- utils/constant.go: the label keys and values above.
"""

from __future__ import annotations

APPLICATION_NAME = "kuberay"
COMPONENT_NAME = "kuberay-operator"
NOT_OVERRIDABLE = ("ray.io/node-type", "ray.io/group", "ray.io/cluster")
HEAD_GROUP = "headgroup"


def check_label(value: str) -> str:
    """utils.CheckLabel: at most 63 characters (the head is cut), not starting with punctuation."""
    if len(value) > 63:
        value = value[len(value) - 63:]
    if not value[0].isalnum():
        value = "r" + value[1:]
    return value


def label_pod(node_type: str, cluster: str, group: str, template_labels: dict[str, str]) -> dict[str, str]:
    labels = {
        "ray.io/is-ray-node": "yes",
        "ray.io/cluster": cluster,
        "ray.io/node-type": node_type,
        "ray.io/group": group,
        "ray.io/identifier": check_label(f"{cluster}-{node_type}"),
        "app.kubernetes.io/name": APPLICATION_NAME,
        "app.kubernetes.io/created-by": COMPONENT_NAME,
    }
    for key, value in (template_labels or {}).items():
        if key not in NOT_OVERRIDABLE:
            labels[key] = value
    return labels


def head_service_labels(cluster: str) -> dict[str, str]:
    return {
        "ray.io/cluster": cluster,
        "ray.io/node-type": "head",
        "ray.io/identifier": check_label(f"{cluster}-head"),
        "app.kubernetes.io/name": APPLICATION_NAME,
        "app.kubernetes.io/created-by": COMPONENT_NAME,
    }


def rayservice_head_service_selector(cluster: str) -> dict[str, str]:
    """The selector of <rayservice>-head-svc (BuildHeadServiceForRayService: no labels passed)."""
    return head_service_labels(cluster)


def raycluster_head_service_selector(cluster: str, head_template_labels: dict[str, str]) -> dict[str, str]:
    """The selector of the RayCluster's own head Service (raycluster_controller: the template's
    app.kubernetes.io/name, if any, replaces the default)."""
    selector = head_service_labels(cluster)
    if "app.kubernetes.io/name" in (head_template_labels or {}):
        selector["app.kubernetes.io/name"] = head_template_labels["app.kubernetes.io/name"]
    return selector


def serve_service_selector(cluster: str) -> dict[str, str]:
    return {"ray.io/cluster": cluster, "ray.io/serve": "true"}


def head_service_name(rayservice: str) -> str:
    return f"{rayservice}-head-svc"


def cluster_pods(rayservice: dict, cluster: str, serve_ready: bool = True) -> list[dict]:
    """One pod per group (its labels as KubeRay sets them, its template): what the RayCluster `cluster` of a
    rendered RayService runs. `serve_ready` adds ray.io/serve=true (a healthy Serve proxy) to every pod."""
    spec = rayservice["spec"]["rayClusterConfig"]
    pods = []
    head = spec["headGroupSpec"]["template"]
    pods.append({"group": HEAD_GROUP, "node_type": "head", "template": head,
                 "labels": label_pod("head", cluster, HEAD_GROUP, head.get("metadata", {}).get("labels", {}))})
    for group in spec.get("workerGroupSpecs", []):
        template = group["template"]
        pods.append({"group": group["groupName"], "node_type": "worker", "template": template,
                     "labels": label_pod("worker", cluster, group["groupName"],
                                         template.get("metadata", {}).get("labels", {}))})
    if serve_ready:
        for pod in pods:
            pod["labels"]["ray.io/serve"] = "true"
    return pods


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())
