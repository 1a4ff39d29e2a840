"""The layer rules (docs/design.md section 2), checked statically on every import statement of every module (those
inside functions included, relative ones resolved), parsed with ast:

- engine/ is a plain library (no Ray, no gRPC, nothing of services/, tools/ or cli/); tools/ (the bench and the
  training) stands on engine/ alone (no Ray, no gRPC, nothing of services/ or cli/); services/ reaches neither
  into tools/ nor up into the command layer cli/; only cli/ parses command lines (argparse).
- Inside engine/, floors that import only downward (a floor may import its own floor and those below), and no
  import cycle among its packages and top-level modules; none among tools/' packages either.
- No import cycle among the modules of engine/, services/, tools/ and cli/, function-local imports included (a
  module's import of a package it lies in is no edge: Python imports that package first).
- TreeServe's own modules are imported at module level (in engine/, only its torch-free modules may import one
  inside a function), except where the imported module brings one of the
  optional heavy dependencies (HEAVY) that the importing module does without: the CLI's commands load torch or
  Ray only when they run, config validation reads drafters and lookup settings without torch. The engine's and
  the tools' torch-free modules (TORCH_FREE, TOOLS_TORCH_FREE) really import without torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"engine": "treeserve.engine", "services": "treeserve.services", "tools": "treeserve.tools",
            "cli": "treeserve.cli"}
# folder -> top-level modules / treeserve packages its code must not import
FORBIDDEN = {
    "engine": ("treeserve.cli", "treeserve.services", "treeserve.tools", "ray", "grpc", "argparse"),
    "services": ("treeserve.cli", "treeserve.tools", "argparse"),
    "tools": ("treeserve.cli", "treeserve.services", "ray", "grpc", "argparse"),
}
# The engine's floors, lowest first: a module's floor is that of its longest listed prefix (relative to engine/).
FLOORS: tuple[tuple[str, ...], ...] = (
    # 0. settings and requests, torch-free: what the Serve config, the wire format and the CLI's options read
    ("methods", "tree_config", "tree_settings", "requests", "devices", "dev_prompts", "chat_templates",
     "drafters.registry", "drafters.models.compatibility", "drafters.models.formats", "lookup", "lookup.session",
     "lookup.suffix_index", "lookup.shared_outputs", "hardware.cost_curve", "lanes", "kv_settings", "grammar.spec",
     "models.paths", "models.conversion", "greedy_rule"),
    # 1. token trees, sampling, penalties, verification and the C2T classifier: pure functions over tensors
    ("tree", "sampling", "processors", "verify", "acceptance", "c2t_classifier", "grammar"),
    # 2. models and the runners that keep their KV caches; what a step costs on this machine
    ("tp", "models", "runners", "hardware"),
    # 3. tree builders, copy-from-context trees, the budget chooser
    ("builders", "lookup.trees", "budget"),
    # 4. drafters
    ("drafters",),
    # 5. the engine and its factory
    ("speculative_engine", "step_recorder", "parts", "factory"),
)
# The optional heavy dependencies: a module may import one of TreeServe's modules inside a function only when that
# module brings one of these (at import, through its own module-level imports) and the importing one does not.
# The generated gRPC stubs (treeserve.v1) count as grpc.
HEAVY = ("torch", "transformers", "ray", "grpc", "numpy", "safetensors")
# Modules that import without torch although parts of them use it (a function-local import of a torch module of
# TreeServe's, where the function needs it): the Serve config validates drafters and lookup settings with them,
# and the CLI builds its options from them, in processes that never load a model.
TORCH_FREE = ("methods", "tree_config", "tree_settings", "requests", "devices", "dev_prompts", "chat_templates",
              "drafters.registry", "drafters.models.compatibility", "drafters.models.formats", "lookup",
              "lookup.session", "hardware.cost_curve", "kv_settings", "grammar.spec", "models.paths",
              "models.conversion", "greedy_rule")
# The same inside tools/: the bench's options, from which the CLI builds `treeserve bench`'s arguments.
TOOLS_TORCH_FREE = ("bench.options",)


def module_name(path: Path, root: Path = ROOT) -> str:
    folder, *rest = path.relative_to(root).with_suffix("").parts
    rest = rest[:-1] if rest and rest[-1] == "__init__" else rest
    return ".".join([PACKAGES[folder], *rest])


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str, bool]]:
    """(line, dotted module name, inside a function) of every import in the file (a checkout's `root`), relative
    ones resolved; `from treeserve import cli` counts as treeserve.cli."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    local = {id(node) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        inside = id(node) in local
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, inside) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            found.append((node.lineno, base, inside))
            found += [(node.lineno, f"{base}.{alias.name}", inside) for alias in node.names]
    return found


def engine_modules(folder: str = "engine") -> dict[str, Path]:
    """Every module of the folder (engine/ unless told) by its name relative to it ("" for the package itself)."""
    return {module_name(p).removeprefix(PACKAGES[folder]).lstrip("."): p
            for p in sorted((ROOT / folder).rglob("*.py"))}


def floor_of(name: str) -> int:
    best, floor = -1, -1
    for level, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, floor = len(prefix), level
    return floor


def engine_import_edges(module_level_only: bool = False, folder: str = "engine") -> list[tuple[str, str, str]]:
    """(importing module, imported engine module, "file:line") for every import of an engine module by an engine
    module (only those at module level if asked), or the same inside another folder; a `from package import name`
    counts as the package when `name` is no module of it."""
    modules = engine_modules(folder)
    edges = []
    for source, path in modules.items():
        for line, name, inside in imports(path):
            if inside and module_level_only:
                continue
            if not name.startswith(PACKAGES[folder] + "."):
                continue
            target = name.removeprefix(PACKAGES[folder] + ".")
            while target and target not in modules:
                target = target.rpartition(".")[0]
            edge = (source, target, f"{path.relative_to(ROOT)}:{line}")
            if target and target != source and edge not in edges:
                edges.append(edge)
    return edges


def unit(name: str) -> str:
    """The engine package or top-level module a module belongs to (what cycles are counted between)."""
    return name.split(".")[0]


def cycles(edges: list[tuple[str, str, str]], unit=unit) -> list[list[str]]:
    """Strongly connected components of more than one unit (Tarjan)."""
    graph = defaultdict(set)
    for source, target, _ in edges:
        if unit(source) != unit(target):
            graph[unit(source)].add(unit(target))
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def violations(folder: str) -> list[str]:
    banned = FORBIDDEN[folder]
    return [f"{path.relative_to(ROOT)}:{line} imports {name}"
            for path in sorted((ROOT / folder).rglob("*.py"))
            for line, name, _ in imports(path)
            if any(name == b or name.startswith(b + ".") for b in banned)]


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_layers_import_only_downwards(folder):
    assert not violations(folder), "\n".join(violations(folder))


def test_every_engine_module_has_a_floor():
    assert not [name for name in engine_modules() if name and floor_of(name) < 0]


def test_engine_floors_import_only_downwards():
    """At module level: the torch-free modules' function-local imports of torch modules are the one exception."""
    upward = [f"{where}: {source} (floor {floor_of(source)}) imports {target} (floor {floor_of(target)})"
              for source, target, where in engine_import_edges(module_level_only=True)
              if source and floor_of(target) > floor_of(source)]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("folder", ["engine", "tools"])
def test_no_import_cycle_among_packages(folder):
    assert cycles(engine_import_edges(folder=folder)) == []


def all_modules() -> dict[str, Path]:
    """Every module of engine/, services/, tools/ and cli/ by its dotted name."""
    return {module_name(p): p for folder in PACKAGES for p in sorted((ROOT / folder).rglob("*.py"))}


def module_import_edges(modules: dict[str, Path], root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(importing module, imported module, "file:line") for every import of one of `modules` (files of a checkout's
    `root`) by another, those inside functions included; a `from package import name` counts as the package when
    `name` is no module of it, and a module importing a package it lies in is left out."""
    edges = []
    for source, path in modules.items():
        for line, name, _ in imports(path, root):
            target = name
            while target and target not in modules:
                target = target.rpartition(".")[0]
            edge = (source, target, f"{path.relative_to(root)}:{line}")
            if target and not (source + ".").startswith(target + ".") and edge not in edges:
                edges.append(edge)
    return edges


def cycle_through(component: list[str], edges: list[tuple[str, str, str]]) -> list[str]:
    """One cycle inside a strongly connected component, as "module (file:line of its import of the next)" from its
    first module round to that module again."""
    inside = set(component)
    where = {(s, t): w for s, t, w in reversed(edges)}
    graph = defaultdict(list)
    for source, target, _ in edges:
        if source in inside and target in inside:
            graph[source].append(target)
    start, path, seen = component[0], [component[0]], {component[0]}

    def walk(v: str) -> bool:
        for w in graph[v]:
            if w == start:
                return True
            if w not in seen:
                seen.add(w)
                path.append(w)
                if walk(w):
                    return True
                path.pop()
        return False

    walk(start)
    return [f"{v} ({where[v, w]})" for v, w in zip(path, path[1:] + [start])] + [start]


def heavy_closure(modules: dict[str, Path]) -> dict[str, frozenset[str]]:
    """The HEAVY dependencies each module loads at import: its module-level imports, its packages' and those of
    the TreeServe modules it imports, transitively."""
    direct: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = {".".join(name.split(".")[:i]) for i in range(2, name.count(".") + 1)} - {name}
        for _, imported, inside in imports(path):
            top = imported.split(".")[0]
            if inside:
                continue
            if imported.startswith("treeserve.v1"):
                deps.add("!grpc")
            elif top in HEAVY:
                deps.add("!" + top)
            elif imported.startswith("treeserve."):
                while imported and imported not in modules:
                    imported = imported.rpartition(".")[0]
                if imported and imported != name:
                    deps.add(imported)
        direct[name] = deps
    closure: dict[str, frozenset[str]] = {}

    def visit(name: str, seen: frozenset[str]) -> frozenset[str]:
        if name in closure:
            return closure[name]
        found = set()
        for dep in direct.get(name, ()):
            if dep.startswith("!"):
                found.add(dep[1:])
            elif dep not in seen:
                found |= visit(dep, seen | {name})
        if not seen:  # a partial result inside a cycle is not cached
            closure[name] = frozenset(found)
        return frozenset(found)

    for name in modules:
        visit(name, frozenset())
    return closure


def test_no_import_cycle_among_modules():
    edges = module_import_edges(all_modules())
    found = [" -> ".join(cycle_through(component, edges)) for component in cycles(edges, unit=lambda name: name)]
    assert not found, "\n".join(found)


def test_own_modules_are_imported_at_module_level():
    """Unless the import is of an optional heavy dependency (HEAVY) the importing module does without."""
    modules = all_modules()
    heavy = heavy_closure(modules)
    lazy = []
    for name, path in modules.items():
        for line, imported, inside in imports(path):
            if not inside or not imported.startswith("treeserve."):
                continue
            brings = {"grpc"} if imported.startswith("treeserve.v1") else set()
            target = imported
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target:
                brings |= heavy[target]
            if not brings - heavy[name]:
                lazy.append(f"{path.relative_to(ROOT)}:{line} imports {imported} inside a function (it brings "
                            f"nothing heavier than the module has: {sorted(heavy[name])})")
    assert not lazy, "\n".join(sorted(set(lazy)))


@pytest.mark.parametrize("folder, torch_free", [("engine", TORCH_FREE), ("tools", TOOLS_TORCH_FREE)])
def test_libraries_import_their_own_modules_at_module_level(folder, torch_free):
    """Stricter inside engine/ and tools/: only the torch-free modules may import a module of TreeServe in a
    function."""
    lazy = [f"{path.relative_to(ROOT)}:{line} imports {name} inside a function"
            for name_, path in engine_modules(folder).items() if name_ not in torch_free
            for line, name, inside in imports(path) if inside and name.startswith("treeserve.")]
    assert not lazy, "\n".join(lazy)


def test_torch_free_modules_import_without_torch():
    names = [f"treeserve.engine.{name}" for name in TORCH_FREE] + [f"treeserve.tools.{name}"
                                                                     for name in TOOLS_TORCH_FREE]
    code = (f"import sys\nfor name in {names!r}:\n    __import__(name)\n"
            "print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_check_sees_every_import_form(tmp_path):
    sample = tmp_path / "engine" / "drafters" / "sample.py"
    sample.parent.mkdir(parents=True)
    sample.write_text("import grpc.aio\nfrom ray import serve\nfrom treeserve import cli\nfrom ..tree import TokenTree\n"
                      "from . import registry\n\ndef lazy():\n    from treeserve.services.client import open_channel\n")
    found = {(name, inside) for _, name, inside in imports(sample, tmp_path)}
    assert {("grpc.aio", False), ("ray", False), ("treeserve.cli", False), ("treeserve.engine.tree.TokenTree", False),
            ("treeserve.engine.drafters.registry", False), ("treeserve.services.client", True)} <= found


def test_cycles_are_found():
    edges = [("a.x", "b", ""), ("b", "c.y", ""), ("c.z", "a", ""), ("d", "a", "")]
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles(edges, unit=lambda name: name) == []  # between modules none: a.x -> b, but a (not a.x) <- c.z


def test_module_cycles_are_found_and_printed(tmp_path):
    """A function-local import closes a cycle as a module-level one does; a submodule importing its own package
    (`from . import x`) closes none."""
    root = tmp_path / "engine"
    (root / "drafters").mkdir(parents=True)
    files = {"__init__.py": "", "drafters/__init__.py": "from . import a\n",
             "drafters/a.py": "from . import b\nfrom .. import tree\n",
             "drafters/b.py": "def late():\n    from .a import x\n", "tree.py": ""}
    for name, text in files.items():
        (root / name).write_text(text)
    modules = {module_name(p, tmp_path): p for p in sorted(root.rglob("*.py"))}
    edges = module_import_edges(modules, tmp_path)
    component, = cycles(edges, unit=lambda name: name)
    assert component == ["treeserve.engine.drafters.a", "treeserve.engine.drafters.b"]
    assert cycle_through(component, edges) == ["treeserve.engine.drafters.a (engine/drafters/a.py:1)",
                                               "treeserve.engine.drafters.b (engine/drafters/b.py:2)",
                                               "treeserve.engine.drafters.a"]
