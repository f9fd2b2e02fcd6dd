"""mgpu.stop.store_calls: the watchdog's store calls are counted, refused once the interpreter exits, and none is
still running when it finalizes. Against fakes in one process; one real process (tests/store_exit_probe.py) whose
call would otherwise return during finalization and abort it."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import pytest

from mgpu.stop import store_calls
from tests.conftest import PYTHON, ROOT, base_env


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's module state as at its start (refuse_and_wait refuses for good)."""
    monkeypatch.setattr(store_calls, "_refusing", False)
    monkeypatch.setattr(store_calls, "_in_flight", 0)
    monkeypatch.setattr(store_calls, "_connections", {})


def test_a_call_is_counted_while_it_runs_and_refused_once_the_exit_began(fresh: None) -> None:
    inside, release = threading.Event(), threading.Event()

    def slow() -> str:
        inside.set()
        release.wait(10)
        return "done"

    store = store_calls.CountedStore(type("Fake", (), {"get": staticmethod(slow), "timeout": 5})())
    assert store.timeout == 5  # an attribute passes through
    results: list[str] = []
    worker = threading.Thread(target=lambda: results.append(store.get()))
    worker.start()
    assert inside.wait(10) and store_calls.in_flight() == 1
    threading.Timer(0.2, release.set).start()
    started = time.monotonic()
    assert store_calls.refuse_and_wait(timeout=10)  # waits for the call in flight
    assert time.monotonic() - started >= 0.15 and results == ["done"] and store_calls.in_flight() == 0
    worker.join()
    with pytest.raises(store_calls.StoreExiting):
        store.get()


def test_the_exit_gives_up_after_its_wait(fresh: None) -> None:
    release = threading.Event()
    worker = threading.Thread(target=store_calls.call, args=(release.wait, 10))
    worker.start()
    while not store_calls.in_flight():
        time.sleep(0.01)
    assert not store_calls.refuse_and_wait(timeout=0.1)
    release.set()
    worker.join()


@pytest.mark.multiprocess
def test_a_call_that_returns_while_the_interpreter_finalizes_does_not_abort_it() -> None:
    env = base_env()
    server = subprocess.Popen([PYTHON, "-c", "import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, "
                               "is_master=True, wait_for_workers=False); print(s.port, flush=True); time.sleep(120)"],
                              env=env, stdout=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()  # type: ignore[union-attr]
        probe = subprocess.run([PYTHON, "tests/store_exit_probe.py", port, str(server.pid)], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=120)
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()
    assert probe.returncode == 0 and "main thread done" in probe.stdout, probe.stderr[-3000:]
    assert "terminate called" not in probe.stderr
