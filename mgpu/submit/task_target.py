"""The task's import path: `task.target` (`package.module:Class`) checked to name a module that can be found and
binds that name at its top level, by parsing the module's source without importing it (a task's module imports
torch; `jobs/submit.py --help` and `--dry-run` must not). One-line ConfigErrors.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from mgpu.config.loading import ConfigError

__all__ = ["check_task_target"]


def _defined_names(tree: ast.Module) -> set[str]:
    """Names bound at a module's top level (also inside top-level if/try blocks)."""
    names: set[str] = set()
    nodes: list[ast.stmt] = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):
            nodes.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            nodes.extend(s for h in getattr(node, "handlers", []) for s in h.body)
    return names


def check_task_target(target: str) -> None:
    """The module of `package.module:Class` can be found and binds the class; without importing it."""
    module, _, name = target.partition(":")
    fix = "run from the repository root or install the package that defines it"
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a missing parent package
        spec = None
    except Exception as error:  # noqa: BLE001  (a parent package's __init__ that fails to run)
        raise ConfigError(f"task.target={target!r}: importing the package of {module!r} failed: {error}") from None
    if spec is None:
        raise ConfigError(f"task.target={target!r}: no module named {module!r} ({fix})")
    if not (spec.origin and spec.origin.endswith(".py")):
        return  # compiled or namespace module: only importing would tell
    try:
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"), spec.origin)
    except (OSError, SyntaxError, UnicodeDecodeError) as error:
        raise ConfigError(f"task.target={target!r}: cannot read {spec.origin}: {error}") from None
    if name not in _defined_names(tree):
        raise ConfigError(f"task.target={target!r}: {spec.origin} defines no {name!r}")
