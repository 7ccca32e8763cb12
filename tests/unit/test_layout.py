"""The layout's rules (README, Architecture): a few modules at runtime/'s root, a package per
role, models/ in rooms by role, parallel/ generic (it imports nothing from runtime/), and no
import circle anywhere in the product (imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROLES = {"api", "serving", "control", "worker", "speculation", "models", "bench", "config"}
MODEL_ROOMS = {"arch", "kernels", "loading", "runners"}
PACKAGES = ("runtime", "launcher", "parallel")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_runtime_root_holds_only_the_shared_vocabulary():
    modules = sorted(p.name for p in (ROOT / "runtime").glob("*.py"))
    assert len(modules) <= 6, modules
    packages = {p.name for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").exists()}
    assert packages == ROLES


def test_parallel_imports_nothing_from_runtime():
    for path in (ROOT / "parallel").glob("*.py"):
        bad = [n for n in _imports(path) if n == "runtime" or n.startswith("runtime.")]
        assert not bad, f"{path.name} imports {bad}"


def test_models_live_in_rooms_by_role():
    models = ROOT / "runtime" / "models"
    assert [p.name for p in models.glob("*.py")] == ["__init__.py"]
    rooms = {p.name for p in models.iterdir() if (p / "__init__.py").exists()}
    assert rooms == MODEL_ROOMS
    for room in rooms:
        modules = list((models / room).rglob("*.py"))
        assert len(modules) <= 16, f"models/{room} holds {len(modules)} modules"  # 15 + __init__


def _module_graph() -> dict[str, set[str]]:
    """module -> the product modules it imports (a name imported from a package counts as
    its submodule where one exists; a package's __init__ is not counted for its children)."""
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        for imported in _imports(path):
            if imported in modules:
                deps.add(imported)
            elif imported.rpartition(".")[0] in modules:
                deps.add(imported.rpartition(".")[0])
        deps.discard(name)
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in graph.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    assert _cycles(_module_graph()) == []


def test_the_circle_finder_finds_circles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_one_round_reads_in_one_module():
    tree = ast.parse((ROOT / "runtime" / "worker" / "round.py").read_text())
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"speculate", "decode_target_only"} <= functions
    for name in ("process.py", "dispatch.py", "control_link.py"):  # they only dispatch
        worker = (ROOT / "runtime" / "worker" / name).read_text()
        assert "bridge_broadcast" not in worker and ".verify(" not in worker, name


def test_no_product_file_over_400_lines():
    """A file holds one concern: at most 400 lines (as ruff formats them)."""
    long = {
        str(path.relative_to(ROOT)): n
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 400
    }
    assert not long, long


def test_few_environment_variables_each_documented():
    """The lab stays out of the product: at most 11 TANDEM_* names in runtime/, launcher/
    and parallel/ (a performance setting is a default or a config key; the 11th is
    TANDEM_API_KEY, the HTTP API's key that INTERFACE.md names), each in
    docs/configuration.md's reference."""
    import re

    names = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            names |= set(re.findall(r"TANDEM_[A-Z0-9_]+", path.read_text()))
    assert len(names) <= 11, sorted(names)
    docs = (ROOT / "docs" / "configuration.md").read_text()
    assert not [n for n in names if f"`{n}`" not in docs], sorted(names)
