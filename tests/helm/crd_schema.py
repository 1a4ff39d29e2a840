"""Validate a custom resource against a CRD's structural OpenAPI v3 schema the way the API server does.

The API server does two things with a custom resource (apiextensions.k8s.io/v1, structural schemas):

- **rejects** it when a value breaks the schema: wrong type, a missing required field, an enum, pattern,
  length or range violation, a value that is none of an `anyOf`'s types (`x-kubernetes-int-or-string`);
- **prunes** (silently drops) every field the schema does not declare, unless the object says
  `x-kubernetes-preserve-unknown-fields: true`; a map (`additionalProperties`) keeps any key.

`problems(obj, schema)` reports both, each with the field path, so a chart test can demand that the operator
sees exactly what the chart rendered. Top-level `metadata` is ObjectMeta, validated natively by the server,
and is left alone here (as the server does with the CRD's schema for it).

The vendored schemas (kuberay/rayservice-<tag>.schema.json.gz) hold the `v1` version's openAPIV3Schema of
KubeRay's RayService CRD, with the tag, commit, URL and sha256 of the CRD file they come from (see
kuberay/README.md; kuberay/vendor_crd.py refreshes them).
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent / "kuberay"


def load_schema(tag: str) -> dict:
    """{"source": {...}, "openAPIV3Schema": {...}, ...} of the vendored KubeRay RayService CRD `tag`."""
    with gzip.open(HERE / f"rayservice-{tag}.schema.json.gz", "rt") as f:
        return json.load(f)


def vendored_tags() -> list[str]:
    return sorted(p.name[len("rayservice-"):-len(".schema.json.gz")] for p in HERE.glob("rayservice-*.schema.json.gz"))


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def _type_ok(value: Any, kind: str | None) -> bool:
    if kind is None:
        return True
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


def problems(obj: Any, schema: dict, path: str = "", top: bool = True) -> list[str]:
    """Every rejected or pruned field of `obj` under `schema` ("path: why")."""
    out: list[str] = []
    where = path or "<root>"
    if obj is None:
        if not schema.get("nullable"):
            out.append(f"{where}: null is not allowed (the field would be dropped or rejected)")
        return out
    if schema.get("x-kubernetes-int-or-string"):
        if not (isinstance(obj, str) or _type_ok(obj, "integer")):
            return [f"{where}: must be an integer or a string, got {type(obj).__name__}"]
    elif "anyOf" in schema and "type" not in schema:
        if not any(_type_ok(obj, s.get("type")) for s in schema["anyOf"]):
            return [f"{where}: matches none of {[s.get('type') for s in schema['anyOf']]}"]
    elif not _type_ok(obj, schema.get("type")):
        return [f"{where}: must be {schema.get('type')}, got {type(obj).__name__} {obj!r:.60}"]
    if "enum" in schema and obj not in schema["enum"]:
        out.append(f"{where}: {obj!r} is not one of {schema['enum']}")
    if isinstance(obj, str):
        if "pattern" in schema and not re.search(schema["pattern"], obj):
            out.append(f"{where}: {obj!r} does not match {schema['pattern']}")
        if "maxLength" in schema and len(obj) > schema["maxLength"]:
            out.append(f"{where}: longer than {schema['maxLength']}")
        if "minLength" in schema and len(obj) < schema["minLength"]:
            out.append(f"{where}: shorter than {schema['minLength']}")
    if _type_ok(obj, "number"):
        if "minimum" in schema and obj < schema["minimum"]:
            out.append(f"{where}: {obj} < minimum {schema['minimum']}")
        if "maximum" in schema and obj > schema["maximum"]:
            out.append(f"{where}: {obj} > maximum {schema['maximum']}")
    if isinstance(obj, list):
        if "maxItems" in schema and len(obj) > schema["maxItems"]:
            out.append(f"{where}: more than {schema['maxItems']} items")
        if "minItems" in schema and len(obj) < schema["minItems"]:
            out.append(f"{where}: fewer than {schema['minItems']} items")
        items = schema.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(obj):
                out += problems(item, items, f"{path}[{i}]", top=False)
    if isinstance(obj, dict):
        props = schema.get("properties") or {}
        for name in schema.get("required") or []:
            if name not in obj:
                out.append(f"{path}.{name}: required" if path else f"{name}: required")
        extra = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields", False)
        for key, value in obj.items():
            child = f"{path}.{key}" if path else key
            if top and key in ("apiVersion", "kind", "metadata"):
                continue  # handled natively by the API server
            if key in props:
                out += problems(value, props[key], child, top=False)
            elif isinstance(extra, dict):
                out += problems(value, extra, child, top=False)
            elif extra is True or preserve:
                continue
            else:
                out.append(f"{child}: not in the CRD schema (the API server would drop it)")
    return out
