"""The layer rules (docs/design.md): engine/ is a plain library (no Ray, no gRPC, nothing of services/ or cli/),
services/ never reaches up into the command layer cli/, and only cli/ parses command lines (argparse). Checked
statically: every import statement of every module, those inside functions included, parsed with ast."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> top-level modules / treeserve packages its code must not import
FORBIDDEN = {
    "engine": ("treeserve.cli", "treeserve.services", "ray", "grpc", "argparse"),
    "services": ("treeserve.cli", "argparse"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module name) of every import in the file; `from treeserve import cli` counts as
    treeserve.cli."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def violations(folder: str) -> list[str]:
    banned = FORBIDDEN[folder]
    return [f"{path.relative_to(ROOT)}:{line} imports {name}"
            for path in sorted((ROOT / folder).rglob("*.py"))
            for line, name in imported_modules(path)
            if any(name == b or name.startswith(b + ".") for b in banned)]


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_layers_import_only_downwards(folder):
    assert not violations(folder), "\n".join(violations(folder))


def test_the_check_sees_every_import_form(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import grpc.aio\nfrom ray import serve\nfrom treeserve import cli\n\n"
                      "def lazy():\n    from treeserve.services.client import open_channel\n")
    names = {name for _, name in imported_modules(sample)}
    assert {"grpc.aio", "ray", "treeserve.cli", "treeserve.services.client"} <= names
