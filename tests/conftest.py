"""Shared fixtures. Every test runs under `no_leaks`: it fails a test that leaves behind changed
environment variables or signal handlers, an initialised default process group, or live child processes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests import warm_start

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
_SESSION_ENVIRON = dict(os.environ)  # as the session started: the warm-start server's environment comes from it


Rank = warm_start.WarmProcess | subprocess.Popen[str]  # a rank started by start_ranks or run_processes


def live_children(pid: int | None = None) -> set[int]:
    """Direct children of this process that are still running (zombies excluded)."""
    pid = os.getpid() if pid is None else pid
    children: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children.update(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    alive = set()
    for child in children:
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(child)
    return alive


# The dispositions a test may not leave changed: a process started afterwards inherits an ignored one (SIG_IGN
# survives fork and exec), so a leaked one silently changes what later tests' processes do with that signal.
# SIGALRM is pytest-timeout's: it installs a handler for each test and resets it when the test fails, before this
# guard's teardown (which then reported a failed test's own SIGALRM as leaked, and put back a finished test's handler).
GUARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT,
                   signal.SIGCHLD, signal.SIGPIPE, signal.SIGCONT)


def _dispositions() -> dict[int, object]:
    return {signum: signal.getsignal(signum) for signum in GUARDED_SIGNALS}


def _environ() -> dict[str, str]:
    # pytest itself sets PYTEST_CURRENT_TEST for each phase of a test.
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    env_before, dispositions_before = _environ(), _dispositions()
    children_before, ranks_before = live_children(), _warm_ranks()
    yield
    problems = []
    changed_signals = [signum for signum, handler in _dispositions().items() if handler != dispositions_before[signum]]
    for signum in changed_signals:
        signal.signal(signum, dispositions_before[signum])  # type: ignore[arg-type]
    if changed_signals:
        problems.append(f"signal handlers leaked: {[signal.Signals(s).name for s in changed_signals]}")
    env_after = _environ()
    if env_after != env_before:
        changed = sorted(k for k in set(env_after) | set(env_before) if env_after.get(k) != env_before.get(k))
        problems.append(f"environment variables leaked: {changed}")
        for key in set(env_after) - set(env_before):
            del os.environ[key]
        os.environ.update(env_before)
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            problems.append("a default process group was left initialised")
    server = warm_start.current()
    leaked = live_children() - children_before - ({server.proc.pid} if server else set())
    leaked |= _warm_ranks() - ranks_before
    for child in leaked:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if leaked:
        problems.append(f"child processes left running: {sorted(leaked)}")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


def _warm_ranks() -> set[int]:
    """The warm-start server's children still running (ranks it forked for this process's tests)."""
    server = warm_start.current()
    return live_children(server.proc.pid) if server and server.proc.poll() is None else set()


def ensure_resolvable(names: list[str]) -> None:
    """Make test node names resolve to loopback (as a real cluster's DNS would), or skip."""
    missing = []
    for name in names:
        try:
            socket.gethostbyname(name)
        except OSError:
            missing.append(name)
    if not missing:
        return
    if os.geteuid() != 0:
        pytest.skip(f"node names {missing} do not resolve and /etc/hosts needs root to add them")
    with open("/etc/hosts", "a") as hosts:
        hosts.write(f"127.0.0.1 {' '.join(missing)}  # mgpu tests\n")


def run_processes(commands: list[tuple[list[str], dict[str, str]]], timeout: float, cwd: Path = ROOT
                  ) -> list[subprocess.CompletedProcess[str]]:
    """Start every command at once, wait for all with one deadline, kill any left at the end."""
    procs = [popen_rank(cmd[1:], env, cwd) if cmd[0] == PYTHON else
             subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd, env in commands]
    return [subprocess.CompletedProcess(cmd, rc, out, None)
            for (cmd, _), (rc, out) in zip(commands, wait_ranks(procs, timeout))]


def base_env(environ: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The test process's environment (or `environ`) without any launcher variables, plus `extra`. SLURM_CONF
    stays: it names the cluster (tests/e2e binds each pytest process to its own), it does not describe a launch."""
    launcher_prefixes = ("SLURM_", "SUBMITIT_", "TORCHELASTIC_")
    launcher_names = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT"}
    env = {k: v for k, v in (os.environ if environ is None else environ).items()
           if (k == "SLURM_CONF" or not k.startswith(launcher_prefixes)) and k not in launcher_names}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def popen_rank(argv: list[str], env: dict[str, str], cwd: Path = ROOT, process_group: int | None = None
               ) -> Rank:
    """`python argv...` with exactly `env`, its output (stdout and stderr together) as text: forked by this pytest
    process's warm-start server (tests/warm_start.py: torch already imported) where the environment allows."""
    return warm_start.popen(PYTHON, argv, env, cwd, process_group, server_env=base_env(_SESSION_ENVIRON),
                            server_cwd=ROOT)


def _stacks(procs: list[Rank]) -> str:
    """SIGABRT to every rank still running (faulthandler prints every thread's stack), then each one's output's tail."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGABRT)
    parts = []
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=15)
        except (subprocess.TimeoutExpired, ValueError):
            continue
        parts.append(f"----- rank {rank} (rc {proc.returncode}), the end of its output:\n{(out or '')[-6000:]}")
    return "\n".join(parts)


def start_ranks(argv: list[str], world: int, nodes: int = 1, env: dict[str, str] | None = None) -> list[Rank]:
    """`world` ranks of `python argv...` in one process group, as slurmstepd runs a step's tasks: a signal to
    the group reaches every rank and every DataLoader worker they fork (RANK/WORLD_SIZE, no launcher agent).
    `nodes`: the ranks split over that many "nodes" of this host, named n1, n2, ... (MGPU_NODE_NAME). `env`: added
    to every rank's environment."""
    import random

    port, procs, group = str(random.SystemRandom().randint(20000, 32000)), [], 0
    per_node = world // nodes
    for rank in range(world):
        env_ = base_env(RANK=str(rank), LOCAL_RANK=str(rank % per_node), WORLD_SIZE=str(world),
                        LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                        PYTHONFAULTHANDLER="1", **({"MGPU_NODE_NAME": f"n{rank // per_node + 1}"} if nodes > 1 else {}),
                        **(env or {}))
        procs.append(popen_rank(argv, env_, ROOT, process_group=group))
        group = group or procs[0].pid
    return procs


def run_world(argv: list[str], world: int, timeout: float = 120, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess[str]:
    """`world` ranks of `python argv...` (start_ranks) to their end, as one result: every rank's output in rank
    order, and the one exit code other than 0 that ranks ended with (0 if none did; a stop ends rank 0 alone with 3),
    or -1 where ranks ended with different ones (each rank's code is then the output's last line). For the tests
    where the launcher is not the claim: torchrun's and mgpu.run.spawn's own handling is the launch matrix's
    (tests/test_launch_matrix.py) and tests/test_spawn.py's."""
    results = wait_ranks(start_ranks(argv, world, env=env), timeout)
    codes = [rc for rc, _ in results]
    failed = set(codes) - {0}
    out = "".join(out for _, out in results)
    if len(failed) > 1:
        out += f"\nrun_world: the ranks ended with different exit codes: {codes}\n"
    return subprocess.CompletedProcess([PYTHON, *argv], failed.pop() if len(failed) == 1 else -1 if failed else 0,
                                       out, None)


def wait_ranks(procs: list[Rank], timeout: float = 120) -> list[tuple[int, str]]:
    """(exit code, output) of every rank, one deadline each; any left at the end are killed. A rank still running
    at its deadline fails the test with the Python stacks of every rank still running (SIGABRT: faulthandler,
    which start_ranks enables), so that a rare hang in CI says where it was."""
    results = []
    try:
        for rank, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {rank} still running after {timeout:.0f} s\n" + _stacks(procs)) from None
            results.append((proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """`small_fs(kib, kind)`: a real filesystem of that size, for disk-full tests: `tmpfs` (written through the page
    cache), or `ext4` on a loop device (which takes O_DIRECT, as a disk does). Needs root: skipped without it,
    except in CI, where a test that cannot run must fail."""
    mounts: list[Path] = []

    def make(kib: int, kind: str = "tmpfs") -> Path:
        where = tmp_path / f"fs{len(mounts)}"
        where.mkdir()
        if kind == "ext4":
            image = tmp_path / f"fs{len(mounts)}.img"
            with open(image, "wb") as file:
                file.truncate(kib << 10)
            made = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], capture_output=True, text=True)
            command = ["mount", "-o", "loop", str(image), str(where)]
        else:
            made = subprocess.CompletedProcess([], 0, "", "")
            command = ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)]
        proc = made if made.returncode != 0 else subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            reason = f"cannot mount a small {kind} ({proc.stderr.strip() or 'not root'})"
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(reason, pytrace=False)
            pytest.skip(reason)
        mounts.append(where)
        return where

    yield make
    for where in reversed(mounts):
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(directory: Path, name: str = "ballast") -> Path:
    """Fill the filesystem of `directory` to the last byte with one file; returns it (delete to free)."""
    path = directory / name
    with open(path, "wb", buffering=0) as file:
        for size in (65536, 1):
            try:
                while file.write(b"\0" * size):
                    pass
            except OSError:
                pass
    return path
