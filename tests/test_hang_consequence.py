"""mgpu.train.job: a rank whose collective failed because the watchdog ended a hung peer exits as part of that hang
(its one line names the hang; exit 4, as the hung rank's), not as a failure of its own task code."""

from __future__ import annotations

from pathlib import Path

import pytest

from mgpu.cluster.environment import detect_environment
from mgpu.config.loading import Config, config_from_dict
from mgpu.record.ledger import Ledger
from mgpu.record.rundir import RunDir
from mgpu.train.job import hang_behind, hang_note

CLOSED = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:27060. This is "
                      "typically caused by a remote worker crashing.")


def _config(tmp_path: Path) -> Config:
    return config_from_dict({"run": {"dir": str(tmp_path / "run")}})


def _hang(cfg: Config, job_id: str, restart: int) -> None:
    RunDir.of(cfg.run).path.mkdir(parents=True, exist_ok=True)
    Ledger(RunDir.of(cfg.run).ledger, job_id, restart).write(
        "hang", ranks=[1], hosts={"1": "n1"}, step=8, phases={"0": "forward", "1": "forward"})


@pytest.mark.parametrize("error, hung, attempt, expected", [
    (CLOSED, True, "this", True),                          # the race CI saw: rank 0's broadcast, rank 1 hung
    (CLOSED, False, "this", False),                        # a peer gone without a hang: a failure as before
    (ValueError("loss is nan"), True, "this", False),      # an error of the rank's own, whatever else happened
    (CLOSED, True, "an earlier restart", False),           # a hang of another attempt says nothing of this one
])
def test_a_collective_that_failed_behind_a_peers_hang_is_that_hang(error: BaseException, hung: bool,
                                                                   attempt: str, expected: bool,
                                                                   tmp_path: Path) -> None:
    cfg, env = _config(tmp_path), detect_environment()
    if hung:
        _hang(cfg, env.job_id, env.restart_count if attempt == "this" else env.restart_count + 1)
    found = hang_behind(error, cfg, env)
    assert (found is not None) == expected
    if found is not None:
        note = hang_note(found, 4)
        assert note.startswith("rank 1 in forward hung after step 8") and "exit 4" in note
        assert "\n" not in note


def test_a_ledger_that_cannot_be_read_is_no_hang(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    RunDir.of(cfg.run).path.mkdir(parents=True)
    RunDir.of(cfg.run).ledger.mkdir()  # a directory where the ledger should be: unreadable
    assert hang_behind(CLOSED, cfg, detect_environment()) is None


def test_the_rank_exits_4_with_one_line_naming_the_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from mgpu.train import job

    cfg, env = _config(tmp_path), detect_environment()
    _hang(cfg, env.job_id, env.restart_count)

    def broadcast_fails(*args: object, **kwargs: object) -> None:
        raise CLOSED

    monkeypatch.setattr(job, "run_job", broadcast_fails)
    assert job.cli_exit_code(lambda: cfg, None, "train") == 4
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("train: rank 1 in forward hung after step 8") and "task's code" in last
