"""A training loop of the user's own on mgpu.Session, on real gloo ranks: stopped by a real signal at a
chosen moment (mid-epoch, at the end of an epoch, while a save is being written), resumed, and compared
bit for bit with an unbroken run; the shipped examples (jobs/loops) the same way, through mgpu.spawn too;
and the size of the change from the plain DDP loops they were converted from."""

from __future__ import annotations

import difflib
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest

from mgpu.state.single.store import CheckpointStore
from mgpu.record.goodput import segments
from mgpu.record.ledger import read_ledger
from mgpu.record.timeline import loss_curves
from tests.conftest import PYTHON, ROOT, base_env, live_children, start_ranks, wait_ranks
from tests.test_trainer import assert_identical as same

OWN_LOOP = str(ROOT / "tests" / "own_loop.py")
EXAMPLE = ROOT / "jobs" / "loops" / "mnist_loop.py"
ORIGINAL = ROOT / "jobs" / "loops" / "mnist_ddp.py"

pytestmark = pytest.mark.multiprocess


def run_ranks(argv: list[str], world: int = 2) -> list[tuple[int, str]]:
    return wait_ranks(start_ranks(argv, world), timeout=240)


def signal_when(procs: list[subprocess.Popen[str]], marker: Path, signum: int, timeout: float = 180) -> None:
    """Send `signum` to the ranks' process group as soon as `marker` exists."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise AssertionError(f"{marker.name} never appeared: {wait_ranks(procs)}")
        time.sleep(0.02)
    os.killpg(procs[0].pid, signum)


def final_state(run_dir: Path) -> dict:
    latest = CheckpointStore(run_dir / "checkpoints").latest()
    assert latest is not None and not latest.skipped
    return latest.state


def assert_identical(a: dict, b: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        same(a[key], b[key], key)


def stop_steps(run_dir: Path) -> list[int]:
    return [e["step"] for e in read_ledger(run_dir / "events.jsonl") if e["event"] == "preempted"]


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "jobs/status.py", *args], env=base_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], tuple[Path, dict]]:
    """`unbroken(workers)`: the run directory and final state of the loop run without a stop, trained once per
    worker count."""
    runs: dict[int, tuple[Path, dict]] = {}

    def reference(workers: int) -> tuple[Path, dict]:
        if workers not in runs:
            run_dir = tmp_path_factory.mktemp(f"unbroken-workers{workers}") / "run"
            results = run_ranks([OWN_LOOP, str(run_dir), f"--workers={workers}", "--agree-every=1", "--ballast-mb=30"])
            assert [rc for rc, _ in results] == [0, 0], results
            runs[workers] = run_dir, final_state(run_dir)
        return runs[workers]

    return reference


# 6 optimizer steps an epoch, a save every 4 steps, the agreement every step: SIGTERM sent right after the
# optimizer step K is agreed at the step boundary K and the ranks stop at K + 1. Every moment once, both
# worker counts among them (as the fault matrix's CI subset draws them): 3 stops and resumes, not 6.
@pytest.mark.parametrize("moment, signal_at, ballast_mb, workers", [
    ("mid-epoch", 2, 0, 2),
    ("epoch end", 5, 0, 0),  # stops at 6, the first epoch's last step, before its evaluation
    ("during a save", 8, 30, 2),  # step 8's background write of 30 MB of ballast is in flight
])
def test_a_users_loop_stops_on_a_signal_and_resumes_bit_identically(
        unbroken: Callable[[int], tuple[Path, dict]], moment: str, signal_at: int, ballast_mb: int, workers: int,
        tmp_path: Path) -> None:
    reference_dir, reference = unbroken(workers)
    run_dir = tmp_path / "run"
    args = [OWN_LOOP, str(run_dir), f"--workers={workers}", "--agree-every=1", f"--ballast-mb={ballast_mb}"]
    results = run_ranks([*args, f"--signal-at={signal_at}"])
    outputs = "\n".join(out for _, out in results)
    assert [rc for rc, _ in results] == [3, 0], outputs[-3000:]  # stopped (not a Slurm job): rank 0 says so
    assert "DataLoader worker" not in outputs and "Traceback" not in outputs, outputs[-3000:]
    assert stop_steps(run_dir) == [signal_at + 1], outputs[-2000:]
    stopped_at = final_state(run_dir)["loader"]
    assert stopped_at != reference["loader"]
    resumed = run_ranks(args)
    assert [rc for rc, _ in resumed] == [0, 0], resumed
    # One line says where it resumed (the loader's epoch and sample) and from which checkpoint.
    assert re.search(rf"resumed at step {signal_at + 1} \(epoch {stopped_at['epoch']}, sample "
                     rf"{stopped_at['position']}\) from \S+/checkpoints/step_0*{signal_at + 1} on 2 ranks$",
                     resumed[0][1], re.M), resumed[0][1][-2000:]
    (event,) = [e for e in read_ledger(run_dir / "events.jsonl") if e["event"] == "resumed"]
    assert {"epoch": event["epoch"], "position": event["position"]} == stopped_at, event
    assert_identical(final_state(run_dir), reference, ("model", "optimizer", "scheduler", "loader", "best", "bad_evals"))
    # What session.log wrote (every 2nd step): status shows the loop's epoch and metrics, a loss curve for both
    # segments, and --verify finds the same weights as the unbroken run's at every step both logged.
    shown = status(str(run_dir))
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^progress    step 12, epoch 1;", shown.stdout, re.M), shown.stdout
    assert re.search(r"^metrics     step 12: loss \S+, lr 0.02$", shown.stdout, re.M), shown.stdout
    assert len(loss_curves(segments(read_ledger(run_dir / "events.jsonl")))) == 2
    verdict = status("--verify", str(reference_dir), str(run_dir))
    assert verdict.returncode == 0, verdict.stdout + verdict.stderr
    assert re.fullmatch(r"agree: the same weights at all [56] steps both runs logged \(2\.\.12\)\n", verdict.stdout)


def test_the_shipped_example_resumes_bit_identically(tmp_path: Path) -> None:
    args = ["--train-size=640", "--batch-size=16", "--epochs=2", "--workers=2"]
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    results = run_ranks([str(EXAMPLE), f"--out={reference_dir}", *args])
    assert [rc for rc, _ in results] == [0, 0], results
    procs = start_ranks([str(EXAMPLE), f"--out={run_dir}", *args], 2)
    # The first epoch's checkpoint (step 20 of 40) is there: stop during the second epoch.
    signal_when(procs, run_dir / "checkpoints" / "latest", signal.SIGTERM)
    results = wait_ranks(procs, timeout=240)
    assert [rc for rc, _ in results] == [3, 0], results
    (stopped,) = stop_steps(run_dir)
    assert 20 <= stopped < 40, stopped
    results = run_ranks([str(EXAMPLE), f"--out={run_dir}", *args])
    assert [rc for rc, _ in results] == [0, 0], results
    assert "accuracy" in results[0][1]
    assert_identical(final_state(run_dir), final_state(reference_dir), ("model", "optimizer", "scheduler", "loader"))
    verdict = status("--verify", str(reference_dir), str(run_dir))  # its session.log line, every 10 steps
    assert verdict.returncode == 0 and verdict.stdout.startswith("agree: "), verdict.stdout + verdict.stderr


def changed_lines(before: Path, after: Path) -> tuple[int, int]:
    """(lines added or changed, lines removed) from `before` to `after`, module docstrings left out."""
    def body(path: Path) -> list[str]:
        text = path.read_text()
        return text[text.index('"""', 3) + 3:].splitlines()

    diff = list(difflib.unified_diff(body(before), body(after), lineterm="", n=0))
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in diff if line.startswith("-") and not line.startswith("---")]
    return len(added), len(removed)


def test_converting_a_ddp_loop_changes_at_most_15_lines() -> None:
    added, removed = changed_lines(ORIGINAL, EXAMPLE)
    assert added <= 15, (added, removed)
    readme = (ROOT / "docs" / "own-loop.md").read_text()
    assert re.search(rf"\b{added} lines? added or changed, {removed} removed\b", readme), (added, removed)


TRANSLATE = ROOT / "jobs" / "loops" / "translate_loop.py"


TRANSLATE_ARGS = ["--nprocs=2", "--epochs=6", "--train-size=400"]


@pytest.fixture(scope="module")
def translate_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The converted spawn loop's final state, run without a stop."""
    run_dir = tmp_path_factory.mktemp("translate-reference") / "run"
    result = subprocess.run([PYTHON, str(TRANSLATE), *TRANSLATE_ARGS, f"--out={run_dir}"], env=base_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return final_state(run_dir)


# Ctrl-C to mgpu.spawn's process group: the launch matrix's spawn cells (tests/test_launch_matrix.py).
@pytest.mark.parametrize("signum", [signal.SIGTERM], ids=["SIGTERM to the parent"])
def test_spawned_ranks_stop_together_and_leave_no_orphan(signum: int, translate_reference: dict,
                                                         tmp_path: Path) -> None:
    # mgpu.spawn, as the converted mp.spawn loop uses it: a SIGTERM to the spawning process alone is passed on
    # to the ranks; Ctrl-C (SIGINT to the whole process group, as a terminal sends it) reaches them directly.
    # Resumed, it ends as the run that was never stopped.
    run_dir = tmp_path / "run"
    args = [PYTHON, str(TRANSLATE), *TRANSLATE_ARGS, f"--out={run_dir}"]
    proc = subprocess.Popen(args, env=base_env(), cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "latest").exists():  # the first epoch's checkpoint (step 3 of 18)
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        children = live_children(proc.pid)  # the ranks, and multiprocessing's resource tracker
        ranks = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(ranks) == 2, children
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 3, out[-3000:]  # stopped and saved (not a Slurm job): the command resumes it
    assert "to resume:" in out and "Traceback" not in out, out[-3000:]
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()], "a rank outlived mgpu.spawn"
    deadline = time.monotonic() + 10  # the tracker leaves once its pipe from the spawning process closes
    while [pid for pid in children if Path(f"/proc/{pid}").exists()] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()], "a child outlived mgpu.spawn"
    (stopped,) = stop_steps(run_dir)
    assert 3 <= stopped < 18  # the ranks agree about once a second: well before the last step
    assert not [e for e in read_ledger(run_dir / "events.jsonl") if e["event"] == "finished"]
    resumed = subprocess.run(args, env=base_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert final_state(run_dir)["loader"] == {"epoch": 6, "position": 0}
    assert_identical(final_state(run_dir), translate_reference, ("model", "optimizer", "scheduler", "loader", "early"))


def test_converting_the_spawn_loop_changes_a_few_lines() -> None:
    added, removed = changed_lines(ROOT / "jobs" / "loops" / "translate_spawn.py", TRANSLATE)
    assert added <= 17, (added, removed)  # early stopping saves its state with the model: 3 lines of it
    assert re.search(rf"\b{added} lines? added or changed, {removed} removed\b", (ROOT / "docs" / "own-loop.md").read_text())


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["optimizer_before_wrap", "diverged"])
def test_a_misuse_every_rank_makes_is_one_line_from_one_rank(case: str, tmp_path: Path) -> None:
    """tests/misuse_loop.py on 2 ranks, under FSDP2: an optimizer built before `wrap(parallel="fsdp")` is refused at
    `load()`; a plain module beside the model whose copies differ between ranks (each rank's own init, seed + rank)
    is refused at its first `save()` (a sharded checkpoint would keep one rank's copy, silently). Each is one line
    `mgpu: error: ...` from rank 0, nothing from rank 1, exit 2 on both: no traceback."""
    results = wait_ranks(start_ranks(["tests/misuse_loop.py", str(tmp_path / "run"), "--case", case], 2), 120)
    assert [rc for rc, _ in results] == [2, 2], results
    (line,) = [x for x in results[0][1].splitlines() if "mgpu" in x and "error" in x]
    assert line.startswith("mgpu: error: " + ("state['optimizer'] optimizes 4 parameter(s) that are not the state's "
                                              "models' parameters now" if case == "optimizer_before_wrap" else
                                              "not saved: state['teacher']: its weights differ between ranks (rank(s) "
                                              "[1] are not rank 0's)")), results[0][1]
    assert "Traceback" not in results[0][1] + results[1][1] and results[1][1] == "", results
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*")), "a checkpoint was written"
