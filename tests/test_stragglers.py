"""Per-rank timing and stragglers: the step's split into compute and wait (mgpu.stop.rank_timing) against a fake
clock, the agreement's slots, and the straggler rule (mgpu.record.stragglers) by tables, then replayed on traces
of every rank's step times measured on this project's 2-core test machine while other developers' jobs ran
(tests/fixtures/rank_noise): no rank named in any of them, and any one rank made 1.3x slower named."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from mgpu.record.stragglers import (StragglerWatch, change_line, others_median, rank_scalars, straggler_line,
                                    summary_line)
from mgpu.stop.rank_timing import RankTimer, decode, encode

NOISE = Path(__file__).parent / "fixtures" / "rank_noise"


# ---------------------------------------------------------------------------------------------- the split
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_step_is_its_compute_and_its_waits_and_what_is_outside_is_left_out() -> None:
    clock, waits = Clock(), [0.0]

    def waited() -> float:
        value, waits[0] = waits[0], 0.0
        return value

    timer = RankTimer(waited, clock)
    timer.step()  # the first boundary only starts the clock
    clock.now, waits[0] = 1.0, 0.25  # a step of 1 s, a quarter of it waiting in DDP's synchronisations
    timer.step()
    clock.now += 0.5
    with timer.outside():  # an evaluation: 2 s, with its own waits, not part of a step
        clock.now += 2.0
        waits[0] = 0.7
    clock.now += 0.5
    timer.add_wait(0.1)  # blocked on the stop agreement's reduction
    timer.step()
    assert timer.interval() == (2, statistics.median([0.75, 0.9]), statistics.median([0.25, 0.1]))
    assert timer.interval() == (0, 0.0, 0.0)  # nothing since


def test_a_wait_longer_than_its_step_is_all_wait() -> None:
    clock = Clock()
    timer = RankTimer(lambda: 5.0, clock)
    timer.step()
    clock.now = 1.0
    timer.step()
    assert timer.interval() == (1, 0.0, 1.0)


@pytest.mark.parametrize("world, rank", [(2, 0), (2, 1), (5, 3)])
def test_the_slots_carry_every_ranks_values_through_a_max(world: int, rank: int) -> None:
    vectors = [encode(world, r, 7, 0.1 * (r + 1), 0.01 * r) for r in range(world)]
    reduced = [max(column) for column in zip(*vectors)]  # what the agreement's MAX all-reduce does
    times = decode(reduced, world, step=16)
    assert times is not None and (times.step, times.steps) == (16, 7)
    assert times.compute[rank] == pytest.approx(0.1 * (rank + 1)) and times.wait[rank] == pytest.approx(0.01 * rank)
    assert decode(encode(world, rank, 0, 0.0, 0.0), world, step=3) is None  # an interval without a step


# ---------------------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("values, left_out, expected", [
    ([1.0, 2.0], 1.0, 2.0), ([1.0, 2.0], 2.0, 1.0), ([1.0, 2.0, 3.0], 2.0, 2.0), ([1.0, 2.0, 3.0], 3.0, 1.5),
    ([1.0, 1.0, 1.0, 9.0], 9.0, 1.0), ([1.0, 1.0, 1.0, 9.0], 1.0, 1.0), ([5.0], 5.0, 0.0),
])
def test_the_median_of_the_others(values: list[float], left_out: float, expected: float) -> None:
    assert others_median(sorted(values), left_out) == expected
    rest = list(values)
    rest.remove(left_out)
    assert expected == (statistics.median(rest) if rest else 0.0)


def test_the_median_of_the_others_all_at_once() -> None:
    import random

    import numpy as np

    from mgpu.record.stragglers import others_medians

    rng = random.Random(0)
    for world in (1, 2, 3, 4, 7, 64):
        values = [rng.choice([0.1, 0.2, rng.random()]) for _ in range(world)]  # ties too
        ordered = sorted(values)
        assert others_medians(np.array(values)).tolist() == [others_median(ordered, v) for v in values]


def feed(watch: StragglerWatch, readings: list[tuple[float, list[float]]], steps: int = 4, start: int = 0) -> list[Any]:
    """Readings of `steps` steps, one a second: (their time, every rank's compute)."""
    changes = []
    step = start
    for when, compute in readings:
        step += steps
        changes += watch.update(step, steps, compute, [0.0] * len(compute), when)
    return changes


def steady(seconds: int, compute: list[float], start: float = 0.0) -> list[tuple[float, list[float]]]:
    return [(start + t, compute) for t in range(seconds)]


CASES = {
    # name: (world, readings, named [(rank, step, named?)])
    "equal ranks": (2, steady(60, [0.2, 0.2]), []),
    "one rank 30 % slower, named once the window covers 20 s and 30 steps": (
        2, steady(60, [0.2, 0.26]), [(1, 84, True)]),
    "one of four 30 % slower": (4, steady(60, [0.2, 0.2, 0.26, 0.2]), [(2, 84, True)]),
    "just under the margin": (2, steady(60, [0.2, 0.2 * 1.19]), []),
    "a burst of 9 s on one rank is not a straggler": (
        2, [*steady(20, [0.2, 0.2]), *steady(9, [0.2, 0.5], 20), *steady(31, [0.2, 0.2], 29)], []),
    "slow, then well again: named, then cleared": (
        2, [*steady(30, [0.2, 0.3]), *steady(40, [0.2, 0.2], 30)], [(1, 84, True), (1, 164, False)]),  # most of the window well: half a hold
    "alternating noise (one rank slower one second, the other the next) averages out": (
        2, [(t, [0.2, 0.4] if t % 2 else [0.4, 0.2]) for t in range(60)], []),
    "a world of one compares with nobody": (1, steady(60, [0.2]), []),
}


@pytest.mark.parametrize("name", CASES)
def test_stragglers(name: str) -> None:
    world, readings, expected = CASES[name]
    watch = StragglerWatch(world, margin=1.2, hold_steps=30, hold_s=20.0)
    assert [(c.rank, c.step, c.named) for c in feed(watch, readings)] == expected


def test_a_hold_in_steps_outlasts_a_short_time() -> None:
    # Steps of 1 s: 30 steps take 30 s, longer than hold_s: the steps decide.
    watch = StragglerWatch(2, margin=1.2, hold_steps=30, hold_s=5.0)
    changes = feed(watch, steady(60, [1.0, 1.5]), steps=1)
    assert [(c.rank, c.step) for c in changes] == [(1, 30)]


def test_what_is_named_and_shown() -> None:
    watch = StragglerWatch(2, 1.2, 30, 20.0, node_of=lambda rank: f"n{rank + 1}")
    (change,) = feed(watch, steady(30, [0.2, 0.26]))
    assert change.fields() == {"rank": 1, "node": "n2", "factor": 1.3, "since_step": 1, "step": 84,
                               "compute_s": 0.26, "typical_s": 0.2}
    assert change_line(change) == ("straggler: rank 1 on n2 is 1.30x slower than the other ranks (compute 0.26 s a "
                                   "step against their 0.2 s) since step 1")
    summary = watch.summary()
    assert summary == {"step": 120, "compute_s": [0.2, 0.23, 0.26], "wait_s": [0.0, 0.0, 0.0],
                       "slowest": {"rank": 1, "node": "n2", "factor": 1.3}, "nodes": {"n1": 0.769, "n2": 1.3},
                       "stragglers": [1]}
    assert summary_line(summary) == ("compute 0.2/0.23/0.26 s, wait 0/0/0 s a step (min/median/max over ranks); "
                                     "slowest rank 1 on n2, 1.30x the others")
    assert rank_scalars(summary)["slowest_factor"] == 1.3 and rank_scalars(summary)["stragglers"] == 1.0
    event = {"event": "straggler", **change.fields()}
    assert straggler_line(event) == ("rank 1 on n2: 1.30x slower than the other ranks since step 1 (compute 0.26 s a "
                                     "step against 0.2 s)")
    assert summary_line({"compute_s": "?"}) is None


# ---------------------------------------------------------------------------------------------- measured noise
def traces() -> list[Path]:
    return sorted(NOISE.glob("*.jsonl"))


def replay(path: Path, slow: int | None = None, factor: float = 1.3) -> list[Any]:
    """The trace's readings through the default rule; `slow`'s compute made `factor` x longer (its waits kept: the
    others' would grow, which the rule does not read)."""
    from mgpu.config.schema import StragglersConfig

    rows = [json.loads(line) for line in path.read_text().splitlines()]
    defaults = StragglersConfig()
    watch = StragglerWatch(len(rows[0]["compute"]), defaults.margin, defaults.hold_steps, defaults.hold_s)
    changes, step = [], 0
    for row in rows:
        step = row["step"] if row["step"] >= 0 else step  # an evaluation's reading ends at the last step
        compute = [value * (factor if rank == slow else 1.0) for rank, value in enumerate(row["compute"])]
        changes += watch.update(step, row["steps"], compute, row["wait"], row["t"] - rows[0]["t"])
    return changes


def test_the_noise_traces_are_there() -> None:
    assert len(traces()) >= 4


@pytest.mark.parametrize("trace", traces(), ids=lambda path: path.stem)
def test_noise_on_a_shared_machine_names_nobody(trace: Path) -> None:
    assert [(c.rank, c.step, round(c.factor, 2)) for c in replay(trace) if c.named] == []


@pytest.mark.parametrize("trace", traces(), ids=lambda path: path.stem)
def test_a_rank_30_percent_slower_is_named_in_the_same_noise(trace: Path) -> None:
    world = len(json.loads(trace.read_text().splitlines()[0])["compute"])
    for slow in range(world):
        named = [c for c in replay(trace, slow) if c.named]
        assert named and named[0].rank == slow, (slow, named)
        assert 1.2 <= named[0].factor <= 1.45, named[0]
        if trace.stem.startswith("slow"):  # steps of 0.2 s (the e2e job's): named within 100 steps
            assert named[0].step <= 100, named[0]


# ---------------------------------------------------------------------------------------------- excluded at a requeue
def ev(name: str, **fields: Any) -> dict[str, Any]:
    return {"time": 1.0, "event": name, "job_id": "7", "restart": 0, **fields}


@pytest.mark.parametrize("attempt, expected", [
    ([], None),
    ([ev("straggler", rank=1, node="n2", factor=1.3)], None),  # stragglers.exclude_node off: named only
    ([ev("straggler", rank=1, node="n2", factor=1.3, exclude=True)], ("n2", "straggler: rank 1 1.3x slower than "
                                                                             "the other ranks")),
    ([ev("straggler", rank=1, node="n2", factor=1.3, exclude=True), ev("straggler_cleared", rank=1, node="n2")], None),
    ([ev("straggler", rank=1, node="n2", factor=1.3, exclude=True),
      ev("straggler", rank=3, node="n4", factor=1.6, exclude=True)], ("n4", "straggler: rank 3 1.6x slower than the "
                                                                            "other ranks")),
])
def test_the_straggler_a_requeue_excludes(attempt: list[dict[str, Any]], expected: tuple[str, str] | None) -> None:
    from mgpu.record.exclusion import straggler_node

    assert straggler_node(attempt) == expected


SHOW_JOB = ("JobId=7 JobName=x JobState=RUNNING Reason=None Restarts=0 PreemptTime=None Requeue=1 NumNodes={nodes} "
            "Partition=main ExcNodeList=(null)\n")


def fake_slurm(nodes_needed: int) -> tuple[list[list[str]], Any]:
    """A Slurm client whose scontrol answers job 7 (running, `nodes_needed` nodes, time-limit stop), partition
    main (n1-n3, all up), and takes a requeue and an update (what a real one would do to a real job)."""
    import subprocess

    from mgpu.cluster.slurm import SlurmClient

    calls: list[list[str]] = []

    def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        calls.append(cmd[1:])
        answers = {("show", "job"): SHOW_JOB.format(nodes=nodes_needed),
                   ("show", "partition"): "PartitionName=main Nodes=n[1-3] State=UP\n",
                   ("show", "node"): "".join(f"NodeName=n{i} State=IDLE\n" for i in (1, 2, 3))}
        return subprocess.CompletedProcess(cmd, 0, answers.get(tuple(cmd[1:3]), ""), "")  # type: ignore[arg-type]

    return calls, SlurmClient(run=run, which=lambda name: name, retry_wait_s=0)


@pytest.mark.parametrize("needed, excluded", [(2, True), (3, False)])
def test_a_straggler_node_is_excluded_when_rank_0_requeues_the_job(needed: int, excluded: bool, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # stragglers.exclude_node: the job's own requeue after a stop (here its time limit's signal) excludes the node of
    # the straggler named, while the partition keeps the nodes the job needs; otherwise it is requeued as it is.
    from mgpu.cluster.environment import ProcessEnv
    from mgpu.cluster.requeue import Budget
    from mgpu.cluster.slurm import set_client
    from mgpu.record.budgets import Limits
    from mgpu.record.ledger import Ledger, read_ledger
    from mgpu.run.outcome import StopBudgets, decide_after_stop

    monkeypatch.setenv("MGPU_KILL_WAIT_S", "30")
    calls, slurm = fake_slurm(needed)
    old = set_client(slurm)
    try:
        env = ProcessEnv("srun", 0, 0, 2, 1, 0, 1, ("n1", "n2"), "7", 0, "n1", 29500)
        ledger = Ledger(tmp_path / "events.jsonl", "7", 0)
        outcome = decide_after_stop({"requeue_signal"}, 50, 0, "ckpt", StopBudgets("7", Budget(0, None), 0, Limits()),
                                    env, ledger, straggler=("n2", "straggler: rank 1 1.3x slower than the other ranks"))
    finally:
        set_client(old)
    assert outcome.kind == "requeued"
    assert ["requeue", "7"] in calls
    assert (["update", "JobId=7", "ExcNodeList=n2"] in calls) is excluded
    events = [e for e in read_ledger(tmp_path / "events.jsonl") if e["event"] == "node_excluded"]
    assert events == ([{**events[0], "node": "n2", "excluded": ["n2"],
                        "reason": "straggler: rank 1 1.3x slower than the other ranks"}] if excluded else [])


def test_a_straggler_node_is_excluded_when_the_recovery_requeues_after_a_failure(tmp_path: Path) -> None:
    from mgpu.cluster.slurm import set_client
    from mgpu.record.budgets import Limits
    from mgpu.record.ledger import Ledger, read_ledger
    from mgpu.record.rundir import RunDir
    from mgpu.run.recovery import handle_failure

    run = RunDir(tmp_path)
    Ledger(run.ledger, "7", 0).write("straggler", rank=1, node="n2", factor=1.3, since_step=3, step=40, exclude=True)
    calls, slurm = fake_slurm(2)
    old = set_client(slurm)
    try:
        action, message = handle_failure(run, "7", 0, Limits(), "exit 1", may_restart=False)
    finally:
        set_client(old)
    assert action == "requeued" and ["update", "JobId=7", "ExcNodeList=n2"] in calls, (action, message, calls)
    assert message.endswith("straggler: rank 1 1.3x slower than the other ranks: excluding n2 (now excluded: n2)")
    assert [e["node"] for e in read_ledger(run.ledger) if e["event"] == "node_excluded"] == ["n2"]


# ---------------------------------------------------------------------------------------------- DDP's waits
@pytest.mark.multiprocess
def test_the_waits_in_ddps_buffer_broadcast_and_gradient_reduction_are_measured(tmp_path: Path) -> None:
    # Rank 1 late by 0.1 s, before its forward (rank 0 waits in DDP's buffer broadcast) or before its backward (in
    # the gradient reduction): rank 0's wait is about 0.1 s a step, rank 1's about nothing, at either place.
    import random
    import subprocess

    from tests.conftest import PYTHON, ROOT, base_env
    from tests.sync_wait_probe import SLEEP_S

    torchrun = str(Path(PYTHON).parent / "torchrun")
    cmd = [torchrun, "--nproc-per-node", "2", "--master-port", str(random.SystemRandom().randint(20000, 32000)),
           str(ROOT / "tests" / "sync_wait_probe.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=base_env(), cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for where in ("forward", "backward"):
        late, waiting = (json.loads((tmp_path / f"{where}-rank{rank}.json").read_text())[1:] for rank in (1, 0))
        assert all(step["waited"] >= 0.8 * SLEEP_S for step in waiting), (where, waiting)
        assert all(step["waited"] <= step["wall"] for step in waiting), (where, waiting)
        assert statistics.median(step["waited"] for step in late) < 0.3 * SLEEP_S, (where, late)


def test_on_a_gpu_the_waits_are_read_from_events_once_they_completed(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here (bench/gpu/rank_timing.sh ran the real one): fake CUDA events, recorded at a device time and done
    # once the device got there. Done pairs are read and their events recorded again; pending ones wait.
    import torch

    from mgpu.parallel.sync_wait import SyncWait

    device_now = [0.0]
    created: list[Any] = []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            created.append(self)

        def record(self, stream: Any = None) -> None:
            self.at = device_now[0] + 1.0  # the device reaches the mark 1 s after the host records it

        def query(self) -> bool:
            return device_now[0] >= self.at

        def elapsed_time(self, end: "Event") -> float:
            return (end.at - self.at) * 1000.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: None)
    meter = SyncWait(torch.device("cuda", 0))
    start = meter._mark()
    device_now[0] = 0.25
    meter._add(start, meter._mark())  # a wait of 0.25 s, done on the device at 1.25
    assert meter.take() == 0.0  # not done yet: nothing read, nothing synchronised
    device_now[0] = 1.3
    assert meter.take() == pytest.approx(0.25)
    meter._add(meter._mark(), meter._mark())
    assert len(created) == 2  # the two done events recorded again, no new ones

