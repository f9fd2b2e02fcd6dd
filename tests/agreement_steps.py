"""Run on 2 ranks (RANK/WORLD_SIZE/MASTER_*: tests.conftest.run_world, or torchrun): for each SCHEDULE in turn, on
one process group, rank 1 raises a stop flag at step FLAG_AT; every rank reports where the agreement stopped it
in OUT/<i>-rank<N>.json (i: the schedule's index), and what the agreement's timing slots said (every step rank 1
works SLOW_S longer, and each rank waits WAITED_S[rank] as if in a synchronisation, which it reports:
mgpu.stop.rank_timing). Used by tests/test_preemption.py: one launch for every schedule, not one each.

    torchrun --nproc-per-node 2 tests/agreement_steps.py OUT EVERY,FLAG_AT[,LATER_EVERY,FROM_STEP] ...

With LATER_EVERY and FROM_STEP the interval changes to LATER_EVERY from step FROM_STEP on (as the
trainer's once-a-second interval does after a log line).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from mgpu.parallel.distributed import process_group
from mgpu.cluster.environment import detect_environment
from mgpu.stop.preemption import StopAgreement, StopRequest
from mgpu.stop.rank_timing import RankTimer

# 100 ms: a reading of one step on a busy 2-core machine put 22 ms of rank 0's hiccup into its compute (CI, 20 ms
# then: rank 1 read as 1 ms slower).
SLOW_S = 0.1
WAITED_S = (0.005, 0.001)


def stop_step(rank: int, every: int, flag_at: int, later: int, change_at: int) -> dict[str, Any] | None:
    stop = StopRequest()
    agreement = StopAgreement(stop, timer=RankTimer(lambda: WAITED_S[rank]))
    stopped = None
    for step in range(1, 100):
        if rank == 1 and step == flag_at:
            stop.request("requeue_signal")
        time.sleep(WAITED_S[rank])  # as if waiting for the others in a synchronisation, and reported so
        if rank == 1:
            time.sleep(SLOW_S)
        reasons = agreement.at_step(step, later if change_at and step >= change_at else every)
        if reasons:
            times = agreement.rank_times
            stopped = {"rank": rank, "step": step, "reasons": sorted(reasons), "readings": agreement.readings,
                       "timing": None if times is None else
                       {"step": times.step, "steps": times.steps, "compute": times.compute, "wait": times.wait}}
            break
    agreement.drain()
    return stopped


if __name__ == "__main__":
    out = Path(sys.argv[1])
    env = detect_environment()
    with process_group(env):
        for index, schedule in enumerate(sys.argv[2:]):
            every, flag_at, *change = map(int, schedule.split(","))
            later, change_at = change if change else (every, 0)
            result = stop_step(env.rank, every, flag_at, later, change_at)
            (out / f"{index}-rank{env.rank}.json").write_text(json.dumps(result))
