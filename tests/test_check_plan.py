"""The resume checker's plan (mgpu.check.plan) against a fake runner whose "ranks" record through the real hooks
(mgpu.record.check_hooks) in this process: what it says about an unbroken run too short to check."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import pytest
import torch

from mgpu.check.plan import check
from mgpu.check.runs import Run, Target
from mgpu.errors import MgpuError
from mgpu.record import check_hooks


class RecordingRunner:
    """Each segment is `loop(rank)` run here with the checker's directory set, as a rank's process would be."""

    def __init__(self, loop: Callable[[int], None], monkeypatch: pytest.MonkeyPatch) -> None:
        self.loop, self.monkeypatch = loop, monkeypatch

    def segment(self, run: Run, world: int, stop_at: int | None, halved: bool = False) -> list[int]:
        check_dir = run.run_dir.parent / f"{run.name}.segment{len(run.segments)}"
        check_dir.mkdir(parents=True)
        self.monkeypatch.setenv(check_hooks.CHECK_DIR, str(check_dir))
        run.segments.append(check_dir)
        for rank in range(world):
            self.loop(rank)
        return [0] * world


def reads(batches: int, steps: list[int]) -> Callable[[int], None]:
    """A loop that reads `batches` batches from session.loader and asks should_stop() after the steps in `steps`."""
    def loop(rank: int) -> None:
        for i in range(batches):
            check_hooks.record_batch(rank, 0, (i + 1) * 4, torch.full((4, 2), float(i)), ids=range(i * 4, i * 4 + 4))
            if i + 1 in steps:
                check_hooks.record_step(rank, i + 1)
    return loop


@pytest.mark.parametrize("batches, steps, expected", [
    # Issue 46: a loop that never asks should_stop() was told "the loop ran 0 step(s) ... (more data, or --steps)".
    (6, [], "the loop ran 0 steps: it never asked session.should_stop() (it read 6 batches from session.loader); "
            "call it once per optimizer step, after optimizer.step()"),
    (0, [], "the loop ran 0 steps: it never asked session.should_stop(); call it once per optimizer step"),
    (1, [1], "the loop ran 1 step(s): a resume check needs at least 2 (more data, or --steps)"),
])
def test_a_run_too_short_to_check_says_why(batches: int, steps: list[int], expected: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    target = Target(Path("loop.py"), ["{run}"], None, [], None, "loop.py")
    args = argparse.Namespace(nproc=2, steps=None, stop_at=None, checks="stop,save,world")
    with pytest.raises(MgpuError) as refused:
        check(target, args, RecordingRunner(reads(batches, steps), monkeypatch), tmp_path)  # type: ignore[arg-type]
    assert expected in str(refused.value) and "\n" not in str(refused.value)
