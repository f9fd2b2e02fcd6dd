"""A DataLoader worker that never reaches Python after its fork (mgpu.data.worker_start): found, killed, and the
workers forked again, the same batches coming out; given up with one line after FORK_ATTEMPTS.

The real cause, CPython's after-fork code waiting on a lock another thread held at the instant of the fork,
cannot be caused on demand: here a worker stops before torch's worker loop runs any of its code, its stop signals
blocked, as the real one does (the fake). Everything else is real: forked workers, torch's DataLoader."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from mgpu.data import worker_start
from mgpu.data.loader import ResumableLoader


class Noisy(Dataset):  # type: ignore[type-arg]
    """Twelve samples, each with a draw from the worker's generator (the per-sample seed makes it the same)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> tuple[int, float]:
        return index, float(torch.rand(()))


def _batches(workers: int = 2) -> list[Any]:
    # DataLoader's own timeout: a worker stuck for good fails the test in 60 s instead of hanging it.
    loader = ResumableLoader(Noisy(), 3, rank=0, world_size=1, seed=5, shuffle=True, num_workers=workers,
                             collate_fn=list, timeout=60)
    return list(loader)


def _stall_workers(monkeypatch: pytest.MonkeyPatch, flag: Path, pids: Path, once: bool) -> None:
    """Worker 1 of a fork that finds `flag` stops before its first line of Python (as the deadlocked one did:
    every signal of mgpu's blocked); `once`: only the first such worker (it claims the flag by removing it)."""
    from torch.utils.data._utils import worker

    real = worker._worker_loop

    def stalled(*args: Any, **kwargs: Any) -> Any:
        worker_id = args[10]  # _worker_loop(dataset_kind, dataset, index_queue, data_queue, done_event,
        #                      auto_collation, collate_fn, drop_last, base_seed, init_fn, worker_id, ...)
        if worker_id == 1 and flag.exists():
            try:
                if once:
                    flag.unlink()
                with pids.open("a") as out:
                    out.write(f"{os.getpid()}\n")
                while True:
                    time.sleep(60)
            except FileNotFoundError:  # another worker claimed it first
                pass
        return real(*args, **kwargs)

    monkeypatch.setattr(worker, "_worker_loop", stalled)
    monkeypatch.setattr(worker_start, "STARTED_WITHIN_S", 2.0)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:  # a zombie not yet reaped is gone too
        return stat.read().split(") ")[1].startswith("Z")


def test_a_worker_that_never_reaches_python_is_forked_again_and_the_batches_are_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    expected = _batches()
    flag, pids = tmp_path / "stall", tmp_path / "stalled.pids"
    flag.touch()
    _stall_workers(monkeypatch, flag, pids, once=True)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="mgpu.train"):
        assert _batches() == expected
    assert time.monotonic() - started < 45  # the bound (2 s here), not the loader's 60 s timeout
    stalled = [int(line) for line in pids.read_text().split()]
    assert len(stalled) == 1 and _gone(stalled[0])
    assert "had not reached Python" in caplog.text and "forking the workers again (2 of 3)" in caplog.text


def test_workers_that_never_start_are_one_error_after_the_last_attempt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flag, pids = tmp_path / "stall", tmp_path / "stalled.pids"
    flag.touch()
    _stall_workers(monkeypatch, flag, pids, once=False)
    with pytest.raises(RuntimeError, match=r"DataLoader workers did not start: 3 forks in a row"):
        _batches()
    stalled = [int(line) for line in pids.read_text().split()]
    assert len(stalled) == worker_start.FORK_ATTEMPTS and all(_gone(pid) for pid in stalled)


def test_a_persistent_loaders_second_epoch_forks_nothing_and_waits_for_nothing() -> None:
    # Its workers ran their init at the first epoch: no marks come at the second, and none is waited for.
    from mgpu.data.loader import make_loader, start

    loader = make_loader(Noisy(), [[0, 1, 2], [3, 4, 5]], num_workers=2, seed=5, epoch=0, rank=0,
                         requeue_signal="USR2", collate_fn=list, persistent_workers=True)
    first = list(start(loader, "USR2"))
    started = time.monotonic()
    second = list(start(loader, "USR2"))
    assert time.monotonic() - started < worker_start.STARTED_WITHIN_S / 3 and first == second


@pytest.mark.parametrize("version, implementation, affected", [
    ((3, 10, 0), "CPython", True), ((3, 10, 16), "CPython", True),  # 3.10: taken as affected (backport unconfirmed)
    ((3, 11, 0), "CPython", True), ((3, 11, 7), "CPython", True),
    ((3, 11, 8), "CPython", False), ((3, 11, 13), "CPython", False),  # the 3.11 backport of the fix
    ((3, 12, 0), "CPython", False), ((3, 13, 1), "CPython", False), ((3, 14, 0), "CPython", False),
    ((3, 11, 7), "PyPy", False),
])
def test_the_cpythons_with_the_after_fork_hang(version: tuple[int, int, int], implementation: str,
                                               affected: bool) -> None:
    assert worker_start.affected(version, implementation) is affected


@pytest.mark.parametrize("context, default, method", [
    (None, None, "fork"),  # nothing set: the platform's default (Linux, Python < 3.14), and it stays unset
    (None, "spawn", "spawn"),  # the loop's set_start_method (or a process started by spawn) decides
    ("forkserver", None, "forkserver"),  # the loader's own multiprocessing_context wins
    ("fork", "spawn", "fork"),
])
def test_a_loaders_start_method_is_read_without_fixing_the_default(
        monkeypatch: pytest.MonkeyPatch, context: str | None, default: str | None, method: str) -> None:
    import multiprocessing

    from mgpu.data.loader import make_loader

    monkeypatch.setattr(multiprocessing.context._default_context, "_actual_context",
                        None if default is None else multiprocessing.get_context(default))
    loader = make_loader(Noisy(), [[0, 1]], num_workers=2, seed=0, epoch=0, rank=0, requeue_signal="USR2",
                         collate_fn=list, **({} if context is None else {"multiprocessing_context": context}))
    assert worker_start.start_method(loader) == method
    assert worker_start.guarded(loader) is (worker_start.AFFECTED and method == "fork")
    assert multiprocessing.get_start_method(allow_none=True) == default  # still free to be set by the loop


SPAWNED = """
import sys
from mgpu.data import worker_start
from mgpu.data.loader import ResumableLoader
from tests.test_worker_start import Noisy

worker_start.STARTED_WITHIN_S = 0.001
worker_start.kill_workers = lambda iterator: sys.exit("a healthy spawned worker was killed")
loader = ResumableLoader(Noisy(), 3, rank=0, world_size=1, seed=5, shuffle=True, num_workers=2, collate_fn=list,
                         multiprocessing_context=sys.argv[1], timeout=120)
print(list(loader))
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_worker_that_starts_slowly_by_spawn_or_forkserver_is_never_killed(method: str) -> None:
    # A spawned worker imports torch and unpickles the dataset before its first line: seconds. It has no after-fork
    # hazard, so nothing waits for it: with a bound of 1 ms it still delivers every batch, and no worker is killed.
    # (In a process of its own: spawn's resource tracker outlives the loader.)
    import subprocess
    import sys

    from tests.conftest import ROOT, base_env

    result = subprocess.run([sys.executable, "-c", SPAWNED, method], cwd=ROOT, env=base_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == str(_batches())


def test_an_eval_loader_iterated_directly_is_guarded_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    # session.eval_loader hands out a DataLoader the loop iterates itself (`for x, y in evaluation`): its workers
    # start through the same guard as the training loader's.
    from mgpu.data.loader import eval_loader

    monkeypatch.setattr(worker_start, "AFFECTED", True)
    expected = list(eval_loader(Noisy(), 3, rank=0, world_size=1, seed=5, requeue_signal="USR2", num_workers=2,
                                collate_fn=list, timeout=60))
    flag, pids = tmp_path / "stall", tmp_path / "stalled.pids"
    flag.touch()
    _stall_workers(monkeypatch, flag, pids, once=True)
    with caplog.at_level(logging.WARNING, logger="mgpu.train"):
        batches = [batch for batch in eval_loader(Noisy(), 3, rank=0, world_size=1, seed=5, requeue_signal="USR2",
                                                  num_workers=2, collate_fn=list, timeout=60)]
    assert batches == expected and "forking the workers again (2 of 3)" in caplog.text
    assert "gh-112275" in caplog.text  # rank 0 says once what causes it and how to rule it out
