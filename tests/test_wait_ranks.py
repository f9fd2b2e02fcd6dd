"""The multiprocess tests' own harness: a rank that hangs fails its test with every thread's Python stack (a rare
hang in CI, test_faults' resumed run with 2 DataLoader workers on 2026-11-28, left only a timeout behind)."""

from __future__ import annotations

import pytest

from tests.conftest import start_ranks, wait_ranks

pytestmark = pytest.mark.multiprocess

HANGS_IN_RANK_1 = """
import os, threading, time
def waiting_on_a_worker():
    time.sleep(3600)
if os.environ["RANK"] == "1":
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    waiting_on_a_worker()
print("rank 0 done", flush=True)
"""


def test_a_rank_still_running_at_the_deadline_fails_with_its_stacks() -> None:
    procs = start_ranks(["-c", HANGS_IN_RANK_1], 2)
    with pytest.raises(AssertionError) as failed:
        wait_ranks(procs, timeout=5)
    text = str(failed.value)
    assert text.startswith("rank 1 still running after 5 s"), text
    assert "----- rank 1 (rc -6)" in text and "waiting_on_a_worker" in text, text  # faulthandler: every thread
    assert all(proc.poll() is not None for proc in procs)
