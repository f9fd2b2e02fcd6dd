"""Run under torchrun: for each SCHEDULE in turn, on one process group, rank 1 raises a stop flag at step
FLAG_AT; every rank reports where the agreement stopped it in OUT/<i>-rank<N>.json (i: the schedule's
index). Used by tests/test_preemption.py: one launch for every schedule, not one each.

    torchrun --nproc-per-node 2 tests/agreement_steps.py OUT EVERY,FLAG_AT[,LATER_EVERY,FROM_STEP] ...

With LATER_EVERY and FROM_STEP the interval changes to LATER_EVERY from step FROM_STEP on (as the
trainer's once-a-second interval does after a log line).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from mgpu.parallel.distributed import process_group
from mgpu.cluster.environment import detect_environment
from mgpu.stop.preemption import StopAgreement, StopRequest


def stop_step(rank: int, every: int, flag_at: int, later: int, change_at: int) -> dict[str, Any] | None:
    stop = StopRequest()
    agreement = StopAgreement(stop)
    stopped = None
    for step in range(1, 100):
        if rank == 1 and step == flag_at:
            stop.request("requeue_signal")
        reasons = agreement.at_step(step, later if change_at and step >= change_at else every)
        if reasons:
            stopped = {"rank": rank, "step": step, "reasons": sorted(reasons)}
            break
    agreement.drain()
    return stopped


out = Path(sys.argv[1])
env = detect_environment()
with process_group(env):
    for index, schedule in enumerate(sys.argv[2:]):
        every, flag_at, *change = map(int, schedule.split(","))
        later, change_at = change if change else (every, 0)
        result = stop_step(env.rank, every, flag_at, later, change_at)
        (out / f"{index}-rank{env.rank}.json").write_text(json.dumps(result))
