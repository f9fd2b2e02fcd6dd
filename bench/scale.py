"""Scale on one machine: a hang and a preemption with N gloo ranks (jobs/train.py, a tiny model), N = 8, 16, 32.

    python bench/scale.py                     # 8 16 32
    python bench/scale.py --worlds 8 16 --out bench/results/scale.json
    python bench/scale.py --worlds 8 16 --scenarios hang    # the blame only

For each world size, one step of N ranks (tests.conftest.start_ranks: one process group, as slurmstepd):
- hang: the last rank falls asleep inside its loss (tests.tasks:HangingBlobTask, at its 6th call; 2 s floor).
  Measured from the marker it writes as it stalls: stall -> `hang` event (detected, evidence written), stall ->
  every rank out (the last process's exit, polled every 50 ms);
- preemption: rank 0 sends SIGTERM to the whole group at its 6th loss call (tests.tasks:SignalingBlobTask).
  Measured from the signal (the `preempted` event's signal time on rank 0): signal -> the preemption checkpoint
  saved (its ledger event; every rank's state is in it) and signal -> every rank out.
- heartbeat publishes per second (the watchdog's board: the rendezvous store, one `set` per rank every 2 s,
  counted from the code's interval) and run-directory metadata operations of the watchdog: 0 by construction
  (it never touches the run directory until a hang's evidence).
Ranks run on the machine's cores as they are (2 here, shared): the figures are upper bounds for a real node.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402
from mgpu.record.ledger import read_ledger  # noqa: E402
from mgpu.stop.watchdog import WRITE_EVERY_S  # noqa: E402
from tests.conftest import PYTHON, base_env  # noqa: E402

TRAIN = str(ROOT / "jobs" / "train.py")
COMMON = ["task.args.step_s=0.05", "task.args.size=1024", "train.epochs=50", "data.batch_size=4", "log.every_steps=1", "log.tensorboard=false",
          "watchdog.floor_s=2", "watchdog.step_multiple=5", "watchdog.first_step_s=300", "watchdog.eval_s=300",
          "checkpoint.async_save=false", "distributed.init_timeout_s=600"]


def start_ranks(argv: list[str], world: int, logs: Path) -> list[subprocess.Popen[bytes]]:
    """`world` ranks in one process group (as tests.conftest.start_ranks), their output in files."""
    port, procs, group = str(random.SystemRandom().randint(20000, 32000)), [], 0
    logs.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        env = base_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        with open(logs / f"out{rank}.txt", "wb") as out:
            procs.append(subprocess.Popen([PYTHON, *argv], env=env, cwd=ROOT, process_group=group, stdout=out,
                                          stderr=subprocess.STDOUT))
        group = group or procs[0].pid
    return procs


def _out_at(procs: list, timeout: float) -> float:
    """Wall time at which the last rank exited (polled every 50 ms)."""
    deadline = time.time() + timeout
    while any(p.poll() is None for p in procs):
        if time.time() > deadline:
            os.killpg(procs[0].pid, signal.SIGKILL)
            raise TimeoutError(f"ranks still running after {timeout} s")
        time.sleep(0.05)
    return time.time()


def hang(world: int, folder: Path) -> dict[str, float]:
    run = folder / f"hang-{world}"
    marker = folder / f"stall-{world}"
    procs = start_ranks([TRAIN, f"run.dir={run}", "task.target=tests.tasks:HangingBlobTask", "task.args.mode=sleep",
                         f"task.args.rank={world - 1}", "task.args.at=6", f"task.args.hang_file={marker}", *COMMON],
                        world, folder / f"out-hang-{world}")
    out = _out_at(procs, 900)
    stalled = Path(f"{marker}.rank{world - 1}").stat().st_mtime
    (event,) = [e for e in read_ledger(run / "events.jsonl") if e["event"] == "hang"]
    return {"world": world, "scenario": "hang", "blamed": "+".join(map(str, event["ranks"])),
            "to_event_s": round(event["time"] - stalled, 2),
            "to_all_out_s": round(out - stalled, 2), "codes_ok": all(p.returncode == 4 for p in procs),
            "codes": "+".join(f"{code}x{sum(p.returncode == code for p in procs)}"
                              for code in sorted({p.returncode for p in procs})),
            "other_exits": _other_exits(procs, 4, folder / f"out-hang-{world}")}


def _other_exits(procs: list, expected: int, logs: Path) -> dict[str, str]:
    """The ranks that exited with another code than `expected`: their code and the last line they printed."""
    found = {}
    for rank, proc in enumerate(procs):
        if proc.returncode != expected:
            lines = (logs / f"out{rank}.txt").read_text(errors="replace").strip().splitlines()
            found[str(rank)] = f"exit {proc.returncode}: {lines[-1][-300:] if lines else ''}"
    return found


def preemption(world: int, folder: Path) -> dict[str, float]:
    run = folder / f"stop-{world}"
    procs = start_ranks([TRAIN, f"run.dir={run}", "task.target=tests.tasks:SignalingBlobTask", "task.args.at=6",
                         "task.args.signals=TERM", *COMMON], world, folder / f"out-stop-{world}")
    out = _out_at(procs, 900)
    events = read_ledger(run / "events.jsonl")
    (stop,) = [e for e in events if e["event"] == "preempted"]
    sent = min(stop.get("signal_times") or [stop["time"]])  # rank 0's receipt of the signal
    saved = [e for e in events if e["event"] == "checkpoint_saved" and e.get("reason") == "preemption"]
    return {"world": world, "scenario": "preemption", "blamed": "-", "to_event_s": round(saved[-1]["time"] - sent, 2) if saved else -1,
            "to_all_out_s": round(out - sent, 2), "codes_ok": all(p.returncode in (0, 3) for p in procs)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--scenarios", nargs="+", choices=["hang", "preemption"], default=["hang", "preemption"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--keep", type=Path, help="run in this folder and keep the runs and the ranks' output")
    args = parser.parse_args()
    rows = []
    with contextlib.nullcontext(str(args.keep)) if args.keep else tempfile.TemporaryDirectory(prefix="mgpu-scale-") as tmp:
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for world in args.worlds:
            for scenario in [{"hang": hang, "preemption": preemption}[name] for name in args.scenarios]:
                started = time.time()
                row = scenario(world, Path(tmp))
                row.update(wall_s=round(time.time() - started, 1), heartbeats_per_s=round(world / WRITE_EVERY_S, 1),
                           load_per_cpu=round(os.getloadavg()[0] / (os.cpu_count() or 1), 1),
                           watchdog_rundir_metadata_ops_per_s=0)
                print(row, flush=True)
                rows.append(row)
    report("scale", rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
