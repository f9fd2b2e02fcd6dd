"""What the defaults that make a lost rank cost at most a step cost (checkpoint.memory_every_steps at its default:
every step's marks and generators re-seeded, a survivor's save ready, rank 0's buffer record, snapshots at the
cadence their cost allows) against snapshots off (checkpoint.memory_every_steps=0), side by side in one run, on a
loop of one's own (an mgpu.Session loop: an MLP with batch norm, so rank 0's buffer record runs too) and on the
trainer (mgpu's Trainer on bench.tasks' MLP).

    python bench/failure_overhead.py [--repeats 20] [--steps 200] [--hidden 1024]

The two variants run in the *same* two rank processes (under torchrun), one after the other, each a fresh Session
(its own process group, run directory and snapshots), their order swapped every repeat. The
figure: the ratio of mean step times (mean over a run's steps after a warm-up: the steps with a snapshot are the slow
ones, a median would hide them), the median of the per-repeat paired ratios and a bootstrap 95 % interval of it
(repeats resampled as pairs); `median_step_ratio`, the same of median steps (the per-step work alone).

This machine's noise is larger than the effect (paired ratios 0.82-1.29 even in one process), so the bench also
adds up the defaults' own work where it runs (`Accounting`): `own_work_share`, that time per step over the mean
step, rank 0's (the rank with the buffer record). Its figure is the one to compare with 1 %.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, report  # noqa: E402

WARMUP = 10
VARIANTS = {"defaults": None, "snapshots off": 0}
"""checkpoint.memory_every_steps of each variant (None: the default)."""


def loop_run(run_dir: Path, steps: int, hidden: int, memory: int | None, batch: int = 64) -> list[float]:
    """A loop of one's own on mgpu.Session; its step ends (after `should_stop`)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import mgpu
    from bench.tasks import random_dataset

    config = mgpu.Config()
    config.checkpoint.memory_every_steps = memory
    config.log.tensorboard = False
    ends = []
    with mgpu.Session(run_dir, seed=0, config=config) as session:
        model = session.wrap(nn.Sequential(nn.Linear(256, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                           nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = session.loader(random_dataset(steps * batch * session.world_size), batch_size=batch)
        session.load({"model": model, "optimizer": optimizer, "loader": loader})
        for _ in loader.epochs(1):
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if session.should_stop():
                    break
                ends.append(time.perf_counter())
    return ends


def trainer_run(run_dir: Path, steps: int, hidden: int, memory: int | None, batch: int = 64) -> list[float]:
    """mgpu's Trainer (as jobs/train.py builds it) on bench.tasks' MLP; its step ends."""
    from mgpu.config.loading import load_config
    from mgpu.run.session import Session
    from mgpu.train.task import build_task
    from mgpu.train.trainer import Trainer

    cfg = load_config(None, ["task.target=bench.tasks:BenchTask", f"task.args.size={steps * batch * 2}",
                             f"task.args.hidden={hidden}", f"data.batch_size={batch}", "train.epochs=1",
                             "log.tensorboard=false", "checkpoint.every_steps=0", f"run.dir={run_dir}"])
    cfg.checkpoint.memory_every_steps = memory
    with Session(config=cfg) as session:
        trainer = Trainer(cfg, build_task(cfg.task.target, cfg.task.args), session)
        trainer.fit()
    return list(trainer.step_ends)


PROGRAMS = {"loop": loop_run, "trainer": trainer_run}


def mean_step(ends: list[float]) -> float:
    steady = ends[WARMUP:]
    return (steady[-1] - steady[0]) / (len(steady) - 1)


def median_step(ends: list[float]) -> float:
    """The median step: the per-step cost alone, without the snapshots' steps."""
    steady = ends[WARMUP:]
    return statistics.median(b - a for a, b in zip(steady, steady[1:]))


def bootstrap_median_ci(ratios: list[float], draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


class Accounting:
    """The time the defaults' own work takes in a run, added up on the training thread, where it runs on a CPU: a
    step's mark (`StepMarks.mark`: the small objects' copies; on rank 0 its buffers copied into its record), the
    buffers' copy at the next forward (`StepMarks._synced`'s hook) and `session.snapshot()` (the cadence's check,
    the snapshot's copy when due). Installed in both variants alike (snapshots off calls only `snapshot()`, which
    returns at once)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def install(self) -> None:
        import functools

        import mgpu.run.session_state as session_state
        from mgpu.state.memory.step_mark import StepMarks

        def timed(fn):  # type: ignore[no-untyped-def]
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
                started = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - started
            return wrapper

        synced = StepMarks._synced
        StepMarks.mark = timed(StepMarks.mark)  # type: ignore[method-assign]
        StepMarks._synced = lambda marks, ddp, places: timed(synced(marks, ddp, places))  # type: ignore[method-assign]
        session_state.snapshot = timed(session_state.snapshot)


def worker(args: argparse.Namespace) -> None:
    """One rank: every repeat runs both variants, one after the other, in this process."""
    rank = int(os.environ.get("RANK", "0"))
    means: dict[str, list[float]] = {name: [] for name in VARIANTS}
    medians: dict[str, list[float]] = {name: [] for name in VARIANTS}
    shares: list[float] = []
    accounting = Accounting()
    accounting.install()
    with tempfile.TemporaryDirectory() as workdir:
        PROGRAMS[args.program](Path(workdir) / "warmup", 30, args.hidden, None)  # imports, allocator, thread pools
        for repeat in range(args.repeats):
            order = list(VARIANTS) if repeat % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                run_dir = Path(workdir) / f"r{repeat}-{VARIANTS[name]}"
                accounting.seconds = 0.0
                ends = PROGRAMS[args.program](run_dir, args.steps, args.hidden, VARIANTS[name])
                means[name].append(mean_step(ends))
                medians[name].append(median_step(ends))
                if VARIANTS[name] is None:  # the defaults' own work, per step, as a share of their mean step
                    shares.append(accounting.seconds / len(ends) / means[name][-1])
    if rank == 0:
        Path(args.worker).write_text(json.dumps({"means": means, "medians": medians, "shares": shares}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=list(PROGRAMS))
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default bench/results/failure_overhead.json)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--program", choices=list(PROGRAMS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    rows = []
    for program in args.programs:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            port = str(random.SystemRandom().randint(20000, 32000))
            subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "--master-port",
                            port, __file__, "--worker", out.name, "--program", program, "--repeats", str(args.repeats),
                            "--steps", str(args.steps), "--hidden", str(args.hidden)],
                           check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
            result = json.loads(Path(out.name).read_text())
        means, medians, shares = result["means"], result["medians"], result["shares"]
        paired = [d / o for d, o in zip(means["defaults"], means["snapshots off"])]
        paired_medians = [d / o for d, o in zip(medians["defaults"], medians["snapshots off"])]
        low, high = bootstrap_median_ci(paired)
        rows.append({"program": program, "defaults_step_ms": round(statistics.median(means["defaults"]) * 1e3, 3),
                     "off_step_ms": round(statistics.median(means["snapshots off"]) * 1e3, 3),
                     "ratio_median": round(statistics.median(paired), 4), "ratio_ci95_low": round(low, 4),
                     "ratio_ci95_high": round(high, 4), "ratio_min": round(min(paired), 4),
                     "ratio_max": round(max(paired), 4),
                     "median_step_ratio": round(statistics.median(paired_medians), 4),
                     "own_work_share_median": round(statistics.median(shares), 5),
                     "own_work_share_max": round(max(shares), 5), "repeats": args.repeats, "steps": args.steps,
                     "hidden": args.hidden, "per_repeat": [round(r, 4) for r in paired]})
    report("failure_overhead", rows, args.out)


if __name__ == "__main__":
    main()
