"""mgpu/ in subpackages by layer (issue 35), mgpu/state/ in folders by concept (issue 46): every import runs downward
(or within its own package), the old module names still import as the new modules, and `python -m OLD` still runs
(a batch script written for an older mgpu holds `python -m mgpu.recovery` or `python -m mgpu.state.memory_snapshot
--remove-this-job`)."""

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
# mgpu/state/ by concept: what each of its parts may import of mgpu.state ("" is a module of mgpu/state/ itself, one
# that a checkpoint holds or every form shares). Its coordinators, above every form, import any part.
STATE_PARTS = {"files": {"files"}, "": {"", "files"}, "single": {"", "files", "single"},
               "sharded": {"", "files", "single", "sharded"}, "memory": {"", "files", "single", "memory"}}
STATE_TOP = {"checkpointer", "resumption", "inference"}


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
        for path in sorted((ROOT / "mgpu" / package).rglob("*.py")):
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


def state_part(path: Path) -> str:
    """The part of mgpu/state/ a file of it belongs to: its folder, or "" for a module of mgpu/state/ itself."""
    parts = path.relative_to(ROOT / "mgpu" / "state").parts
    return parts[0] if len(parts) > 1 else ""


def test_state_imports_run_down_its_parts() -> None:
    """Inside mgpu/state/: `files` below everything, then what a checkpoint holds, then the forms (single, sharded,
    memory; sharded and memory never each other), then the coordinators that pick one (`STATE_TOP`)."""
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "mgpu" / "state").rglob("*.py")}
    upward = []
    for name, path in sorted(paths.items()):
        if name.split(".")[-1] in STATE_TOP and state_part(path) == "":
            continue
        # a module, or a package's module (`from mgpu.state.files import digest`); not a name inside one
        imported = {m for m in imported_modules(path) if m in paths and m != "mgpu.state"}
        for module in imported:
            if module.split(".")[-1] in STATE_TOP and state_part(paths[module]) == "":
                upward.append(f"{name} -> {module} (a coordinator)")
            elif state_part(paths[module]) not in STATE_PARTS[state_part(path)]:
                upward.append(f"{name} -> {module}")
    assert set(STATE_PARTS) - {""} == {p.name for p in (ROOT / "mgpu" / "state").iterdir()
                                       if p.is_dir() and p.name != "__pycache__"}
    assert not upward, "imports that run up inside mgpu/state/:\n" + "\n".join(sorted(upward))


def test_every_module_lives_in_a_layer() -> None:
    top = {p.stem for p in (ROOT / "mgpu").glob("*.py")} - {"__init__"}
    assert top == LEAVES, f"modules outside the layers: {sorted(top - LEAVES)}"
    assert {p.name for p in (ROOT / "mgpu").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)
    packages = [p.parent for p in (ROOT / "mgpu").rglob("__init__.py") if p.parent != ROOT / "mgpu"]
    assert len(packages) > len(LAYERS)  # mgpu/state/'s folders among them
    for package in packages:
        folders = [p for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"]
        assert all((folder / "__init__.py").is_file() for folder in folders), f"{package}: a folder that is no package"
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        where = package.relative_to(ROOT)
        assert doc and "Imports" in doc, f"{where}/__init__.py must say what it owns and may import"


def test_old_module_names_are_the_new_modules() -> None:
    import importlib

    import mgpu
    import mgpu.checkpoint  # noqa: F401  (the old name)
    import mgpu.state.single.store
    from mgpu.config import load_config
    from mgpu.moved import _PACKAGES_NOW, MOVED
    from mgpu.stream import ShardedStream

    assert sys.modules["mgpu.checkpoint"] is mgpu.state.single.store
    assert ShardedStream is sys.modules["mgpu.data.stream"].ShardedStream
    assert load_config is sys.modules["mgpu.config.loading"].load_config
    assert callable(mgpu.spawn) and mgpu.Task is sys.modules["mgpu.train.task"].Task
    for old, new in MOVED.items():  # the map names real modules, and no old name is still a module of its own
        assert (ROOT / "mgpu" / (new.replace(".", "/") + ".py")).exists(), (old, new)
        assert not (ROOT / "mgpu" / (old.replace(".", "/") + ".py")).exists(), old
    # mgpu/state/'s names from before its folders (issue 46): each the new module itself, attributes and all
    for old, new in MOVED.items():
        if old.startswith("state.") and old not in _PACKAGES_NOW:
            assert importlib.import_module(f"mgpu.{old}") is importlib.import_module(f"mgpu.{new}"), old
    from mgpu.state import checkpoint as old_store
    from mgpu.state.digest import crc32
    from mgpu.state.sharded import ShardedCheckpointer
    from mgpu.state.single.store import CheckpointStore

    assert old_store.CheckpointStore is CheckpointStore and crc32 is sys.modules["mgpu.state.files.digest"].crc32
    # mgpu.state.sharded, a module before, is now the folder: it hands on that module's names
    checkpointer = importlib.import_module("mgpu.state.sharded.checkpointer")
    assert ShardedCheckpointer is checkpointer.ShardedCheckpointer
    assert {name for name in checkpointer.__all__ if getattr(mgpu.state.sharded, name) is getattr(checkpointer, name)} \
        == set(checkpointer.__all__) == mgpu.state.sharded._CHECKPOINTER


@pytest.mark.parametrize("old,new", [("mgpu.recovery", "mgpu.run.recovery"), ("mgpu.spawn", "mgpu.run.spawn"),
                                     ("mgpu.state.memory_snapshot", "mgpu.state.memory.store"),
                                     ("mgpu.state.sharded_export", "mgpu.state.sharded.export")])
def test_python_dash_m_with_an_old_name_still_runs(old: str, new: str) -> None:
    before = subprocess.run([sys.executable, "-m", old, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    after = subprocess.run([sys.executable, "-m", new, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert before.returncode == after.returncode == 0, before.stderr[-2000:]
    options = re.compile(r"--[a-z][a-z-]*")
    assert set(options.findall(before.stdout)) == set(options.findall(after.stdout)) != set()
