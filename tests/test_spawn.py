"""mgpu.spawn's local ranks: the rendezvous store hosted by the spawning process (no port race), and a failed
rank stopping the others. Real processes (torch's spawn context)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, base_env

SCRIPT = r"""
import os, sys, time
from datetime import timedelta

def main(rank):
    import torch.distributed as dist
    # The store is up before any rank runs (hosted by mgpu.spawn's process): no rank binds the port itself.
    try:
        store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=5), wait_for_workers=False)
        store.set(f"rank{rank}", "here")
        print(f"rank {rank} reached the store; agent store {os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}",
              flush=True)
    except Exception as error:
        print(f"rank {rank} found no store: {error}", flush=True)
    if rank == 1:
        raise ValueError("rank 1 fails")
    time.sleep(600)  # a rank that would wait for the failed one forever (no collective to tell it)

if __name__ == "__main__":
    import mgpu
    mgpu.spawn(main, nprocs=2)
"""


@pytest.mark.multiprocess
def test_a_failed_rank_stops_the_others_and_the_store_is_hosted_by_spawn(tmp_path) -> None:
    script = tmp_path / "two.py"
    script.write_text(SCRIPT)
    started = time.monotonic()
    try:
        result = subprocess.run([sys.executable, str(script)], env=base_env(), cwd=ROOT, capture_output=True,
                                text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("mgpu.spawn waited for a rank that would wait for the failed one (600 s)")
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr[-2000:]
    assert "mgpu.spawn: rank1 failed: stopping the other ranks" in result.stderr, result.stderr[-2000:]
    assert elapsed < 60, elapsed  # rank 0 slept 600 s: it was stopped, not waited for
    assert result.stdout.count("reached the store; agent store True") == 2, result.stdout + result.stderr
