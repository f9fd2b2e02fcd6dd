"""Run under torchrun: rank 1 raises a stop flag at step FLAG_AT; every rank reports where the agreement
stopped it in OUT/rank<N>.json. Used by tests/test_preemption.py.

    torchrun --nproc-per-node 2 tests/agreement_steps.py EVERY FLAG_AT OUT [LATER_EVERY FROM_STEP]

With LATER_EVERY and FROM_STEP the interval changes to LATER_EVERY from step FROM_STEP on (as the
trainer's once-a-second interval does after a log line).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mgpu.distributed import process_group
from mgpu.environment import detect_environment
from mgpu.preemption import StopAgreement, StopRequest

every, flag_at, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
later, change_at = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (every, 0)
env = detect_environment()
with process_group(env):
    stop = StopRequest()
    agreement = StopAgreement(stop)
    stopped = None
    for step in range(1, 100):
        if env.rank == 1 and step == flag_at:
            stop.request("requeue_signal")
        reasons = agreement.at_step(step, later if change_at and step >= change_at else every)
        if reasons:
            stopped = {"rank": env.rank, "step": step, "reasons": sorted(reasons)}
            break
    agreement.drain()
    (out / f"rank{env.rank}.json").write_text(json.dumps(stopped))
