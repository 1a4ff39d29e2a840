"""The image's build context holds every file the package ships, and the Dockerfile builds on both bases.

No Docker daemon is needed: `.dockerignore` is applied the way `docker build` applies it (tests/deploy/
dockerignore.py, moby/patternmatcher semantics), and the Dockerfile's COPY instructions are read from it.
What "the package ships" means comes from setup.py itself (its package folders and `package_data` globs),
so a new shipped artifact is covered without editing this test.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

import dockerignore  # tests/deploy/dockerignore.py (this folder is on sys.path under pytest)

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


# ------------------------------------------------------------------------------------------------ inputs
def context_files() -> list[str]:
    """Files a `docker build .` of this checkout starts from: tracked plus untracked-but-not-git-ignored."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return sorted(p for p in out.splitlines() if (ROOT / p).is_file())


def setup_facts() -> tuple[dict[str, str], dict[str, list[str]]]:
    """(folder -> package name, package -> package_data globs), read from setup.py without running it."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    folders = package_data = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FOLDERS" for t in node.targets):
            folders = ast.literal_eval(node.value)
        if isinstance(node, ast.keyword) and node.arg == "package_data":
            package_data = ast.literal_eval(node.value)
    assert folders and package_data is not None, "setup.py no longer states FOLDERS / package_data"
    return folders, package_data


def shipped_files(files: list[str]) -> list[str]:
    """What the wheel installs from the source tree, plus what building it and the image's CMD read."""
    folders, package_data = setup_facts()
    by_package = {name: folder for folder, name in folders.items()}
    shipped = set()
    for path in files:
        top = path.split("/", 1)[0]
        # Modules of every package folder (a folder with __init__.py, as setup.py's _packages() finds them).
        if top in folders and path.endswith(".py") and (ROOT / path).parent.joinpath("__init__.py").is_file():
            shipped.add(path)
    for package, globs in package_data.items():
        if package not in by_package and not any(package.startswith(p + ".") for p in by_package):
            continue  # treeserve.v1: generated at build time from proto/
        head = next(p for p in sorted(by_package, key=len, reverse=True) if package == p or package.startswith(p + "."))
        folder = Path(by_package[head], *package[len(head):].strip(".").split(".")) if package != head \
            else Path(by_package[head])
        for pattern in globs:
            shipped.update(str(p.relative_to(ROOT)) for p in (ROOT / folder).glob(pattern) if p.is_file())
    # Building the wheel: project metadata (the readme too) and the protos the stubs are generated from.
    shipped.update(p for p in files if p in ("pyproject.toml", "setup.py", "README.md")
                   or (p.startswith("proto/") and p.endswith(".proto")))
    # The image's CMD (deploy/local-cpu.yaml) and `treeserve memory-estimate` (layouts, model facts).
    shipped.update(p for p in files if p.startswith("deploy/"))
    return sorted(shipped)


def final_stage_copy_sources(text: str) -> list[str]:
    """Context paths the Dockerfile's final stage COPYs (no --from)."""
    joined = re.sub(r"\\\n", " ", text)
    stages = re.split(r"(?m)^FROM\s", joined)
    sources = []
    for line in stages[-1].splitlines():
        parts = line.split()
        if parts and parts[0].upper() in ("COPY", "ADD") and not any(p.startswith("--from") for p in parts):
            sources += [p for p in parts[1:-1] if not p.startswith("--")]
    return sources


def missing_from_image(patterns: list[dockerignore.Pattern], dockerfile: str, files: list[str]) -> dict[str, str]:
    """Shipped file -> why the image would lack it ({} when every one gets in)."""
    sources = [s.rstrip("/") for s in final_stage_copy_sources(dockerfile)]
    problems = {}
    for path in shipped_files(files):
        if dockerignore.excluded(path, patterns):
            problems[path] = "dropped by .dockerignore"
        elif not any(s == "." or path == s or path.startswith(s + "/") for s in sources):
            problems[path] = "not under any COPY source of the Dockerfile's final stage"
    return problems


# ------------------------------------------------------------------------------------------------ tests
def test_every_shipped_file_reaches_the_image():
    files = context_files()
    shipped = shipped_files(files)
    # The artifacts whose absence broke the image: each drafter's weights and its C2T classifier.
    for drafter in ("distilled", "eagle", "eagle3", "parallel"):
        assert f"engine/drafters/weights/{drafter}/model.safetensors" in shipped
    for drafter in ("eagle", "eagle3"):
        assert f"engine/drafters/weights/{drafter}/c2t.safetensors" in shipped
    assert "deploy/local-cpu.yaml" in shipped and "proto/treeserve/v1/generation.proto" in shipped
    problems = missing_from_image(dockerignore.load(ROOT / ".dockerignore"), DOCKERFILE.read_text(), files)
    assert not problems, f"the image would lack: {problems}"


def test_the_check_catches_a_dropped_artifact():
    """The old rules (weights excluded with no exception for the shipped drafters) fail the check."""
    files = context_files()
    old = dockerignore.parse("\n".join(line for line in (ROOT / ".dockerignore").read_text().splitlines()
                                       if not line.startswith("!")))
    problems = missing_from_image(old, DOCKERFILE.read_text(), files)
    assert problems.get("engine/drafters/weights/eagle/model.safetensors") == "dropped by .dockerignore"
    assert problems.get("engine/drafters/weights/eagle/c2t.safetensors") == "dropped by .dockerignore"
    # ... and a Dockerfile that forgot a package folder.
    no_services = "\n".join(line for line in DOCKERFILE.read_text().splitlines() if "COPY services" not in line)
    problems = missing_from_image(dockerignore.load(ROOT / ".dockerignore"), no_services, files)
    assert problems.get("services/config/__init__.py") == "not under any COPY source of the Dockerfile's final stage"


def test_nothing_heavy_or_private_enters_the_context():
    patterns = dockerignore.load(ROOT / ".dockerignore")
    for path in (".git/HEAD", ".venv/bin/python", "build/proto_stubs/treeserve/v1/generation_pb2.py",
                 "engine/__pycache__/tree.cpython-311.pyc", "models-cache/x.safetensors", "tests/conftest.py",
                 "weights/llama.safetensors", "engine/models/some.gguf", "checkpoints/step1.pt", ".cache/tools/helm/helm",
                 "helm/treeserve/values.yaml", "treeserve.egg-info/PKG-INFO"):
        assert dockerignore.excluded(path, patterns), path


@pytest.mark.parametrize("rules, path, excluded", [
    ("*.md\n!README.md", "README.md", False),
    ("*.md\n!README.md", "CHANGES.md", True),
    ("*.md\n!README.md", "docs/x.md", False),  # `*` does not cross `/`
    ("**/*.md", "docs/deep/x.md", True),
    ("**/*.md", "x.md", True),  # `**/` also matches no directory
    ("build", "build/a/b.txt", True),  # a parent directory matches
    ("/build", "build/a", True),  # leading slash: the context root
    ("temp?", "temp1", True),
    ("temp?", "temp12", False),
    ("a/**", "a/b/c", True),
    ("**/*.safetensors\n!engine/drafters/weights/*/*.safetensors", "engine/drafters/weights/eagle/c2t.safetensors", False),
    ("**/*.safetensors\n!engine/drafters/weights/*/*.safetensors", "engine/models/other/model.safetensors", True),
    ("**/*.safetensors\n!engine/drafters/weights/*/*.safetensors", "engine/drafters/weights/distilled/sub/x.safetensors", True),
    ("dir\n!dir/keep", "dir/keep", False),
    ("# comment\n\n  spaced.txt  ", "spaced.txt", True),
    ("file.v1", "fileXv1", False),  # `.` is literal
])
def test_dockerignore_semantics(rules, path, excluded):
    assert dockerignore.excluded(path, dockerignore.parse(rules)) is excluded


# ------------------------------------------------------------------------------------------------ the user
def user_step() -> str:
    """The Dockerfile's RUN that creates uid 1000 "ray", as a shell script."""
    joined = re.sub(r"\\\n", "", DOCKERFILE.read_text())
    runs = [line[len("RUN "):] for line in joined.splitlines() if line.startswith("RUN ") and "useradd" in line]
    assert len(runs) == 1, "expected exactly one RUN that creates the user"
    return runs[0]


# Stand-ins for the shadow-utils tools over two text files (passwd: name:uid:gid, group: name:gid), strict
# like the real ones: useradd/groupadd refuse a uid/gid or name already taken, userdel removes the user's own
# group when that group has its name (Ubuntu's USERGROUPS_ENAB).
_STUBS = {
    "getent": r"""db="$FAKE/$1"; awk -F: -v k="$2" '$1==k || $2==k {print; f=1} END {exit !f}' "$db" || exit 2""",
    "id": r"""f=2; [ "$1" = -g ] && f=3; awk -F: -v k="$2" -v f="$f" '$1==k {print $f; ok=1} END {exit !ok}' "$FAKE/passwd" """,
    "useradd": r"""for last; do :; done; uid=""; gid=""
while [ $# -gt 1 ]; do case "$1" in --uid) uid=$2; shift;; --gid) gid=$2; shift;; esac; shift; done
awk -F: -v u="$uid" -v n="$last" '$2==u || $1==n {f=1} END {exit !f}' "$FAKE/passwd" && { echo "useradd: UID $uid is not unique" >&2; exit 4; }
echo "$last:$uid:$gid" >> "$FAKE/passwd"; echo "useradd $last" >> "$FAKE/log" """,
    "groupadd": r"""gid=$2; name=$3
awk -F: -v g="$gid" -v n="$name" '$2==g || $1==n {f=1} END {exit !f}' "$FAKE/group" && { echo "groupadd: GID $gid is not unique" >&2; exit 4; }
echo "$name:$gid" >> "$FAKE/group"; echo "groupadd $name" >> "$FAKE/log" """,
    "userdel": r"""for last; do :; done
grep -v "^$last:" "$FAKE/passwd" > "$FAKE/p.new"; mv "$FAKE/p.new" "$FAKE/passwd"
grep -v "^$last:" "$FAKE/group" > "$FAKE/g.new"; mv "$FAKE/g.new" "$FAKE/group"; echo "userdel $last" >> "$FAKE/log" """,
    "groupdel": r"""grep -v "^$1:" "$FAKE/group" > "$FAKE/g.new"; mv "$FAKE/g.new" "$FAKE/group"; echo "groupdel $1" >> "$FAKE/log" """,
}


def _run_user_step(tmp_path: Path, passwd: str, group: str, stubs: dict | None = None) -> tuple[str, str, str]:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    fake, bin_dir = tmp_path / "db", tmp_path / "bin"
    fake.mkdir()
    bin_dir.mkdir()
    (fake / "passwd").write_text(passwd)
    (fake / "group").write_text(group)
    (fake / "log").write_text("")
    for name, body in (stubs or _STUBS).items():
        (bin_dir / name).write_text("#!/bin/sh\n" + textwrap.dedent(body) + "\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE": str(fake)}
    result = subprocess.run([bash, "-c", user_step()], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return (fake / "passwd").read_text(), (fake / "group").read_text(), (fake / "log").read_text()


def test_user_step_on_python_slim(tmp_path):
    passwd, group, log = _run_user_step(tmp_path, "root:0:0\nnobody:65534:65534\n", "root:0\nnogroup:65534\n")
    assert "ray:1000:1000" in passwd and "ray:1000" in group
    assert "userdel" not in log


def test_user_step_on_ubuntu_24_04(tmp_path):
    """nvidia/cuda:*-ubuntu24.04 ships user and group "ubuntu" with uid/gid 1000: a plain
    `useradd --uid 1000 ray` fails there (the stub refuses like the real one)."""
    passwd, group, log = _run_user_step(tmp_path, "root:0:0\nubuntu:1000:1000\n", "root:0\nubuntu:1000\n")
    assert "ray:1000:1000" in passwd and "ubuntu" not in passwd and "ubuntu" not in group
    assert log.splitlines()[0] == "userdel ubuntu"


def test_user_step_fails_loudly_when_uid_1000_cannot_be_freed(tmp_path):
    """A base whose uid-1000 user cannot be removed: the build stops at this step, not later as a wrong uid."""
    stubs = dict(_STUBS, userdel="exit 12")
    with pytest.raises(AssertionError, match="UID 1000 is not unique"):
        _run_user_step(tmp_path, "root:0:0\nubuntu:1000:1000\n", "root:0\nubuntu:1000\n", stubs)


def test_user_step_is_idempotent(tmp_path):
    passwd, group, log = _run_user_step(tmp_path, "root:0:0\nray:1000:1000\n", "root:0\nray:1000\n")
    assert passwd.count("ray:") == 1 and log == ""


def test_image_runs_as_uid_1000_with_a_writable_profile_cache():
    text = DOCKERFILE.read_text()
    assert re.search(r"(?m)^USER 1000:1000$", text)  # numeric: runAsNonRoot can verify it
    assert "TREESERVE_CACHE=/opt/treeserve/cache" in text and 'mkdir -p "$TREESERVE_CACHE/profiles"' in text
    # The build proves the image serves: shipped files installed, the EAGLE pair loaded and generating.
    assert "treeserve generate --in-process --drafter eagle" in text
