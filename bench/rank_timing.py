"""What per-rank timing costs (stragglers.enabled): the same DDP step loop with it and without, side by side.

    python bench/rank_timing.py                      # 2 gloo ranks, 30 repeats of 120 steps each way
    python bench/rank_timing.py --ranks 2 --repeats 30 --steps 120 --hidden 1024
    python bench/rank_timing.py --device cuda        # on a GPU (2 ranks on one device, gloo): CUDA events

Both loops run in the same processes, on the same process group, with the same model shape, data and
optimizer: a DDP model (BatchNorm buffers, so DDP's forward broadcasts them) and the stop agreement at every
step boundary (`StopController.at_step`, about once a second an asynchronous all-reduce), as a Session's loop
has them. *on*: the model's waits measured (mgpu.parallel.sync_wait), the step split (mgpu.stop.rank_timing),
every rank's slots in the agreement's vector, and on rank 0 the straggler watch fed every reading
(mgpu.record.stragglers). *off*: none of it. Repeats alternate the order (off first, then on first) so a drift of
the shared machine hits both alike. The figure: the ratio of the median step times (median over steps after a
warm-up, then over repeats), the median of the paired per-repeat ratios and a bootstrap 95 % interval.
Target: <= 1.005.

A paired ratio on a machine shared with other jobs resolves about a percent, not half of one; so the direct
costs are measured too, in one process, with nothing else in the loop: the per-step work on the training thread
(the hooks, the timer), the per-reading work on rank 0 (the watch's update) at several world sizes, and the
bytes the agreement carries in addition. Their sum over a step is a bound the paired ratio cannot give.
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

from bench.common import ROOT, median, report  # noqa: E402

WARMUP = 10


def loop(model, optimizer, controller, data, step0: int) -> list[float]:  # type: ignore[no-untyped-def]
    """The steps of a Session's loop, as the trainer makes them; each step's end time."""
    import torch.nn.functional as F

    ends = []
    for index, (x, y) in enumerate(data):
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        controller.at_step(step0 + index + 1)
        ends.append(time.perf_counter())
    return ends


def step_time(ends: list[float]) -> float:
    return median([b - a for a, b in zip(ends[WARMUP:], ends[WARMUP + 1:])])


def rank_main(out: Path, repeats: int, steps: int, batch: int, hidden: int, device_name: str, parts: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from mgpu.parallel.sync_wait import SyncWait
    from mgpu.record.stragglers import StragglerWatch
    from mgpu.stop.preemption import StopAgreement, StopRequest
    from mgpu.stop.rank_timing import RankTimer
    from mgpu.stop.stopping import StopController

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_name)
    torch.manual_seed(0)

    def build(timed: bool):  # type: ignore[no-untyped-def]
        model = nn.Sequential(nn.Linear(256, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 10))
        ddp = DistributedDataParallel(model.to(device))
        meter = SyncWait(device) if timed else None
        if meter is not None and parts == "all":
            meter.attach(ddp)
        elif meter is not None and parts == "forward":  # the buffer broadcast's marks alone
            ddp.register_forward_pre_hook(meter._before_buffers)
            ddp.module.register_forward_pre_hook(meter._after_buffers)
        elif meter is not None and parts == "backward":  # the gradient reduction's marks alone
            next(ddp.parameters()).register_post_accumulate_grad_hook(meter._gradient)
        timer = RankTimer(meter.take) if meter is not None else None
        watch = StragglerWatch(world, 1.2, 30, 20.0) if timed and rank == 0 else None
        stop = StopRequest()
        controller = StopController(stop, StopAgreement(stop, timer=timer), stragglers=watch)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), controller

    runs = {"off": build(False), "on": build(True)}
    generator = torch.Generator().manual_seed(rank)
    data = [(torch.randn(batch, 256, generator=generator).to(device),
             torch.randint(0, 10, (batch,), generator=generator).to(device)) for _ in range(steps)]
    times: dict[str, list[float]] = {"off": [], "on": []}
    step0 = 0
    for repeat in range(repeats):
        for kind in (("off", "on") if repeat % 2 == 0 else ("on", "off")):
            model, optimizer, controller = runs[kind]
            times[kind].append(step_time(loop(model, optimizer, controller, data, step0)))
            step0 += steps
    for _, _, controller in runs.values():
        controller.agreement.drain()  # type: ignore[attr-defined]  # the real agreement
    readings = runs["on"][2].agreement.readings  # type: ignore[attr-defined]
    (out / f"rank{rank}.json").write_text(json.dumps({**times, "readings": readings}))
    dist.destroy_process_group()


def bootstrap(off: list[float], on: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    pairs = list(zip(off, on))
    ratios = sorted(median([b for _, b in sample]) / median([a for a, _ in sample])
                    for sample in ([rng.choice(pairs) for _ in pairs] for _ in range(draws)))
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def per_call_ns(work, calls: int) -> float:  # type: ignore[no-untyped-def]
    """The best of 5 timings of `calls` calls of `work`, per call, in this thread's CPU time (what a machine shared
    with other jobs does to the wall clock is not the work's)."""
    best = float("inf")
    for _ in range(5):
        began = time.thread_time()
        for _ in range(calls):
            work()
        best = min(best, (time.thread_time() - began) / calls * 1e9)
    return best


def paired_extra_ns(plain, hooked, rounds: int = 40, calls: int = 300) -> float:  # type: ignore[no-untyped-def]
    """The median over `rounds` of hooked's CPU time per call less plain's, the two alternating."""
    extra = []
    for index in range(rounds):
        spent = {}
        for name, work in ((("plain", plain), ("hooked", hooked)) if index % 2 else
                           (("hooked", hooked), ("plain", plain))):
            began = time.thread_time()
            for _ in range(calls):
                work()
            spent[name] = (time.thread_time() - began) / calls
        extra.append((spent["hooked"] - spent["plain"]) * 1e9)
    return statistics.median(extra)


def direct_costs() -> dict[str, float]:
    """Nanoseconds of the training thread's added work per step (one forward, one backward: the hooks and
    callbacks, the timer's step), the difference between a small model with them and one without (both with the
    watchdog's forward pre-hook, which a session's model has anyway), and microseconds of rank 0's work per
    reading (the agreement's slots, the watch's update) at several world sizes."""
    import torch
    from torch import nn

    from mgpu.parallel.sync_wait import SyncWait
    from mgpu.record.stragglers import StragglerWatch
    from mgpu.stop.rank_timing import RankTimer, decode, encode

    torch.manual_seed(0)
    x = torch.randn(4, 8)

    def tiny(hooked: bool):  # type: ignore[no-untyped-def]
        model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
        wrapper = nn.Module()
        wrapper.module = model  # what SyncWait.attach looks for on a DDP module
        wrapper.forward = lambda inputs: model(inputs)  # type: ignore[method-assign]
        wrapper.register_forward_pre_hook(lambda module, args: None)  # the watchdog's beat
        if not hooked:
            return lambda: wrapper(x).sum().backward()
        meter = SyncWait(torch.device("cpu"))
        meter.attach(wrapper)
        timer = RankTimer(meter.take)

        def step() -> None:
            wrapper(x).sum().backward()
            timer.step()
        return step

    costs = {"per_step_ns": round(max(0.0, paired_extra_ns(tiny(False), tiny(True))))}
    for world in (2, 64, 1024, 4096):
        watch = StragglerWatch(world, 1.2, 30, 20.0)
        rng = random.Random(0)
        vectors = [encode(world, rank, 4, 0.2 + 0.01 * rng.random(), 0.01 * rng.random()) for rank in range(world)]
        reduced = [max(column) for column in zip(*vectors)]
        step, clock = 0, [0.0]

        def reading() -> None:
            nonlocal step
            step += 4
            clock[0] += 1.0
            encode(world, 0, 4, 0.2, 0.01)  # this rank's slots
            times = decode(reduced, world, step)  # every rank's, read back
            assert times is not None
            watch.update(step, 4, times.compute, times.wait, clock[0])
        costs[f"reading_us_world{world}"] = round(per_call_ns(reading, 100) / 1000, 1)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--parts", choices=("all", "forward", "backward", "none"), default="all",
                        help="what `on` measures of the model's waits (none: only the timer and the agreement's slots)")
    parser.add_argument("--name", default="rank_timing")
    parser.add_argument("--out", type=Path, help="the JSON file (default bench/results/NAME.json)")
    parser.add_argument("--rank-main", nargs=1, metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(Path(args.rank_main[0]), args.repeats, args.steps, args.batch, args.hidden, args.device, args.parts)
        return
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--master-port",
               str(random.SystemRandom().randint(20000, 32000)), str(Path(__file__).resolve()), "--rank-main", out,
               "--repeats", str(args.repeats), "--steps", str(args.steps), "--batch", str(args.batch),
               "--hidden", str(args.hidden), "--device", args.device, "--parts", args.parts]
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
        result = json.loads((Path(out) / "rank0.json").read_text())
    off, on = result["off"], result["on"]
    low, high = bootstrap(off, on)
    paired = sorted(b / a for a, b in zip(off, on))
    costs = direct_costs()
    step_s = median(off)
    rows = [{"ranks": args.ranks, "device": args.device, "parts": args.parts, "repeats": args.repeats, "steps": args.steps,
             "step_off_ms": round(1e3 * median(off), 3), "step_on_ms": round(1e3 * median(on), 3),
             "ratio": round(median(on) / median(off), 4), "paired_median": round(statistics.median(paired), 4),
             "ci95": f"{low:.4f}-{high:.4f}", "readings": result["readings"],
             "direct_per_step_ns": costs["per_step_ns"],
             "direct_share": f"{100 * costs['per_step_ns'] * 1e-9 / step_s:.3f}%",
             **{key: value for key, value in costs.items() if key.startswith("reading_")},
             "agreement_extra_bytes": 8 * (1 + 2 * args.ranks)}]
    report(args.name, rows, args.out)


if __name__ == "__main__":
    main()
