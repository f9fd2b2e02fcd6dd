"""Fixtures for end-to-end tests on a real local Slurm cluster (slurm/cluster/start.sh).

`slurm_cluster` (session): starts the cluster once (a no-op when it already runs) and leaves it
running afterwards -- unless MGPU_SLURM_STOP_AFTER=1, then stop.sh runs at session end. When the
cluster cannot be started the tests SKIP with the reason, or FAIL when CI=true.

`references` (session): the uninterrupted runs of job_helpers.SLOW on 2 ranks and SLOW4 on 4 (torchrun on
this machine, started in the background at first use), `references[world].state()`; test_jobs and test_hangs
compare with the same 2-rank run instead of training it twice.

`slurm_policy` (function): `slurm_policy(grace=10, user_signal=True)` switches the preemption
policy via policy.sh; the default -- GraceTime=0 on partition main, preempt_send_user_signal ON --
is restored after the test.

Nothing is exported into os.environ: /etc/slurm/slurm.conf points at the cluster's config, so
plain sbatch/srun/sacct (and submitit) work as they are; `slurm_cluster.env` adds SLURM_CONF anyway.
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


@dataclasses.dataclass(frozen=True)
class SlurmCluster:
    state_dir: Path
    conf: Path
    env: dict[str, str]  # os.environ at session start + SLURM_CONF

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


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    if os.geteuid() != 0:
        _unavailable("not root (start.sh needs root)")
    state_dir = Path(os.environ.get("MGPU_SLURM_DIR", "/var/tmp/mgpu-slurm"))
    env = dict(os.environ, MGPU_SLURM_DIR=str(state_dir))
    rc, out, err = _run_script("start.sh", START_TIMEOUT_S, env)
    if rc != 0:
        lines = [line for line in err.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"start.sh exited {rc}"
        _unavailable(reason, "\n".join((out + err).splitlines()[-60:]))
    conf = state_dir / "etc" / "slurm.conf"
    cluster = SlurmCluster(state_dir=state_dir, conf=conf, env=dict(env, SLURM_CONF=str(conf)))
    yield cluster
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
    """Uninterrupted runs: of SLOW on 2 and 4 ranks, and of its stream on 2 ranks ("stream")."""
    from job_helpers import SLOW, SLOW4, Reference, slow_stream

    base = tmp_path_factory.mktemp("reference")
    refs: dict[int | str, Reference] = {2: Reference(base / "world2", 2, SLOW)}
    refs[4] = Reference(base / "world4", 4, SLOW4)
    refs["stream"] = Reference(base / "stream2", 2, slow_stream(base / "stream-data"), port_offset=10)
    try:
        yield refs
    finally:
        for ref in refs.values():
            ref.close()
