"""A warm-started rank (tests/warm_start.py) is the process a fresh `python` would be, in everything the tests
see: argv and the interpreter's command line, sys.path[0], `__main__` (a spawned child unpickles its functions),
environment, process group, stdin, faulthandler, its own descriptors, output, and each way of exiting (code,
exception, signal, os._exit, atexit, non-daemon threads). Each form (script, -m, -c) runs both ways and the two
views must be equal. A request the server cannot serve exactly (another startup environment or directory) starts
fresh."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from tests import warm_start
from tests.conftest import PYTHON, ROOT, base_env, popen_rank

pytestmark = pytest.mark.multiprocess

# the probe's three forms, run in the checkout (the server's working directory: another one starts fresh)
FORMS = {"script": ["tests/warm_probe.py"], "module": ["-m", "tests.warm_probe"],
         "command": ["-c", "import runpy; runpy.run_path('tests/warm_probe.py', run_name='__main__')"]}
# how the probe exits -> (return code, the lines after its view)
EXITS = {"exit": (3, ["thread joined", "atexit ran"]), "raise": (1, None), "signal": (-signal.SIGTERM, []),
         "os_exit": (5, [])}


def _cold(argv: list[str], env: dict[str, str], group: int | None) -> subprocess.Popen[str]:
    return subprocess.Popen([PYTHON, *argv], env=env, cwd=ROOT, process_group=group,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _outcome(proc: warm_start.WarmProcess | subprocess.Popen[str]) -> tuple[int, dict[str, object], list[str]]:
    out, _ = proc.communicate(timeout=120)
    first, *rest = out.splitlines()
    return proc.returncode, json.loads(first), rest


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_warm_rank_is_what_a_fresh_python_would_be(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(warm_start.COLD, raising=False)
    env = base_env(PROBE_VAR="x", PYTHONFAULTHANDLER="1")
    env.pop("PYTEST_VERSION", None)
    for how, (code, tail) in EXITS.items():
        argv = [*FORMS[form], how]
        warm = popen_rank(argv, env, ROOT, process_group=0)
        assert isinstance(warm, warm_start.WarmProcess), "the warm-start server turned the probe away"
        cold = _cold(argv, env, 0)
        (warm_rc, warm_view, warm_rest), (cold_rc, cold_view, cold_rest) = _outcome(warm), _outcome(cold)
        assert (warm_rc, warm_view) == (cold_rc, cold_view), f"{form} {how}"
        assert warm_rc == code and warm_view["own_group"] and warm_view["spawned"] == 49 and not warm_view["stdin"]
        assert warm_view["probe_var"] == "x" and not warm_view["pytest_var"] and warm_view["faulthandler"]
        if tail is None:  # an unhandled exception: the interpreter's traceback, then the same exit steps
            assert warm_rest[-3:] == cold_rest[-3:] and warm_rest[-3] == "RuntimeError: probe failed", warm_rest
        else:
            assert warm_rest == cold_rest == tail, (warm_rest, cold_rest)


def test_a_request_whose_startup_environment_differs_starts_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(warm_start.COLD, raising=False)
    proc = popen_rank(["-c", "pass"], base_env(OMP_NUM_THREADS="2"))
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0
    proc = popen_rank(["-c", "pass"], base_env(), ROOT / "tests")
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0
    monkeypatch.setenv(warm_start.COLD, "1")
    proc = popen_rank(["-c", "pass"], base_env())
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0
