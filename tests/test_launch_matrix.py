"""The launch matrix's local cells (tests/launch_matrix.py): the trainer or a loop of one's own with 2 DataLoader
workers, started by torchrun, `python -m mgpu.run.spawn` or `jobs/submit.py --cluster local`, its workers started
by fork, spawn or forkserver; stopped mid-epoch by a signal as its user sends it; the same command again; the
final state bit-identical to an unbroken run's (one per program: plain env:// ranks, forked workers). Each run's
output has no traceback of mgpu's and no worker killed; no process outlives its launcher. CI runs a covering
subset; `python tests/launch_matrix.py` every cell."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from mgpu.record.ledger import read_ledger
from tests.conftest import PYTHON, ROOT, base_env, start_ranks, wait_ranks
from tests.launch_matrix import Cell, selected
from tests.test_trainer import assert_identical

pytestmark = pytest.mark.multiprocess

TORCHRUN = str(Path(PYTHON).parent / "torchrun")
# The trainer: 2 ranks x 2 samples of 40 -> 10 steps an epoch, 3 epochs; dropout, batch norm, warmup + cosine.
TRAINER = ["task.target=tests.tasks:SlowBlobTask", "task.args.step_s=0.2", "train.epochs=3", "data.batch_size=2",
           "log.every_steps=1", "checkpoint.every_steps=2", "schedule.name=cosine", "schedule.warmup_steps=3",
           "optim.lr=0.01", "data.num_workers=2", "preemption.check_every_steps=1"]
# The loop (tests/own_loop.py): 6 steps an epoch, 3 epochs, the ranks agree every step.
LOOP = ["--workers=2", "--epochs=3", "--agree-every=1"]
STEPS_PER_EPOCH = {"trainer": 10, "loop": 6}
SIGNAL_AFTER = {"trainer": 12, "loop": 7}
"""The step after which the stop is sent: early in the second epoch, so that it lands mid-epoch."""
KEYS = {"trainer": ("model", "optimizer", "scheduler", "progress"),
        "loop": ("model", "optimizer", "scheduler", "loader", "best", "bad_evals")}


def program_args(cell: Cell, run_dir: Path, paced: bool) -> list[str]:
    """The script and its arguments (a launcher's command goes before them)."""
    if cell.program == "trainer":
        method = [] if cell.start_method == "default" else [f"data.worker_start_method={cell.start_method}"]
        return [str(ROOT / "jobs" / "train.py"), f"run.dir={run_dir}", *TRAINER, *method]
    method = [] if cell.start_method == "default" else [f"--start-method={cell.start_method}"]
    return [str(ROOT / "tests" / "own_loop.py"), str(run_dir), *LOOP, *(["--step-s=0.15"] if paced else []), *method]


def command(cell: Cell, run_dir: Path, port: int) -> list[str]:
    if cell.launcher == "submit-local":  # the run directory: <folder>/<run.name>
        args = program_args(cell, run_dir, True)[2:]
        return [PYTHON, str(ROOT / "jobs" / "submit.py"), "--cluster", "local", "--gpus-per-node", "2", "--folder",
                str(run_dir.parent), f"run.name={run_dir.name}", *[a for a in args if not a.startswith("run.")]]
    if cell.launcher == "torchrun":
        return [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(port), *program_args(cell, run_dir, True)]
    assert cell.launcher == "spawn", cell
    return [PYTHON, "-m", "mgpu.run.spawn", "-n", "2", *program_args(cell, run_dir, True)]


def checkpoint_state(run_dir: Path) -> dict[str, Any]:
    from mgpu.state.single.store import CheckpointStore

    latest = CheckpointStore(run_dir / "checkpoints").latest()
    assert latest is not None and not latest.skipped, run_dir
    return latest.state


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Any]]:
    """`unbroken(program)`: the final state of the program run without a stop on 2 plain env:// ranks, its workers
    forked (Python's default here), trained once per program."""
    states: dict[str, dict[str, Any]] = {}

    def reference(program: str) -> dict[str, Any]:
        if program not in states:
            run_dir = tmp_path_factory.mktemp(f"unbroken-{program}") / "run"
            results = wait_ranks(start_ranks(program_args(Cell(program, "", "default", ""), run_dir, False), 2),
                                 timeout=300)
            assert [rc for rc, _ in results] == [0, 0], results
            states[program] = checkpoint_state(run_dir)
        return states[program]

    return reference


def progress_at_least(run_dir: Path, step: int) -> bool:
    return any(e["event"] == "progress" and e["step"] >= step for e in read_ledger(run_dir / "events.jsonl"))


def stop_mid_epoch(cell: Cell, proc: subprocess.Popen[str], run_dir: Path) -> str:
    """Wait until the run trains its second epoch, send the cell's signal, and return the launcher's output."""
    after = SIGNAL_AFTER[cell.program]
    deadline = time.monotonic() + 240
    while not progress_at_least(run_dir, after):
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.communicate()[0] if proc.poll() is not None else ""
            raise AssertionError(f"{cell.id}: no step {after} (rc {proc.poll()})\n{out[-4000:]}")
        time.sleep(0.05)
    if cell.signal == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)  # to the launcher alone
    try:
        return proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def left_in_session(sid: int, grace_s: float = 10.0) -> list[str]:
    """The processes still in the launcher's session (ranks, workers, a forkserver, multiprocessing's resource
    tracker) `grace_s` after it exited: none may be."""
    deadline = time.monotonic() + grace_s
    while True:
        left = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":
                    left.append(f"{stat.parent.name} {(stat.parent / 'cmdline').read_bytes()[:200]!r}")
            except (OSError, IndexError, ValueError):
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def mgpu_trouble(out: str) -> list[str]:
    """Lines of a run's output that say something went wrong on mgpu's side: a traceback (torchrun's own report
    of its agent's SIGTERM or SIGINT aside: `SignalException`, torchrun's way), a worker killed, failing or forked
    again."""
    bad = []
    for block in re.split(r"(?=^Traceback \(most recent call last\):$)", out, flags=re.M)[1:]:
        if "torch.distributed.elastic.multiprocessing.api.SignalException" not in block:
            bad.append(block[:3000])
    bad += [line for line in out.splitlines()
            if re.search(r"DataLoader worker \(pid|had not reached Python|DataLoader workers did not start", line)]
    return bad


@pytest.mark.parametrize("cell", [c for c in selected() if c.launcher != "srun"], ids=lambda c: c.id)
def test_a_stop_mid_epoch_with_workers_resumes_bit_identically(cell: Cell, unbroken: Callable[[str], dict[str, Any]],
                                                               tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "run"
    port = 29300 + os.getpid() % 600
    cmd = command(cell, run_dir, port)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=base_env(PYTHONFAULTHANDLER="1"), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = stop_mid_epoch(cell, proc, run_dir)
    assert not mgpu_trouble(out), "\n".join(mgpu_trouble(out))
    events = read_ledger(run_dir / "events.jsonl")
    (stopped,) = [e for e in events if e["event"] == "preempted"]
    assert stopped["step"] % STEPS_PER_EPOCH[cell.program], f"{cell.id}: stopped at {stopped['step']}, an epoch's end"
    assert stopped["step"] in {e["step"] for e in events if e["event"] == "checkpoint_saved"}
    assert stopped["reasons"] == (["interrupt"] if cell.signal == "ctrl-c" else ["sigterm"]), stopped
    if cell.launcher != "torchrun":  # torchrun ends its agent's signal with its own code (1) and report
        assert proc.returncode == 3, out[-3000:]  # stopped and saved, not a Slurm job: the same command resumes
        resume = re.search(r"to resume: (.+)$", out, re.M)
        launched = {"submit-local": "jobs/submit.py --cluster local", "spawn": "-m mgpu.run.spawn -n 2"}
        assert resume and launched[cell.launcher] in resume[1], out[-3000:]  # the command that started it
    assert not left_in_session(proc.pid), f"{cell.id}: processes outlived the launcher: {left_in_session(proc.pid)}"
    again = subprocess.run(cmd, cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert not mgpu_trouble(again.stdout + again.stderr), "\n".join(mgpu_trouble(again.stdout + again.stderr))
    resumed = [e["step"] for e in read_ledger(run_dir / "events.jsonl") if e["event"] == "resumed"]
    assert resumed == [stopped["step"]], resumed  # no step lost
    state, reference = checkpoint_state(run_dir), unbroken(cell.program)
    for key in KEYS[cell.program]:
        assert_identical(state[key], reference[key], key)
