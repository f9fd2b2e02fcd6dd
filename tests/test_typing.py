"""What the type checker (mypy, run by tests/run.sh before pytest) leaves to people: every silenced error says
why on its line; and what it found: `mgpu.spawn` stays the function after its module is imported."""

from __future__ import annotations

import re

from tests.conftest import ROOT

IGNORE = re.compile(r"type:\s*ignore")
WITH_REASON = re.compile(r"# type: ignore\[[a-z-]+(, ?[a-z-]+)*\]  # \S")


def test_every_type_ignore_names_its_code_and_says_why() -> None:
    bare = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for folder in ("mgpu", "jobs") for path in sorted((ROOT / folder).rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if IGNORE.search(line) and not WITH_REASON.search(line)]
    assert not bare, "a `# type: ignore[code]  # reason` each:\n" + "\n".join(bare)


def test_mgpu_spawn_is_the_function_on_every_access() -> None:
    """mgpu's lazy top level imported mgpu.spawn, which binds the *module* to `mgpu.spawn`: the second
    `mgpu.spawn(...)` of a program called a module (mypy: 'Module not callable' in jobs/loops)."""
    import mgpu

    first, second = mgpu.spawn, mgpu.spawn
    assert callable(first) and callable(second) and first is second
