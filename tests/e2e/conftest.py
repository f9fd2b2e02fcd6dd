"""Fixtures for end-to-end tests on a real local Slurm cluster (slurm/cluster/start.sh).

`slurm_cluster` (session, autouse): the cluster this process runs on, started once (a no-op when it already runs)
and left running afterwards -- unless MGPU_SLURM_STOP_AFTER=1, then stop.sh runs at session end. When the cluster
cannot be started the tests SKIP with the reason, or FAIL when CI=true. Three clusters run side by side
(slurm/cluster/clusters.sh: a with nodes n1, n2; b with n3, n4; c with n5, n6): under pytest-xdist worker gwN runs
on the N-th (`pytest -n 3 --dist loadfile tests/e2e`: three streams at once, none touching another's cluster); one
process runs on MGPU_SLURM_CLUSTER (default a). Before any test runs, this process's SLURM_CONF (and MGPU_SLURM_CLUSTER,
which policy.sh reads) are its cluster's, so every subprocess a test starts -- sbatch, srun, scontrol, submitit,
jobs/submit.py -- reaches that cluster. A test asks `slurm_cluster.nodes` for the node names, never spells them.

`references` (session): the uninterrupted runs of job_helpers.SLOW on 2 ranks and SLOW4 on 4 (torchrun on
this machine, started in the background at first use), `references[world].state()`; test_jobs, test_hangs and
test_memory_snapshots compare with the same runs instead of training them again, and under pytest-xdist the
workers share them (the first to ask trains each, in the session's base temp directory).

`slurm_policy` (function): `slurm_policy(grace=10, user_signal=True)` switches the preemption
policy via policy.sh; the default -- GraceTime=0 on partition main, preempt_send_user_signal ON --
is restored after the test.

Every test under tests/e2e is marked `slurm`.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import pytest

if TYPE_CHECKING:
    from job_helpers import Reference

E2E = Path(__file__).resolve().parent
CLUSTER = E2E.parent.parent / "slurm" / "cluster"
START_TIMEOUT_S = 900  # the first start installs ~28 Debian packages
DEFAULT_GRACE = 0
DEFAULT_USER_SIGNAL = True
CLUSTERS = ("a", "b", "c")  # slurm/cluster/clusters.sh; xdist worker gwN runs on CLUSTERS[N]
BOUND = ("SLURM_CONF", "MGPU_SLURM_CLUSTER")  # what binds this process's subprocesses to its cluster


@dataclasses.dataclass(frozen=True)
class SlurmCluster:
    name: str  # a or b (slurm/cluster/clusters.sh)
    state_dir: Path
    conf: Path
    env: dict[str, str]  # os.environ at session start + SLURM_CONF and MGPU_SLURM_CLUSTER of this cluster
    nodes: tuple[str, ...]  # its nodes, as Slurm names them (partition main = high = all of them)
    nodelist: str  # the same in Slurm's compact form, e.g. n[1-2]

    def run(self, *cmd: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (bounded); on failure raise with its output."""
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} -> rc {proc.returncode}: {proc.stdout}{proc.stderr}".strip())
        return proc

    def policy(self, grace: int, user_signal: bool) -> str:
        flag = "yes" if user_signal else "no"
        return self.run("bash", str(CLUSTER / "policy.sh"), "--grace", str(grace), "--user-signal", flag,
                        timeout=90).stdout.strip()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees the whole session's items: mark only those collected from tests/e2e.
    for item in items:
        if E2E in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slurm)
    # Fast unit tests first, then multi-process ones, then the real cluster (a stable sort keeps each
    # group in file order): a broken unit shows up in seconds, not after the e2e minutes.
    def rank(item: pytest.Item) -> int:
        return 2 if item.get_closest_marker("slurm") else 1 if item.get_closest_marker("multiprocess") else 0

    items.sort(key=rank)


def _unavailable(reason: str, details: str = "") -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"local Slurm cluster unavailable: {reason}\n{details}".rstrip(), pytrace=False)
    pytest.skip(f"local Slurm cluster unavailable: {reason}")


def cluster_of_this_process() -> str:
    """Under pytest-xdist, worker gwN's is the N-th cluster (one stream per cluster); else MGPU_SLURM_CLUSTER, or a."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return os.environ.get("MGPU_SLURM_CLUSTER") or CLUSTERS[0]
    index = int(worker.removeprefix("gw"))
    if index >= len(CLUSTERS):
        pytest.fail(f"tests/e2e: pytest-xdist worker {worker} has no Slurm cluster of its own (there are "
                    f"{len(CLUSTERS)}: run tests/e2e with -n {len(CLUSTERS)} at most)", pytrace=False)
    return CLUSTERS[index]


def _run_script(name: str, timeout: float, env: dict[str, str]) -> tuple[int, str, str]:
    # Output goes to files, not pipes: a daemon that kept an inherited pipe open would hang us.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            rc = subprocess.run(["bash", str(CLUSTER / name)], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=err, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = -1
            err.write(f"\n{name} timed out after {timeout:.0f}s")
        out.seek(0)
        err.seek(0)
        return rc, out.read(), err.read()


@pytest.fixture(scope="session", autouse=True)
def slurm_cluster() -> Iterator[SlurmCluster]:
    name = cluster_of_this_process()
    if os.geteuid() != 0:
        _unavailable("not root (start.sh needs root)")
    env = dict(os.environ, MGPU_SLURM_CLUSTER=name)
    rc, out, err = _run_script("start.sh", START_TIMEOUT_S, env)
    if rc != 0:
        lines = [line for line in err.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"start.sh exited {rc}"
        _unavailable(f"cluster {name}: {reason}", "\n".join((out + err).splitlines()[-60:]))
    # start.sh's last line names the config: `export SLURM_CONF=<state dir>/etc/slurm.conf`
    conf = Path(out.strip().splitlines()[-1].removeprefix("export SLURM_CONF="))
    env["SLURM_CONF"] = str(conf)
    nodelist = subprocess.run(["sinfo", "-h", "-p", "main", "-o", "%N"], env=env, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    nodes = subprocess.run(["scontrol", "show", "hostnames", nodelist], env=env, capture_output=True, text=True,
                           timeout=30).stdout.split()
    cluster = SlurmCluster(name=name, state_dir=conf.parent.parent, conf=conf, env=env, nodes=tuple(nodes),
                           nodelist=nodelist)
    try:
        with pytest.MonkeyPatch.context() as patch:  # os.environ as it was once the session ends
            for key in BOUND:
                patch.setenv(key, env[key])
            yield cluster
    finally:
        if os.environ.get("MGPU_SLURM_STOP_AFTER") == "1":
            _run_script("stop.sh", 120, env)


@pytest.fixture
def slurm_policy(slurm_cluster: SlurmCluster) -> Iterator[Callable[..., str]]:
    changed = False

    def set_policy(grace: int = DEFAULT_GRACE, user_signal: bool = DEFAULT_USER_SIGNAL) -> str:
        nonlocal changed
        changed = True
        return slurm_cluster.policy(grace, user_signal)

    yield set_policy
    if changed:
        slurm_cluster.policy(DEFAULT_GRACE, DEFAULT_USER_SIGNAL)


@pytest.fixture(scope="session")
def references(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[dict[int | str, Reference]]:
    """Uninterrupted runs: of SLOW on 2 and 4 ranks, and of its stream on 2 ranks ("stream"). Under pytest-xdist in
    the session's base temp directory, which every worker shares: the first to ask trains them, and waits for them at
    its end (the other worker may still need them)."""
    from job_helpers import SLOW, SLOW4, Reference, slow_stream

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    base = (tmp_path_factory.getbasetemp().parent if workers > 1 else tmp_path_factory.getbasetemp()) / "reference"
    refs: dict[int | str, Reference] = {2: Reference(base / "world2", 2, SLOW)}
    refs[4] = Reference(base / "world4", 4, SLOW4)
    refs["stream"] = Reference(base / "stream2", 2, slow_stream(base / "stream-data"))
    try:
        yield refs
    finally:
        for ref in refs.values():
            ref.close(wait_s=180 if workers > 1 else 0)
