"""A long resume, save or rendezvous reports its progress in the rank's log (mgpu.stop.phase_progress): every
PROGRESS_EVERY_S in one such phase, how long, against the allowance, and the bytes read and written meanwhile;
nothing for a step's phases, nothing before it is due. Pure: a clock and the io counters given."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from mgpu.stop.phase_progress import LongPhases, process_io


def test_a_long_phase_is_reported_every_interval_with_its_bytes() -> None:
    io = [(0, 0)]
    phases = LongPhases(3, every_s=30.0, counters=lambda: io[0])
    assert phases.poll("resume", 7, since=100.0, now=100.5, allowance_s=600) is None  # begins: the mark
    io[0] = (2_500_000_000, 1_000)
    assert phases.poll("resume", 7, since=100.0, now=129.0, allowance_s=600) is None  # not due yet
    line = phases.poll("resume", 7, since=100.0, now=131.0, allowance_s=600)
    assert line == ("rank 3: in the resume of step 7 for 31 s (the watchdog allows 600 s); this process read 2.50 GB "
                    "and wrote 0.00 GB meanwhile")
    assert phases.poll("resume", 7, since=100.0, now=140.0, allowance_s=600) is None  # the next in 30 s
    assert phases.poll("resume", 7, since=100.0, now=161.5, allowance_s=600) is not None
    # A step's phase is not long; a new save starts its own count.
    assert phases.poll("backward", 8, since=170.0, now=300.0, allowance_s=5) is None
    assert phases.poll("write", 8, since=310.0, now=311.0, allowance_s=120) is None
    io[0] = (2_500_000_000, 4_001_000)
    assert phases.poll("write", 8, since=310.0, now=345.0, allowance_s=120).endswith(  # type: ignore[union-attr]
        "read 0.00 GB and wrote 0.00 GB meanwhile")


def test_without_counters_the_line_has_no_bytes() -> None:
    phases = LongPhases(0, every_s=1.0, counters=lambda: None)
    phases.poll("start", 0, since=0.0, now=0.0, allowance_s=600)
    assert phases.poll("start", 0, since=0.0, now=2.0, allowance_s=600) == (
        "rank 0: in the rendezvous and setup before the first step of step 0 for 2 s (the watchdog allows 600 s)")


def test_the_process_counters_grow_with_a_write(tmp_path: Path) -> None:
    before = process_io()
    assert before is not None  # Linux
    (tmp_path / "f").write_bytes(b"x" * 1_000_000)
    after = process_io()
    assert after is not None and after[1] - before[1] >= 1_000_000


def test_the_watchdog_logs_a_long_phase(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    from mgpu.stop.watchdog import Watchdog

    monkeypatch.setattr("mgpu.stop.watchdog.WRITE_EVERY_S", 0.1)  # the publisher's poll
    dog = Watchdog(0, 1, tmp_path, step_multiple=5, floor_s=60, first_step_s=60, checkpoint_s=60,
                   on_hang=lambda *a: None)
    dog._long_phases = LongPhases(0, every_s=0.2)
    with caplog.at_level(logging.INFO, logger="mgpu.train"):
        dog.start()
        try:
            dog.beat("resume")
            time.sleep(1.0)
        finally:
            dog.stop()
    assert any("rank 0: in the resume of step 0 for" in r.getMessage() for r in caplog.records), caplog.text


def test_status_shows_the_ranks_still_in_a_long_phase(tmp_path: Path) -> None:
    """`status` of a live run: the ranks whose log's last line is a long phase's progress (written lately)."""
    import json
    import os

    from mgpu.record.runview import describe

    now = time.time()
    events = [{"time": now - 200, "event": "started", "job_id": "local-1", "restart": 0, "launcher": "single"},
              {"time": now - 20, "event": "first_step", "job_id": "local-1", "restart": 0, "step": 1}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    logs = tmp_path / "logs"
    logs.mkdir()
    said = ("rank 1: in the checkpoint's write of step 700 for 61 s (the watchdog allows 900 s); this process read "
            "0.00 GB and wrote 41.20 GB meanwhile")
    (logs / "rank0.log").write_text("12:00:00 [rank 0] INFO step 700/900 loss 1.0\n")  # in a step: not shown
    (logs / "rank1.log").write_text(f"12:00:00 [rank 1] INFO step 700/900 loss 1.0\n12:01:01 [rank 1] INFO {said}\n")
    (logs / "rank2.log").write_text(f"12:01:01 [rank 2] INFO {said.replace('rank 1', 'rank 2')}\n")
    os.utime(logs / "rank2.log", (now - 600, now - 600))  # written long ago: the run has moved on (or died)
    lines = describe(tmp_path, now=now)
    assert [line for line in lines if line.startswith("long phase")] == [f"long phase  {said}"], lines


MAPPED_READER = """
import json, mmap, os, sys, threading, time
from mgpu.stop.phase_progress import thread_progress
tid, samples, done = threading.get_native_id(), [], threading.Event()

def rchar():
    with open(f"/proc/self/task/{tid}/io") as file:
        return next(int(line.split()[1]) for line in file if line.startswith("rchar:"))

def sample():
    while not done.wait(0.1):
        samples.append((time.monotonic(), thread_progress(tid), rchar()))

sys.stdin.readline()  # the parent has put this process in the throttled cgroup
with open(sys.argv[1], "rb") as file:
    mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
threading.Thread(target=sample, daemon=True).start()
started = time.monotonic()
total = sum(mapping[i] for i in range(0, len(mapping), mmap.PAGESIZE))  # a page fault per page, no read()
done.set()
print(json.dumps({"seconds": time.monotonic() - started, "samples": samples}))
"""


@pytest.mark.multiprocess
def test_a_mapped_reads_page_faults_are_its_progress(tmp_path: Path) -> None:
    # Issue 46: torch.load(mmap=True) and the copies out of it into the model call no read(): a big single-file
    # load from a slow filesystem showed no progress at all. Here a real slow read: the kernel throttles this
    # child's reads to 4 MB/s (tests/throttle.py), and it faults an 8 MB file in page by page through a mapping.
    import json
    import os
    import subprocess

    from tests.conftest import PYTHON, ROOT, base_env
    from tests.throttle import evict, throttled_reads

    data = tmp_path / "checkpoint.bin"
    data.write_bytes(os.urandom(8 << 20))
    evict(data)
    with throttled_reads(tmp_path, 4 << 20) as procs:
        child = subprocess.Popen([PYTHON, "-c", MAPPED_READER, str(data)], cwd=ROOT, env=base_env(),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.write_text(f"{child.pid}\n")
        out, _ = child.communicate("go\n", timeout=120)
    assert child.returncode == 0, out
    result = json.loads(out.splitlines()[-1])
    samples = result["samples"]
    assert result["seconds"] > 1.5, result["seconds"]  # throttled: ~2 s, not milliseconds
    assert samples[-1][2] - samples[0][2] < 1 << 16  # no read() to speak of: rchar alone saw nothing
    grew = [later[0] for earlier, later in zip(samples, samples[1:]) if later[1] > earlier[1]]
    gaps = [b - a for a, b in zip([samples[0][0], *grew], [*grew, samples[-1][0]])]
    assert max(gaps) < 1.0, gaps  # its faults counted as it went: never a second without progress
