"""slurm/cluster/start.sh: a fresh start forgets the jobs of the daemons before it; a start that finds the
cluster running keeps them; cluster b (MGPU_SLURM_CLUSTER=b) beside a: its own state dir, nodes, ports and
ClusterName, a's shared daemons, job ids that never meet a's (the /dev/shm names and rendezvous ports they give).

start.sh runs for real (sourced, then its `main`), with every step that installs or starts a daemon replaced
by a stub that logs its name: what is tested is the order of the steps and what they leave in the state dir.
The configs are written by start.sh's own write_config into a temporary state dir.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from tests.conftest import ROOT

START = ROOT / "slurm" / "cluster" / "start.sh"
STUBBED = ("install_packages", "ensure_shared", "ensure_hosts", "write_config", "link_etc", "start_munge",
           "start_mariadb", "realign_job_ids", "wait_nodes", "summary")

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


ALL = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd-n1", "slurmd-n2")
OWN = {"b": ("slurmctld", "slurmd-n3", "slurmd-n4"),  # b's and c's own: munged, mariadbd and slurmdbd are a's
       "c": ("slurmctld", "slurmd-n5", "slurmd-n6")}


def _start(tmp_path: Path, running: bool | tuple[str, ...], ping_fails: int = 0, cluster: str = "a",
           config: Callable[[Path], None] | None = None) -> list[str]:
    """start.sh's steps; `running`: the earlier start's daemons alive (all, none, or these); `ping_fails`: how many
    times the controller does not answer before it does; `config`: None, the running cluster's config is what this
    start.sh writes (same_config stubbed), else it writes that config into the state dir (start.sh's own check)."""
    # Without its guard, sourcing start.sh would start a real cluster in tmp_path and point /etc/slurm at it.
    assert '[[ ${BASH_SOURCE[0]} == "$0" ]] || return 0' in START.read_text().splitlines()
    state_dir, log = tmp_path / ("slurm" if cluster == "a" else f"slurm-{cluster}"), tmp_path / "steps.log"
    _earlier_sessions_state(state_dir)
    if config is not None:
        config(state_dir)
    stop = tmp_path / "stop.sh"
    stop.write_text(f"#!/bin/sh\necho stop.sh >>{log}\n")
    stop.chmod(0o755)
    bin_dir = tmp_path / "bin"  # `timeout 10 scontrol ping` runs a program: the controller answers, at last
    bin_dir.mkdir()
    pings = tmp_path / "pings"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho x >> {pings}\n[ "$(wc -l < {pings})" -gt {ping_fails} ]\n')
    (bin_dir / "scontrol").chmod(0o755)
    alive = (ALL if cluster == "a" else OWN[cluster]) if running is True else () if running is False else running
    stubs = "\n".join(f'{name}() {{ echo {name} >>"{log}"; }}' for name in STUBBED)
    script = f"""
source {START}
{stubs}
HERE={tmp_path}
alive() {{ case " {' '.join(alive)} " in *" $1 "*) return 0;; esac; return 1; }}
{"same_config() { return 0; }" if config is None else ""}
start_slurm() {{  # what the controller would recover when it starts
  if [[ -e $DIR/state/job_state || -e $DIR/spool/n1/cred_state ]]; then echo start_slurm-with-old-jobs; else echo start_slurm; fi >>"{log}"
}}
main
"""
    env = dict(os.environ, MGPU_SLURM_DIR=str(tmp_path / "slurm"), MGPU_SLURM_CLUSTER=cluster,
               PATH=f"{bin_dir}:{os.environ['PATH']}")
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


@pytest.mark.parametrize("cluster", ["b", "c"])
def test_clusters_b_and_c_start_beside_a_with_a_shared_daemons_and_keep_their_jobs_when_running(
        tmp_path: Path, cluster: str) -> None:
    steps = _start(tmp_path, running=False, cluster=cluster)
    # a's munged, mariadbd and slurmdbd (ensure_shared starts cluster a if one is missing); no /etc/slurm link
    assert steps == ["install_packages", "ensure_shared", "ensure_hosts", "stop.sh", "write_config", "start_slurm",
                     "wait_nodes", "summary"]
    assert list((tmp_path / f"slurm-{cluster}" / "state").iterdir()) == []
    (tmp_path / "steps.log").unlink()
    steps = _start(tmp_path / "again", running=True, cluster=cluster)
    assert steps == ["install_packages", "ensure_shared", "ensure_hosts", "realign_job_ids", "wait_nodes", "summary"]
    assert (tmp_path / "again" / f"slurm-{cluster}" / "state" / "job_state").read_bytes() == b"617"


def _config(tmp_path: Path, cluster: str) -> dict[str, str]:
    """start.sh's write_config for `cluster`, state under tmp_path: each generated file's text by name."""
    script = f"source {START}; mkdir -p $DIR/etc; write_config; echo $DIR"
    env = dict(os.environ, MGPU_SLURM_DIR=str(tmp_path / "slurm"), MGPU_SLURM_CLUSTER=cluster)
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    etc = Path(result.stdout.split()[-1]) / "etc"
    return {path.name: path.read_text() for path in etc.iterdir()}


def _edit(name: str, old: str, new: str) -> Callable[[Path], None]:
    def edit(etc: Path) -> None:
        text = (etc / name).read_text()
        assert old in text, (name, old)
        (etc / name).write_text(text.replace(old, new))
    return edit


# What another version of start.sh (another branch's, the one before) or a running cluster changes without changing
# what the daemons run with: kept. Anything else: a restart.
SAME = {
    "unchanged": [],
    "other comments": [_edit("slurm.conf", "# Generated by slurm/cluster/start.sh (cluster ", "# Generated by ("),
                       _edit("slurm.conf", "# sacct must work", "#  sacct must work"),
                       _edit("gres.conf", "# A count-only", "\n# count-only")],
    "ids moved on": [_edit("slurm.conf", "FirstJobId=1\n", "FirstJobId=1002236\n")],
    "policy.sh's": [_edit("slurm.conf", "SlurmctldParameters=preempt_send_user_signal", "#SlurmctldParameters="),
                    _edit("slurm.conf", "REQUEUE GraceTime=0 State", "REQUEUE GraceTime=10 State")],
}
CHANGED = {
    "the nodes' ports": [_edit("slurm.conf", " Port=68", " Port=69")],
    "a setting more": [_edit("slurm.conf", "KillWait=5\n", "KillWait=5\nMessageTimeout=60\n")],
    "another timeout": [_edit("slurm.conf", "KillWait=5", "KillWait=30")],
    "high's grace": [_edit("slurm.conf", "PreemptMode=OFF State", "PreemptMode=OFF GraceTime=5 State")],
    "gres": [_edit("gres.conf", "Name=gpu", "Name=gpu Type=x")],
}


def _written(cluster: str, edits: list[Callable[[Path], None]]) -> Callable[[Path], None]:
    """The config this start.sh writes for `cluster` into a state dir, then `edits` made to it."""
    def write(state_dir: Path) -> None:
        _config(state_dir.parent, cluster)
        for edit in edits:
            edit(state_dir / "etc")
    return write


@pytest.mark.parametrize("cluster", ["a", "b", "c"])
@pytest.mark.parametrize("change", [*SAME, *CHANGED])
def test_a_running_cluster_is_kept_while_its_config_says_the_same(tmp_path: Path, cluster: str, change: str) -> None:
    # start.sh kept a running cluster only when a hash of its own text was the one that started it: every developer's
    # branch with another start.sh restarted the shared cluster a under everyone's jobs (and the next one back).
    steps = _start(tmp_path, running=True, cluster=cluster, config=_written(cluster, {**SAME, **CHANGED}[change]))
    kept = ["install_packages", *(["ensure_hosts", "link_etc"] if cluster == "a" else
                                  ["ensure_shared", "ensure_hosts", "realign_job_ids"]), "wait_nodes", "summary"]
    if change in SAME:
        assert steps == kept
    else:
        assert "stop.sh" in steps and "start_slurm-with-old-jobs" in steps, steps


def test_a_missing_config_file_is_not_the_same_config(tmp_path: Path) -> None:
    def without_slurmdbd_conf(state_dir: Path) -> None:
        _written("a", [])(state_dir)
        (state_dir / "etc" / "slurmdbd.conf").unlink()
    steps = _start(tmp_path, running=True, config=without_slurmdbd_conf)
    assert "stop.sh" in steps and "start_slurm-with-old-jobs" in steps, steps


def test_the_three_clusters_configs_share_no_node_port_or_state(tmp_path: Path) -> None:
    a, b, c = (_config(tmp_path, name) for name in "abc")
    assert sorted(a) == ["gres.conf", "slurm.conf", "slurmdbd.conf"] and sorted(b) == sorted(c) == ["gres.conf",
                                                                                                     "slurm.conf"]

    def settings(text: str, key: str) -> list[str]:
        return [line.split(None, 1)[0].split("=", 1)[1] if key != "NodeName" else line
                for line in text.splitlines() if line.startswith(f"{key}=")]

    confs = {"a": a["slurm.conf"], "b": b["slurm.conf"], "c": c["slurm.conf"]}
    assert {k: settings(v, "ClusterName") for k, v in confs.items()} == {"a": ["mgpu"], "b": ["mgpub"], "c": ["mgpuc"]}
    assert {k: settings(v, "SlurmctldPort") for k, v in confs.items()} == {"a": ["6817"], "b": ["6827"], "c": ["6837"]}
    line = "NodeName={} NodeAddr=127.0.0.1 Port={} CPUs=4 Gres=gpu:2 State=UNKNOWN"
    assert settings(confs["a"], "NodeName") == [line.format("n1", 6831), line.format("n2", 6832)]
    assert settings(confs["b"], "NodeName") == [line.format("n3", 6841), line.format("n4", 6842)]
    assert settings(confs["c"], "NodeName") == [line.format("n5", 6851), line.format("n6", 6852)]
    for conf, nodes in ((a, "n[1-2]"), (b, "n[3-4]"), (c, "n[5-6]")):
        partitions = [line.split()[:2] for line in conf["slurm.conf"].splitlines() if line.startswith("PartitionName=")]
        assert partitions == [["PartitionName=main", f"Nodes={nodes}"], ["PartitionName=high", f"Nodes={nodes}"]]
        assert f"NodeName={nodes} Name=gpu " in conf["gres.conf"]
    # each its own state, logs and pids; one slurmdbd (a's) for all
    for name, suffix in (("a", ""), ("b", "-b"), ("c", "-c")):
        assert str(tmp_path / f"slurm{suffix}" / "state") in confs[name]
        assert settings(confs[name], "AccountingStoragePort") == ["6819"]
    assert "DbdPort=6819" in a["slurmdbd.conf"]


def _aligned(cluster: str, own: int, a_next: int) -> int:
    script = f"source {START}; aligned_job_id {own} {a_next}"
    result = subprocess.run(["bash", "-c", script], env=dict(os.environ, MGPU_SLURM_CLUSTER=cluster),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


@pytest.mark.parametrize("cluster, own, a_next, first", [
    ("b", 1, 236, 1_000_236),            # a fresh cluster b: from 1000000 up to a's next id + 4000 (mod 12000)
    ("b", 1_000_236, 236, 1_000_236),    # already aligned: unchanged
    ("b", 1_000_250, 250, 1_000_250),    # both ran 14 jobs since: still aligned
    ("b", 1_000_237, 236, 1_012_236),    # b one ahead: the next aligned id, never one b has handed out
    ("b", 1_002_236, 236, 1_012_236),    # aligned as before (+ 6000, for two clusters): the next + 4000
    ("b", 1, 9_000, 1_009_000),          # a past 8000: its id + 4000 wraps (13000 -> 1000)
    ("c", 1, 236, 2_000_236),            # a fresh cluster c: from 2000000 up to a's next id + 8000 (mod 12000)
    ("c", 2_000_250, 250, 2_000_250),
    ("c", 2_000_237, 236, 2_012_236),
    ("c", 1, 5_000, 2_005_000),          # a past 4000: its id + 8000 wraps
])
def test_the_job_ids_of_clusters_b_and_c_never_meet_as(cluster: str, own: int, a_next: int, first: int) -> None:
    # All clusters' jobs run on this host: a job's /dev/shm snapshots are named by its id, and its rendezvous port is
    # derived from it (20000 + id % 12000). b's and c's ids are never a's nor each other's, and their ports stay a
    # third of the span from a's and from each other's.
    from mgpu.cluster.environment import MASTER_PORT_SPAN, derive_master_port

    index = "abc".index(cluster)
    got = _aligned(cluster, own, a_next)
    assert got == first
    assert index * 1_000_000 <= got < (index + 1) * 1_000_000
    assert got >= own and got - max(own, index * 1_000_000) < MASTER_PORT_SPAN
    for step in (0, 99):  # both clusters 99 jobs on: their ports still a third of the span apart
        gap = (derive_master_port(str(got + step)) - derive_master_port(str(a_next + step))) % MASTER_PORT_SPAN
        assert gap == index * MASTER_PORT_SPAN // 3
