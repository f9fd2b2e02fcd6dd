"""mgpu.parallel.gloo_threads: the exit waits for gloo's worker threads to park, so that none of them takes the GIL
while the interpreter finalizes (which aborts the process)."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest

from mgpu.parallel import gloo_threads
from mgpu.parallel.gloo_threads import FALLBACK_S, FUTEX_SYSCALL, busy_workers, parked, settle
from tests.conftest import PYTHON, ROOT, base_env

X86_FUTEX = FUTEX_SYSCALL["x86_64"]


@pytest.mark.parametrize("line, expected", [
    # a worker between collectives: glibc's condition-variable wait (FUTEX_WAIT_BITSET|PRIVATE|CLOCK_REALTIME), no
    # timeout (the line of a real pt_gloo_runloop thread of torch 2.13)
    ("202 0x55c6962dd9a4 0x189 0x0 0x0 0x0 0xffffffff 0x7ffc1d7c1e50 0x7fa81b2a3f7b", True),
    ("202 0x55c6962dd9a4 0x89 0x0 0x0 0x0 0xffffffff 0x7ffc 0x7fa8", True),  # without FUTEX_CLOCK_REALTIME
    # waiting for the GIL: CPython's timed condition-variable wait (5 ms intervals)
    ("202 0x7fe8dc14e6c8 0x89 0x0 0x7fe8bb911ce0 0x0 0xffffffff 0x7ffc 0x7fa8", False),
    ("202 0x55c6962dd9a4 0x80 0x2 0x0 0x0 0x0 0x7ffc 0x7fa8", False),  # on a mutex (FUTEX_WAIT|PRIVATE)
    ("running", False),  # on a CPU
    ("-1 0x7ffc1d7c1e50 0x7fa80ab12501", False),  # preempted outside a system call
    ("232 0x6 0x7fa7fc213b80 0x40 0xa 0x0 0x0 0x7ffc 0x7fa8", False),  # epoll_wait
    ("98 0x55c6962dd9a4 0x189 0x0 0x0 0x0 0xffffffff 0x7ffc 0x7fa8", False),  # futex on aarch64, not on x86_64
    ("202 0x55c6962dd9a4", False),  # cut short
    ("", False),
])
def test_a_worker_is_parked_only_in_an_untimed_condition_variable_wait(line: str, expected: bool) -> None:
    assert parked(line, X86_FUTEX) is expected


def _thread(tasks: Path, tid: int, name: str, syscall: str | None) -> None:
    (tasks / str(tid)).mkdir()
    (tasks / str(tid) / "comm").write_text(name + "\n")
    if syscall is not None:
        (tasks / str(tid) / "syscall").write_text(syscall + "\n")


def test_the_busy_workers_are_the_gloo_workers_not_parked(tmp_path: Path) -> None:
    _thread(tmp_path, 100, "python", "running")  # the main thread: not a gloo worker
    _thread(tmp_path, 101, "pt_gloo_runloop", "202 0x1 0x189 0x0 0x0 0x0")
    _thread(tmp_path, 102, "pt_gloo_runloop", "202 0x2 0x89 0x0 0x7f0 0x0")  # waiting for the GIL
    _thread(tmp_path, 103, "gloo_tcp_loop", "232 0x6 0x7f 0x40 0xa 0x0")
    _thread(tmp_path, 104, "pt_gloo_runloop", None)  # ended between the listing and the read
    assert busy_workers(tmp_path, "x86_64") == [102]
    assert busy_workers(tmp_path, "sparc64") is None  # futex's number unknown there: cannot be told
    assert busy_workers(tmp_path / "absent", "x86_64") is None


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.mark.parametrize("looks, within_s, left, sleeps", [
    ([[]], 2.0, [], []),  # nothing busy: no wait at all
    ([[7], [7], []], 2.0, [], [0.001, 0.001]),  # parked after two polls
    ([[7]] * 10_000, 0.005, [7], [0.001] * 5),  # still in a collective at the bound: given up, said
    ([None], 2.0, [], [FALLBACK_S]),  # cannot be read: one fixed wait
])
def test_settle_waits_for_the_workers_to_park_within_its_bound(looks: list[list[int] | None], within_s: float,
                                                               left: list[int], sleeps: list[float]) -> None:
    clock, answers = FakeClock(), iter(looks)
    assert settle(within_s, 0.001, look=lambda: next(answers), sleep=clock.sleep, clock=lambda: clock.now) == left
    assert clock.sleeps == pytest.approx(sleeps)


def test_this_process_can_read_its_own_threads() -> None:
    assert busy_workers() == []  # no group here: nothing busy, and not None (what CI's Linux gives a process)


@pytest.mark.multiprocess
@pytest.mark.parametrize("settled", [True, False], ids=["settled", "without-settle"])
def test_a_rank_whose_gloo_worker_holds_a_tensor_at_exit_ends_normally(settled: bool) -> None:
    """tests/gloo_exit_probe.py: rank 0's worker finishes the collective while the main thread holds the GIL up to its
    exit, and needs the GIL to drop a tensor whose Python object was dropped first. Without the settle, every rank so
    left aborted in finalization (6 of 6 runs here); the second case shows the probe still makes that abort."""
    # Fresh interpreters, not the warm-start server's forks: the claim is about the interpreter's own finalization.
    port = str(random.SystemRandom().randint(20000, 32000))
    procs = [subprocess.Popen([PYTHON, "tests/gloo_exit_probe.py", *([] if settled else ["--without-settle"])],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=base_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank in range(2)]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    results = [(proc.returncode, out) for proc, out in zip(procs, outputs)]
    assert all("main thread done" in out for _, out in results), results
    if settled:
        assert [code for code, _ in results] == [0, 0], results
        assert not any("terminate called" in out for _, out in results), results
    else:
        assert -6 in [code for code, _ in results] and any("terminate called" in out for _, out in results), results


def test_the_exit_settles_unless_the_process_skips_finalization_and_says_what_it_gave_up_on(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[int] = []

    def settle() -> list[int]:
        calls.append(1)
        return [4242]

    monkeypatch.setattr(gloo_threads, "settle", settle)
    monkeypatch.setattr(gloo_threads, "_skipped", False)
    gloo_threads._settle_at_exit()
    assert calls == [1] and "1 gloo worker thread(s) still inside a collective" in capsys.readouterr().err
    gloo_threads.skip()  # mgpu.stop.process_exit.exit_process: os._exit follows, nothing finalizes
    gloo_threads._settle_at_exit()
    assert calls == [1] and capsys.readouterr().err == ""
