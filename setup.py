"""Build hooks: map the top-level folders into the `treeserve` namespace and generate gRPC stubs.

The repository keeps `engine/`, `services/`, `tools/` and `cli/` at the top level (docs/design.md section 2); installed,
they are `treeserve.engine`, `treeserve.services`, `treeserve.tools` and `treeserve.cli`, so no generic top-level module
is created. The `.proto` files under `proto/treeserve/v1/` are compiled by grpcio-tools whenever the project is built
into the package `treeserve.v1`: the import path in the generated code follows the proto path, so nothing is patched.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()
FOLDERS = {"engine": "treeserve.engine", "services": "treeserve.services", "tools": "treeserve.tools",
           "cli": "treeserve.cli"}
PROTO_ROOT = ROOT / "proto"
# Generated, never committed (.gitignore); an editable install imports `treeserve.v1` from here.
STUB_ROOT = ROOT / "build" / "proto_stubs"


def _packages() -> list[str]:
    packages = ["treeserve.v1"]
    for folder, name in FOLDERS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            packages.append(".".join([name, *rel.parts]) if rel.parts else name)
    return packages


def generate_stubs(out_dir: Path) -> None:
    """Compile every .proto under proto/ into out_dir (python messages, type stubs and gRPC services)."""
    from grpc_tools import protoc
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {protos}")
    for package_dir in {(out_dir / p).parent for p in protos}:
        (package_dir / "__init__.py").touch()


# Setuptools resolves package folders before any build command runs, so the stubs are generated here,
# on every build or install (wheel, sdist, editable), from the .proto files of that source tree.
generate_stubs(STUB_ROOT)


setup(
    packages=_packages(),
    package_dir={name: folder for folder, name in FOLDERS.items()}
    | {"treeserve.v1": str((STUB_ROOT / "treeserve" / "v1").relative_to(ROOT))},
    # Shipped artifacts: the distilled, parallel and EAGLE drafters (engine/drafters/registry.py), each with its
    # C2T classifier; known machines' measurements (engine/hardware/profile.py KNOWN_PROFILES).
    package_data={"treeserve.v1": ["*.pyi"], "treeserve.engine.drafters": ["weights/*/*"],
                  "treeserve.engine.hardware": ["known_profiles/*.json"]},
)
