"""Loop overhead on CPU: mgpu's Trainer against a hand-written DDP loop (same model, data, optimizer, seeds, batch).

    python bench/loop_overhead.py                 # 1 process and 2 gloo ranks, 25 repeats each
    python bench/loop_overhead.py --ranks 2 --repeats 25 --steps 100
    python bench/loop_overhead.py --ranks 2 --profile      # where each loop's time goes (cProfile, rank 0)
    python bench/loop_overhead.py --ranks 2 --compare-watchdog --repeats 100   # the watchdog's cost

--compare-watchdog measures our trainer with its watchdog (the default) against our trainer without it
(watchdog.enabled=false) instead of against the hand-written loop, alternating the two the same way.

Both loops run in the same processes, R times, in alternating order (raw first, then ours first) so a
slow drift of the shared machine hits both alike. The figure is the ratio of the median step times
(median over steps after a warm-up, then median over repeats); the median and quartiles of the
per-repeat (paired) ratios and a bootstrap 95% interval of the ratio (repeats resampled as pairs)
show how far this machine's noise lets the figure be trusted. Target: <= 1.02.

Each rank is bound to an equal share of the cores (--no-pin: left to the kernel), as srun --cpu-bind would.
--profile runs each loop 5 more times under cProfile on rank 0 and writes, per function, the seconds per
step of each loop and the difference, largest difference first: bench/results/loop_overhead_profile.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, median, report  # noqa: E402

WARMUP = 10
PROFILE_RUNS = 5


def hand_written(steps: int, batch: int, world: int, rank: int, hidden: int) -> list[float]:
    """The loop a user writes from the PyTorch DDP tutorial, timed per step."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from bench.tasks import mlp, random_dataset

    torch.manual_seed(0)
    model = mlp(hidden=hidden)
    ddp = DDP(model) if world > 1 else model
    # mgpu's default optimizer, spelled out (torch's AdamW default weight_decay is 0.01, mgpu's is 0).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    dataset = random_dataset(steps * batch * world)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=0)
    sampler.set_epoch(0)
    ends = []
    for x, y in DataLoader(dataset, batch_size=batch, sampler=sampler):
        loss = F.cross_entropy(ddp(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ends.append(time.perf_counter())
    return ends


def ours(steps: int, batch: int, world: int, ctx, hidden: int, overrides: list[str]) -> list[float]:
    from mgpu.config.loading import load_config
    from mgpu.record.ledger import Ledger
    from mgpu.stop.preemption import StopRequest
    from mgpu.record.rundir import RunDir
    from mgpu.train.task import build_task
    from mgpu.train.trainer import Trainer
    from mgpu.stop.watchdog import Watchdog

    cfg = load_config(None, ["task.target=bench.tasks:BenchTask", f"task.args.size={steps * batch * world}",
                             f"task.args.hidden={hidden}", f"data.batch_size={batch}", "train.epochs=1",
                             "schedule.name=constant", *overrides])
    with tempfile.TemporaryDirectory() as run_dir:
        cfg.run.dir = run_dir
        run = RunDir(Path(run_dir))
        run.logs.mkdir()
        watchdog = Watchdog.from_config(cfg.watchdog, ctx.env.rank, world, run.logs,
                                        on_hang=lambda *args: None).start() if cfg.watchdog.enabled else None
        trainer = Trainer(cfg, build_task(cfg.task.target, cfg.task.args), ctx, run, Ledger(None), StopRequest(),
                          watchdog=watchdog)
        trainer.fit()
        if watchdog is not None:
            watchdog.stop()
    return list(trainer.step_ends)


def beat_cost_ns(calls: int = 200_000) -> float:
    """Nanoseconds one Watchdog.beat() takes on the training thread (the watchdog's whole per-phase cost
    there): a direct bound on its share of a step, which the paired ratio cannot resolve on a noisy machine."""
    from mgpu.stop.watchdog import Watchdog

    dog = Watchdog(0, 1, Path(tempfile.gettempdir()), step_multiple=10, floor_s=60, first_step_s=600,
                   checkpoint_s=600, on_hang=lambda *args: None)
    phases = ["forward", "model", "backward", "optimizer"]
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for index in range(calls // 5):
            dog.beat("data", index)
            for phase in phases:
                dog.beat(phase)
        best = min(best, (time.perf_counter() - started) / calls * 1e9)
    return best


def step_time(ends: list[float]) -> float:
    return median([b - a for a, b in zip(ends[WARMUP:], ends[WARMUP + 1:])])


def bootstrap_ratio_ci(raw: list[float], mine: list[float], draws: int = 2000, seed: int = 0
                       ) -> tuple[float, float]:
    """95% interval of median(mine) / median(raw), resampling the repeats as pairs (they ran side by side)."""
    rng = random.Random(seed)
    pairs = list(zip(raw, mine))
    ratios = []
    for _ in range(draws):
        sample = [rng.choice(pairs) for _ in pairs]
        ratios.append(median([m for _, m in sample]) / median([r for r, _ in sample]))
    ratios.sort()
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def profile_table(steps: int, raw: pstats.Stats, mine: pstats.Stats, top: int = 25) -> str:
    """Own time (tottime) per step of every function in either loop, largest extra time in ours first."""
    def per_step(stats: pstats.Stats) -> dict[str, float]:
        out: dict[str, float] = {}
        for (path, line, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
            key = f"{Path(path).name}:{line}({name})" if path != "~" else name
            out[key] = out.get(key, 0.0) + tottime / steps
        return out

    a, b = per_step(raw), per_step(mine)
    rows = sorted(set(a) | set(b), key=lambda k: b.get(k, 0.0) - a.get(k, 0.0), reverse=True)
    lines = [f"{'raw ms/step':>12} {'mgpu ms/step':>13} {'extra ms':>9}  function",
             f"{sum(a.values()) * 1e3:12.3f} {sum(b.values()) * 1e3:13.3f} "
             f"{(sum(b.values()) - sum(a.values())) * 1e3:9.3f}  (all, under cProfile)"]
    for key in rows[:top] + ["..."] + rows[-5:]:
        if key == "...":
            lines.append("...")
            continue
        lines.append(f"{a.get(key, 0.0) * 1e3:12.3f} {b.get(key, 0.0) * 1e3:13.3f} "
                     f"{(b.get(key, 0.0) - a.get(key, 0.0)) * 1e3:9.3f}  {key}")
    return "\n".join(lines)


def worker(args: argparse.Namespace) -> None:
    from mgpu.parallel.distributed import process_group
    from mgpu.cluster.environment import detect_environment

    env = detect_environment()
    if args.pin and hasattr(os, "sched_setaffinity"):
        # An equal share of the cores per rank, as srun --cpu-bind would: the ranks' threads then never
        # trade cores mid-step.
        cores = sorted(os.sched_getaffinity(0))
        share = max(1, len(cores) // env.local_world_size)
        start = (env.local_rank * share) % len(cores)
        os.sched_setaffinity(0, set(cores[start:start + share]))

    def raw_loop() -> list[float]:
        if args.compare_watchdog:  # the baseline: our trainer without its watchdog
            return ours(args.steps, args.batch, env.world_size, ctx, args.hidden,
                        [*args.override, "watchdog.enabled=false"])
        return hand_written(args.steps, args.batch, env.world_size, env.rank, args.hidden)

    def our_loop() -> list[float]:
        extra = ["watchdog.enabled=true"] if args.compare_watchdog else []
        return ours(args.steps, args.batch, env.world_size, ctx, args.hidden, [*args.override, *extra])

    with process_group(env) as ctx:
        raw_loop(), our_loop()  # warm-up: allocator, thread pools, first-call imports
        rows = []
        for repeat in range(args.repeats):
            if repeat % 2 == 0:
                raw = step_time(raw_loop())
                mine = step_time(our_loop())
            else:
                mine = step_time(our_loop())
                raw = step_time(raw_loop())
            rows.append({"repeat": repeat, "raw_s": raw, "mgpu_s": mine})
        profile = None
        if args.profile:
            # Several alternating runs, added up: one run of a 2-rank loop is as noisy as one repeat.
            profilers: tuple[list[cProfile.Profile], list[cProfile.Profile]] = ([], [])
            for _ in range(PROFILE_RUNS):
                for loop, into in ((raw_loop, profilers[0]), (our_loop, profilers[1])):
                    profiler = cProfile.Profile()
                    profiler.runcall(loop)
                    into.append(profiler)
            stats = [pstats.Stats(*runs, stream=io.StringIO()) for runs in profilers]  # type: ignore[arg-type]
            profile = profile_table(args.steps * PROFILE_RUNS, *stats)
        if env.rank == 0:
            Path(args.worker).write_text(json.dumps({"repeats": rows, "profile": profile}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--override", action="append", default=[], help="trainer config override (repeatable)")
    parser.add_argument("--profile", action="store_true", help="also profile one run of each loop (rank 0)")
    parser.add_argument("--compare-watchdog", action="store_true",
                        help="baseline: our trainer without its watchdog, not the hand-written loop")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="bind each rank to one core (default: on)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/loop_overhead.json)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows, profiles = [], []
    for ranks in args.ranks:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(ranks), "--master-port",
                   str(random.SystemRandom().randint(20000, 32000)), __file__, "--worker", out.name, "--repeats", str(args.repeats),
                   "--steps", str(args.steps), "--batch", str(args.batch), "--hidden", str(args.hidden)]
            for item in args.override:
                cmd += ["--override", item]
            if args.profile:
                cmd.append("--profile")
            if args.compare_watchdog:
                cmd.append("--compare-watchdog")
            cmd.append("--pin" if args.pin else "--no-pin")
            # CPU only, both loops: the hand-written one has no device or autocast path (see the README).
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, 2 // ranks))),
                       PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
            subprocess.run(cmd, check=True, env=env, cwd=ROOT)
            result = json.loads(Path(out.name).read_text())
        repeats = result["repeats"]
        raws, mines = [r["raw_s"] for r in repeats], [r["mgpu_s"] for r in repeats]
        raw, mine = median(raws), median(mines)
        paired = [m / r for r, m in zip(raws, mines)]
        q1, _, q3 = statistics.quantiles(paired, n=4) if len(paired) > 1 else (paired[0],) * 3
        low, high = bootstrap_ratio_ci(raws, mines)
        rows.append({"ranks": ranks, "baseline": "mgpu without watchdog" if args.compare_watchdog else "hand-written",
                     "raw_step_ms": raw * 1e3, "mgpu_step_ms": mine * 1e3, "ratio": mine / raw,
                     "ratio_ci95_low": low, "ratio_ci95_high": high,
                     "paired_median": median(paired), "paired_q1": q1, "paired_q3": q3,
                     "repeats": args.repeats, "steps": args.steps, "batch": args.batch, "overrides": args.override,
                     "per_repeat_ratios": [round(r, 4) for r in paired]})
        if args.compare_watchdog:
            # 5 beats per step (data, forward, model, backward, optimizer) at grad_accum 1.
            rows[-1]["beat_ns"] = beat_ns = beat_cost_ns()
            rows[-1]["beats_share_of_step"] = 5 * beat_ns * 1e-9 / mine
        if result["profile"]:
            profiles.append(f"== {ranks} rank(s), {args.steps} steps, batch {args.batch}: milliseconds of own time "
                            f"per step on rank 0 over {PROFILE_RUNS} whole runs of each loop (ours includes building the "
                            f"Trainer and the final checkpoint)\n{result['profile']}\n")
    report("loop_overhead", rows, args.out)
    if profiles:
        path = (args.out or ROOT / "bench" / "results" / "loop_overhead.json").with_name(
            (args.out.stem if args.out else "loop_overhead") + "_profile.txt")
        path.write_text("\n".join(profiles))
        print("\n".join(profiles))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
