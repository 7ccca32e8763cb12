"""The layout's rules (README, Architecture): a few modules at runtime/'s root, a package per
role, and parallel/ generic (it imports nothing from runtime.models)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROLES = {"api", "serving", "control", "worker", "speculation", "models", "bench"}


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


def test_parallel_imports_no_model():
    for path in (ROOT / "parallel").glob("*.py"):
        bad = [n for n in _imports(path) if n.startswith("runtime.models")]
        assert not bad, f"{path.name} imports {bad}"


def test_one_round_reads_in_one_module():
    tree = ast.parse((ROOT / "runtime" / "worker" / "round.py").read_text())
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"speculate", "decode_target_only"} <= functions
    worker = (ROOT / "runtime" / "worker" / "process.py").read_text()
    assert "bridge_broadcast" not in worker and ".verify(" not in worker
