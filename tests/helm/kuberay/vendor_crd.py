"""Vendor the `v1` openAPIV3Schema of KubeRay's RayService CRD at a release tag (see README.md here).

    python tests/helm/kuberay/vendor_crd.py v1.7.0 [--commit <sha>]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import urllib.request
from pathlib import Path

import yaml

PATH = "helm-chart/kuberay-operator/crds/ray.io_rayservices.yaml"


def vendor(tag: str, commit: str | None = None) -> Path:
    url = f"https://raw.githubusercontent.com/ray-project/kuberay/{tag}/{PATH}"
    raw = urllib.request.urlopen(url, timeout=60).read()
    crd = yaml.safe_load(raw)
    v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    doc = {"source": {"repository": "https://github.com/ray-project/kuberay", "tag": tag, "commit": commit or "",
                      "path": PATH, "url": url, "sha256": hashlib.sha256(raw).hexdigest(),
                      "controller_gen": crd["metadata"].get("annotations", {}).get("controller-gen.kubebuilder.io/version")},
           "group": crd["spec"]["group"], "kind": crd["spec"]["names"]["kind"], "version": "v1",
           "served": v1["served"], "storage": v1["storage"], "openAPIV3Schema": v1["schema"]["openAPIV3Schema"]}
    out = Path(__file__).resolve().parent / f"rayservice-{tag}.schema.json.gz"
    out.write_bytes(gzip.compress(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode(), mtime=0))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tag")
    parser.add_argument("--commit", default=None, help="the tag's commit, recorded with the schema")
    args = parser.parse_args()
    print(vendor(args.tag, args.commit))
