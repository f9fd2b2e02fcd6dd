"""mgpu/ in subpackages by layer (issue 35): every import runs downward (or within its own package), the old
module names still import as the new modules, and `python -m OLD` still runs (a batch script written for an
older mgpu holds `python -m mgpu.recovery`)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Bottom to top; a package may import the top-level leaves (errors, fsutil, moved) and any package before it.
LAYERS = ["config", "cluster", "parallel", "record", "state", "stop", "data", "run", "train", "check", "submit"]
LEAVES = {"errors", "fsutil", "moved"}


def imported_packages(path: Path) -> set[str]:
    """The mgpu subpackages (or top-level modules) a file imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        for name in names:
            parts = name.split(".")
            if parts[0] == "mgpu" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_every_import_runs_downward() -> None:
    upward = []
    for package in LAYERS:
        allowed = {package, *LEAVES, *LAYERS[:LAYERS.index(package)]}
        if package == "submit":  # the submission path sits beside state..train: it needs config, cluster, record
            allowed = {package, *LEAVES, "config", "cluster", "record"}
        for path in sorted((ROOT / "mgpu" / package).glob("*.py")):
            upward += [f"{path.relative_to(ROOT)} -> mgpu.{p}" for p in imported_packages(path) - allowed]
    for leaf in LEAVES:
        upward += [f"mgpu/{leaf}.py -> mgpu.{p}" for p in imported_packages(ROOT / "mgpu" / f"{leaf}.py") - LEAVES]
    assert not upward, "imports that run up a layer:\n" + "\n".join(upward)


def imported_modules(path: Path) -> set[str]:
    """The mgpu modules (dotted) a file imports, type-only imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("mgpu"):
            found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("mgpu")}
    return found


def test_no_module_imports_itself_through_others() -> None:
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in (ROOT / "mgpu").rglob("*.py")
             if p.name != "__init__.py"}
    graph = {name: imported_modules(path) & set(files) - {name} for name, path in files.items()}
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            raise AssertionError("import cycle: " + " -> ".join([*trail[trail.index(name):], name]))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_every_module_lives_in_a_layer() -> None:
    top = {p.stem for p in (ROOT / "mgpu").glob("*.py")} - {"__init__"}
    assert top == LEAVES, f"modules outside the layers: {sorted(top - LEAVES)}"
    assert {p.name for p in (ROOT / "mgpu").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)
    for package in LAYERS:
        doc = ast.get_docstring(ast.parse((ROOT / "mgpu" / package / "__init__.py").read_text()))
        assert doc and "Imports" in doc, f"mgpu/{package}/__init__.py must say what it owns and may import"


def test_old_module_names_are_the_new_modules() -> None:
    import mgpu
    import mgpu.checkpoint  # noqa: F401  (the old name)
    import mgpu.state.checkpoint
    from mgpu.config import load_config
    from mgpu.moved import MOVED
    from mgpu.stream import ShardedStream

    assert sys.modules["mgpu.checkpoint"] is mgpu.state.checkpoint
    assert ShardedStream is sys.modules["mgpu.data.stream"].ShardedStream
    assert load_config is sys.modules["mgpu.config.loading"].load_config
    assert callable(mgpu.spawn) and mgpu.Task is sys.modules["mgpu.train.task"].Task
    for old, new in MOVED.items():  # the map names real modules
        assert (ROOT / "mgpu" / (new.replace(".", "/") + ".py")).exists(), (old, new)


@pytest.mark.parametrize("old,new", [("mgpu.recovery", "mgpu.run.recovery"), ("mgpu.spawn", "mgpu.run.spawn")])
def test_python_dash_m_with_an_old_name_still_runs(old: str, new: str) -> None:
    before = subprocess.run([sys.executable, "-m", old, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    after = subprocess.run([sys.executable, "-m", new, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert before.returncode == after.returncode == 0, before.stderr[-2000:]
    options = re.compile(r"--[a-z][a-z-]*")
    assert set(options.findall(before.stdout)) == set(options.findall(after.stdout)) != set()
