"""tests/run.sh says what it will install and start before it does, and MGPU_SKIP_SLURM=1 skips the cluster.

The script runs for real, in a copy of the repository's layout whose heavy parts are stubs that log their
calls: `.venv/bin/python` (pip and pytest), `slurm/cluster/start.sh` and `dpkg-query` (no package installed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

LOG_STUB = '#!/bin/sh\necho "CALLED {name} $*" | tee -a "{log}"\n'
# The python stub fails (exit 1) when its arguments end with $FAIL_ON: one lane or mypy failing.
FAILING = 'case "$*" in *"$FAIL_ON") [ -n "$FAIL_ON" ] && exit 1 ;; esac\nexit 0\n'
E2E_LANE = "CALLED python -m pytest -n 3 --dist loadfile --durations=12 tests/e2e"


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    repo, log = tmp_path / "repo", tmp_path / "calls.log"
    (repo / "tests").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "run.sh", repo / "tests" / "run.sh")
    (repo / "constraints.txt").write_text("")
    stubs = {repo / ".venv" / "bin" / "python": "python",
             repo / "slurm" / "cluster" / "start.sh": "start.sh",
             tmp_path / "bin" / "dpkg-query": "dpkg-query"}
    for path, name in stubs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        text = LOG_STUB.format(name=name, log=log)
        if name == "python":
            text += FAILING
        if name == "start.sh":  # which cluster; the package list run.sh announces is start.sh's own line
            text = LOG_STUB.format(name=name, log=log).replace("$*", "cluster=$MGPU_SLURM_CLUSTER")
            text += "exit 0\nPKGS=(slurmctld slurmd munge)\n"
        if name == "dpkg-query":
            text = "#!/bin/sh\nexit 1\n"  # nothing installed
        path.write_text(text)
        path.chmod(0o755)
    return repo, log


def _run(tmp_path: Path, args: tuple[str, ...] = ("-q",), **env: str
         ) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    repo, log = _tree(tmp_path)
    environ = {k: v for k, v in os.environ.items() if k not in ("CI", "MGPU_SKIP_SLURM", "FAIL_ON", "MGPU_TEST_WORKERS")}
    environ.update(PATH=f"{tmp_path / 'bin'}:{environ.get('PATH', '/usr/bin:/bin')}", **env)
    result = subprocess.run(["bash", str(repo / "tests" / "run.sh"), *args], env=environ,
                            capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return result, calls


@pytest.mark.skipif(os.geteuid() != 0, reason="the cluster part of run.sh runs as root only")
def test_says_what_it_installs_and_starts_first(tmp_path: Path) -> None:
    result, calls = _run(tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    install = next(i for i, line in enumerate(out) if "will apt-get install" in line)
    assert out[install].endswith("(--no-install-recommends): slurmctld slurmd munge")
    start = next(i for i, line in enumerate(out) if "slurmctld, slurmd -N n1, slurmd -N n2" in line)
    skip = next(i for i, line in enumerate(out) if "MGPU_SKIP_SLURM=1 bash tests/run.sh" in line)
    first_call = next(i for i, line in enumerate(out) if line.startswith("CALLED"))
    assert max(install, start, skip) < first_call, out  # said before anything ran
    assert [c.split()[1] for c in calls] == ["python", "python", "start.sh", "python", "python"]
    assert calls[1].startswith("CALLED python -m compileall")  # after pip: the project's modules byte-compiled
    assert "CALLED start.sh cluster=a" in calls  # one pytest: cluster a's alone
    assert calls[-2:] == ["CALLED python -m mypy", "CALLED python -m pytest -q"]


def test_skip_slurm_starts_no_cluster_and_leaves_out_e2e(tmp_path: Path) -> None:
    result, calls = _run(tmp_path, MGPU_SKIP_SLURM="1")
    assert result.returncode == 0, result.stderr
    assert "MGPU_SKIP_SLURM=1: no Slurm cluster is installed or started; tests/e2e is not run" in result.stdout
    assert [c.split()[1] for c in calls] == ["python"] * 4  # pip, compileall, mypy, pytest: no start.sh
    assert calls[-2:] == ["CALLED python -m mypy", "CALLED python -m pytest --ignore=tests/e2e -q"]


@pytest.mark.parametrize("env, expect", [
    ({"MGPU_SKIP_SLURM": "1", "CI": "true"},
     "MGPU_SKIP_SLURM=1 is refused with CI=true: CI runs every test, the real-Slurm ones too"),
    ({"MGPU_SKIP_SLURM": "yes"}, "MGPU_SKIP_SLURM=yes: set it to 1 (skip the real-Slurm tests) or leave it unset"),
    ({"MGPU_TEST_WORKERS": "two"}, "MGPU_TEST_WORKERS=two: a number of workers >= 1"),
    ({"MGPU_TEST_WORKERS": "0"}, "MGPU_TEST_WORKERS=0: a number of workers >= 1"),
])
def test_refused_switch_runs_nothing(tmp_path: Path, env: dict[str, str], expect: str) -> None:
    result, calls = _run(tmp_path, **env)
    assert result.returncode == 2 and result.stderr.splitlines() == [f"tests/run.sh: {expect}"]
    assert calls == [] and result.stdout == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="the cluster part of run.sh runs as root only")
@pytest.mark.parametrize("fail_on, rc", [("", 0), (" tests/e2e", 1), ("--dist loadfile", 1), ("mypy", 1)])
def test_without_arguments_two_lanes_run_side_by_side_and_either_fails_it(tmp_path: Path, fail_on: str,
                                                                           rc: int) -> None:
    """What CI runs: the three clusters started, the end-to-end lane first (three streams: a pytest-xdist worker per
    cluster), mypy beside it (its failure ends the script before the rest runs), then the rest: two pytest
    processes at once; the script fails if either does, and ends with the end-to-end lane's output."""
    result, calls = _run(tmp_path, (), FAIL_ON=fail_on)
    assert result.returncode == rc, result.stdout + result.stderr
    assert [c for c in calls if "start.sh" in c] == ["CALLED start.sh cluster=a", "CALLED start.sh cluster=b",
                                                     "CALLED start.sh cluster=c"]
    assert "slurmctld, slurmd -N n3, slurmd -N n4 (cluster b" in result.stdout
    assert "slurmctld, slurmd -N n5, slurmd -N n6 (cluster c" in result.stdout
    pytests = sorted(c for c in calls if " -m pytest" in c)
    if fail_on == "mypy":
        # the rest never runs; the end-to-end lane, started first in the background, is killed (its stub may not
        # have logged yet)
        assert "CALLED python -m mypy" in calls and pytests in ([], [E2E_LANE]), calls
        assert "tests/run.sh: mypy failed: the end-to-end lane is stopped, the rest not run" in result.stderr
        return
    # the rest in 3 pytest-xdist workers (a file at a time each); the end-to-end lane in 3, one per cluster; each
    # lane names its slowest tests
    assert pytests == ["CALLED python -m pytest --ignore=tests/e2e --durations=12 -n 3 --dist loadfile", E2E_LANE]
    out = result.stdout.splitlines()
    first = 1 if fail_on == "--dist loadfile" else 0
    second = 1 if fail_on == " tests/e2e" else 0
    assert f"tests/run.sh: exit status {first} (pytest --ignore=tests/e2e, above) and {second} (pytest tests/e2e, " \
           "run beside it, below)" in out, out
    assert out[-1] == E2E_LANE  # the lane's own output comes last


@pytest.mark.skipif(os.geteuid() != 0, reason="the cluster part of run.sh runs as root only")
def test_one_worker_runs_each_lane_in_one_process_on_cluster_a_alone(tmp_path: Path) -> None:
    result, calls = _run(tmp_path, (), MGPU_TEST_WORKERS="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [c for c in calls if "start.sh" in c] == ["CALLED start.sh cluster=a"]
    assert sorted(c for c in calls if " -m pytest" in c) == ["CALLED python -m pytest --durations=12 tests/e2e",
                                                             "CALLED python -m pytest --ignore=tests/e2e --durations=12"]
