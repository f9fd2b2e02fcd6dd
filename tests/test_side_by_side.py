"""bench/gpu/side_by_side.py at CI size: the own loop on a tiny GPT on the CPU, with and without periodic saves,
gives a row each with a step time, the saves' blocked and write times and the disk's bandwidth."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu.side_by_side import main


@pytest.mark.multiprocess
def test_the_side_by_side_runs_tiny_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "side_by_side.json"
    assert main(["--size", "tiny", "--cpu", "--steps", "8", "--warmup", "2", "--every", "4", "--forms", "own",
                 "--disk-mb", "4", "--dir", str(tmp_path), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(row["form"], row["every"], row["error"]) for row in rows] == [("own", 0, ""), ("own", 4, "")], rows
    without, with_saves = rows
    assert without["ms_step"] > 0 and without["saves"] == 0 and with_saves["saves"] == 2
    assert with_saves["blocked_s"] >= 0 and with_saves["write_s"] > 0 and with_saves["disk_gb_s"] > 0
    # the cost of the saves: over the run without, and less the time they held the loop (spread over 6 steps)
    assert with_saves["vs_none"] == round(with_saves["ms_step"] / without["ms_step"], 3)
    held_ms = with_saves["blocked_sum_s"] * 1e3 / 6
    assert with_saves["vs_none_less_held"] == round((with_saves["ms_step"] - held_ms) / without["ms_step"], 3)
    assert list(tmp_path.iterdir()) == [out]  # its checkpoints are removed


def test_an_unknown_form_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--forms", "own,deepspeed"]) == 2
    assert capsys.readouterr().err == ("side_by_side: unknown form(s) deepspeed (known: hand_ddp, lightning, trainer, "
                                       "own, hand_fsdp, trainer_fsdp, own_fsdp, trainer_sharded)\n")
