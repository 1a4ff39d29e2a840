"""The values table of helm/treeserve/README.md, generated from values.yaml's `# --` comments (helm-docs style).

    python tests/helm/values_doc.py          # print the table
    python tests/helm/values_doc.py --write  # replace the table in helm/treeserve/README.md

A value is a key with a scalar or a list, or a free-form map documented as a whole (resources, env,
annotations, labels, selectors, security contexts): those are the keys the README must document, each
introduced by a `# --` comment in values.yaml. The chart tests keep the README's table equal to this output.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "treeserve"
# Maps documented as one value: Kubernetes objects or free-form string maps.
OPAQUE = {"resources", "env", "annotations", "labels", "nodeSelector", "affinity", "podSecurityContext",
          "securityContext", "podLabels", "podAnnotations"}
BEGIN, END = "<!-- values-table:begin -->", "<!-- values-table:end -->"


def comments(text: str) -> dict[str, str]:
    """Dotted key -> its `# --` description (continuation `#` lines joined)."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            pending = [stripped[4:].strip()]
            continue
        if stripped.startswith("#"):
            if pending is not None:
                pending.append(stripped[1:].strip())
            continue
        m = re.match(r"^( *)([A-Za-z][\w.-]*):(.*)$", line)
        if not m:
            pending = None if not stripped.startswith("-") else pending
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if any(k in OPAQUE for _, k in stack):
            pending = None
            continue
        stack.append((indent, key))
        if pending is not None:
            out[".".join(k for _, k in stack)] = " ".join(pending)
            pending = None
    return out


def leaves(values: dict, prefix: str = ""):
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in OPAQUE:
            yield from leaves(value, dotted + ".")
        else:
            yield dotted, value


def _schema_type(key: str) -> str:
    node = json.loads((CHART / "values.schema.json").read_text())
    for part in key.split("."):
        node = node.get("properties", {}).get(part, {})
    kinds = node.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    return " or ".join({"integer": "int", "number": "float"}.get(k, k) for k in kinds) or "any"


def _type(value, key: str = "") -> str:
    if value is None:
        return _schema_type(key)
    return {bool: "bool", int: "int", float: "float", str: "string", list: "list", dict: "object"}[type(value)]


def table() -> str:
    text = (CHART / "values.yaml").read_text()
    docs = comments(text)
    rows = ["| Key | Type | Default | Description |", "|-----|------|---------|-------------|"]
    for key, value in leaves(yaml.safe_load(text)):
        default = json.dumps(value, separators=(", ", ": ")).replace("|", "\\|")
        description = docs.get(key, "").replace("|", "\\|")
        rows.append(f"| `{key}` | {_type(value, key)} | `{default}` | {description} |")
    return "\n".join(rows)


def readme_table(readme: str) -> str:
    return readme.split(BEGIN, 1)[1].split(END, 1)[0].strip()


if __name__ == "__main__":
    generated = table()
    if "--write" in sys.argv:
        path = CHART / "README.md"
        readme = path.read_text()
        head, rest = readme.split(BEGIN, 1)
        path.write_text(f"{head}{BEGIN}\n{generated}\n{END}{rest.split(END, 1)[1]}")
    else:
        print(generated)
