"""When a snapshot in memory is due (mgpu.state.memory.cadence), against a fake clock: every k steps as configured;
by default the first at step 5, then as many steps apart as keep a snapshot's copy within 0.5 % of the steps' time,
the most any rank needs (agreed), so every rank takes them at the same steps; within 0.3 % beside survivors' saves
(DDP), whose fallback they are."""

from __future__ import annotations

from pathlib import Path

import pytest

from mgpu.state.memory.cadence import BUDGET, FALLBACK_BUDGET, FIRST_STEP, MAX_EVERY, Cadence, steps_between


@pytest.mark.parametrize("snapshot_s, step_s, steps", [
    (0.0002, 0.035, 2),  # a small model's copy (0.2 ms) against a 35 ms step: 0.57 % a step, so every 2nd
    (0.005, 0.035, 29),  # the trainer bench: 5 ms against 35 ms
    (2.0, 1.0, 400),  # a 4.9 GB state in 2 s against a 1 s step
    (0.0, 0.1, 1),
    (0.1, 0.0, MAX_EVERY),  # no step measured: as rarely as it goes
    (float("inf"), 0.1, MAX_EVERY),
])
def test_the_steps_between_snapshots_keep_their_cost_within_the_budget(snapshot_s: float, step_s: float,
                                                                       steps: int) -> None:
    assert steps_between(snapshot_s, step_s) == steps
    if 0 < steps < MAX_EVERY and step_s > 0:
        assert snapshot_s / (steps * step_s) <= BUDGET


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(cadence: Cadence, clock: Clock, steps: int, step_s: float, snapshot_s: float,
        agree: int | None = None) -> list[int]:
    """The steps a rank takes a snapshot at, its steps `step_s` apart, each snapshot `snapshot_s`; `agree`: what the
    ranks' reduction gives (default: this rank's need)."""
    taken = []
    for step in range(1, steps + 1):
        clock.now += step_s
        if cadence.due(step):
            taken.append(step)
            if cadence.current is None:
                need = cadence.needs(snapshot_s)
                cadence.agree(need if agree is None else max(need, agree))
            else:
                cadence.taken(step)
    return taken


def test_a_configured_cadence_is_every_k_steps_and_0_is_never() -> None:
    clock = Clock()
    assert run(Cadence(4, clock), clock, 13, 0.1, 0.01) == [4, 8, 12]
    assert run(Cadence(0, clock), clock, 13, 0.1, 0.01) == [] and not Cadence(0).on


def test_the_default_measures_at_step_5_then_keeps_the_budget() -> None:
    clock = Clock()
    # 5 ms copies against 35 ms steps: every 29 steps after the first at step 5.
    assert run(Cadence(None, clock), clock, 70, 0.035, 0.005) == [FIRST_STEP, FIRST_STEP + 29, FIRST_STEP + 58]


def test_every_rank_takes_the_most_any_rank_needs() -> None:
    # Rank 1 needs every 29th step, rank 0 (faster copy) every 3rd: both take every 29th, the same steps.
    taken = []
    for snapshot_s in (0.0005, 0.005):
        clock = Clock()
        taken.append(run(Cadence(None, clock), clock, 70, 0.035, snapshot_s, agree=29))
    assert taken[0] == taken[1] == [5, 34, 63]


@pytest.mark.parametrize("sharded, budget", [(False, FALLBACK_BUDGET), (True, BUDGET)], ids=["DDP", "FSDP2"])
def test_beside_survivors_saves_the_default_spends_the_fallback_budget(tmp_path: Path, sharded: bool,
                                                                       budget: float) -> None:
    """Under DDP every step's marks let a survivor save (mgpu.run.session_state.open_marks): the snapshots are their
    fallback, at FALLBACK_BUDGET (5 ms copies against 35 ms steps: every 48 steps, not 29); under FSDP2 there are no
    survivors' saves and they keep BUDGET."""
    from types import SimpleNamespace

    from mgpu.config.schema import Config
    from mgpu.run.session_state import open_marks
    from mgpu.state.memory.snapshots import MemorySnapshots
    from mgpu.state.memory.store import Identity, SnapshotStore

    snapshots = MemorySnapshots(SnapshotStore(tmp_path / "r", Identity("7", 0, "run", "cfg", 2, 1, "")), None, "v")
    session = SimpleNamespace(_marks=None, cfg=Config(), sharded=sharded, world_size=2, rank=1, version="v",
                              _ddps=SimpleNamespace(live=lambda: []), _memory=snapshots, _state=None, watchdog=None)
    open_marks(session, {})  # type: ignore[arg-type]  # what open_marks reads of a session
    assert (session._marks is not None) is not sharded and snapshots.cadence.budget == budget
    clock = Clock()
    snapshots.cadence.clock = clock
    assert run(snapshots.cadence, clock, 70, 0.035, 0.005) == ([5, 53] if not sharded else [5, 34, 63])
