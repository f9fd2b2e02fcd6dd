"""slurm/cluster/start.sh: a fresh start forgets the jobs of the daemons before it; a start that finds the
cluster running keeps them.

start.sh runs for real (sourced, then its `main`), with every step that installs or starts a daemon replaced
by a stub that logs its name: what is tested is the order of the steps and what they leave in the state dir.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

START = ROOT / "slurm" / "cluster" / "start.sh"
STUBBED = ("install_packages", "ensure_hosts", "write_config", "link_etc", "start_munge", "start_mariadb",
           "wait_nodes", "summary")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="start.sh runs as root only")


def _earlier_sessions_state(state_dir: Path) -> None:
    """What a controller and two slurmd stopped mid-run leave: saved jobs, a job's script, spools."""
    (state_dir / "state" / "hash.7" / "job.617").mkdir(parents=True)
    (state_dir / "state" / "hash.7" / "job.617" / "script").write_text("#!/bin/sh\nsleep 600\n")
    (state_dir / "state" / "job_state").write_bytes(b"617")
    (state_dir / "state" / "job_state.old").write_bytes(b"616")
    (state_dir / "spool" / "n1").mkdir(parents=True)
    (state_dir / "spool" / "n1" / "cred_state").write_bytes(b"617")
    (state_dir / "etc").mkdir()
    (state_dir / "etc" / "fingerprint").write_text("same\n")


ALL = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd-n1", "slurmd-n2")


def _start(tmp_path: Path, running: bool | tuple[str, ...], ping_fails: int = 0) -> list[str]:
    """start.sh's steps; `running`: the earlier start's daemons alive (all, none, or these); `ping_fails`: how many
    times the controller does not answer before it does."""
    # Without its guard, sourcing start.sh would start a real cluster in tmp_path and point /etc/slurm at it.
    assert '[[ ${BASH_SOURCE[0]} == "$0" ]] || return 0' in START.read_text().splitlines()
    state_dir, log = tmp_path / "slurm", tmp_path / "steps.log"
    _earlier_sessions_state(state_dir)
    stop = tmp_path / "stop.sh"
    stop.write_text(f"#!/bin/sh\necho stop.sh >>{log}\n")
    stop.chmod(0o755)
    bin_dir = tmp_path / "bin"  # `timeout 10 scontrol ping` runs a program: the controller answers, at last
    bin_dir.mkdir()
    pings = tmp_path / "pings"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho x >> {pings}\n[ "$(wc -l < {pings})" -gt {ping_fails} ]\n')
    (bin_dir / "scontrol").chmod(0o755)
    alive = ALL if running is True else () if running is False else running
    stubs = "\n".join(f'{name}() {{ echo {name} >>"{log}"; }}' for name in STUBBED)
    script = f"""
source {START}
{stubs}
HERE={tmp_path}
alive() {{ case " {' '.join(alive)} " in *" $1 "*) return 0;; esac; return 1; }}
fingerprint() {{ echo same; }}
start_slurm() {{  # what the controller would recover when it starts
  if [[ -e $DIR/state/job_state || -e $DIR/spool/n1/cred_state ]]; then echo start_slurm-with-old-jobs; else echo start_slurm; fi >>"{log}"
}}
main
"""
    env = dict(os.environ, MGPU_SLURM_DIR=str(state_dir), PATH=f"{bin_dir}:{os.environ['PATH']}")
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return log.read_text().split()


def test_a_fresh_start_forgets_the_earlier_daemons_jobs(tmp_path: Path) -> None:
    # CI's machine image was taken while a test session's jobs ran: its slurmctld recovered them, they held
    # both nodes, and the first test's job stayed pending for 60 s.
    steps = _start(tmp_path, running=False)
    assert steps == ["install_packages", "ensure_hosts", "stop.sh", "write_config", "link_etc", "start_munge",
                     "start_mariadb", "start_slurm", "wait_nodes", "summary"]
    state_dir = tmp_path / "slurm"
    assert list((state_dir / "state").iterdir()) == [] and list((state_dir / "spool").iterdir()) == []


def test_a_start_that_finds_the_cluster_running_keeps_its_jobs(tmp_path: Path) -> None:
    steps = _start(tmp_path, running=True)
    assert steps == ["install_packages", "ensure_hosts", "link_etc", "wait_nodes", "summary"]
    assert (tmp_path / "slurm" / "state" / "job_state").read_bytes() == b"617"
    assert (tmp_path / "slurm" / "spool" / "n1" / "cred_state").exists()


@pytest.mark.parametrize("alive", [("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd-n1"), ("slurmctld",)])
def test_a_start_that_finds_a_daemon_missing_restarts_and_keeps_the_jobs(tmp_path: Path,
                                                                         alive: tuple[str, ...]) -> None:
    # Another session's jobs were running: a daemon missing (one slurmd died) restarted the cluster and wiped them.
    # Only a start that finds none of the earlier daemons alive is a fresh one.
    steps = _start(tmp_path, alive)
    assert steps == ["install_packages", "ensure_hosts", "stop.sh", "write_config", "link_etc", "start_munge",
                     "start_mariadb", "start_slurm-with-old-jobs", "wait_nodes", "summary"]
    assert (tmp_path / "slurm" / "state" / "job_state").read_bytes() == b"617"


def test_a_slow_controller_is_waited_for_not_restarted(tmp_path: Path) -> None:
    # `scontrol ping` within 10 s or a fresh start: a controller busy with another session's jobs lost them.
    steps = _start(tmp_path, running=True, ping_fails=3)
    assert steps == ["install_packages", "ensure_hosts", "link_etc", "wait_nodes", "summary"]
    assert (tmp_path / "pings").read_text().count("x") == 4
    assert (tmp_path / "slurm" / "state" / "job_state").read_bytes() == b"617"


def test_the_daemons_inherit_no_descriptor_of_whoever_started_the_script(tmp_path: Path) -> None:
    # `flock /tmp/mgpu-e2e.lock bash tests/run.sh` holds its lock on fd 3: munged, mariadbd and slurmdbd started under
    # it held that lock for their lifetime, and every later e2e run waited for it (seen: 50 min).
    lock = tmp_path / "outer.lock"
    script = f'exec 3>{lock}; exec 4<{START}; source {START}; close_inherited; ls /proc/$$/fd; true'  # not exec'd: bash's own fds
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                            env={**os.environ, "MGPU_SLURM_DIR": str(tmp_path / "slurm")})
    assert result.returncode == 0, result.stderr
    assert sorted(int(fd) for fd in result.stdout.split() if int(fd) > 2 and int(fd) != 255) == [], result.stdout
