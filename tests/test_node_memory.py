"""Bad nodes remembered (issue 32, deliver 4): the run's ledger is the record of blamed nodes, with the evidence;
a node blamed in two attempts is excluded at the next submission, said in the submit output, one ledger line
per decision, reversible with --forget-node; status shows them. Tables, and jobs/submit.py --dry-run as a
process (it must not import torch)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from mgpu.record.exclusion import NodeMemory, blamed_nodes, remembered_nodes
from mgpu.record.ledger import Ledger, read_ledger
from mgpu.record.runview import describe
from tests.conftest import PYTHON, ROOT, base_env


def started(job: str, restart: int, *nodes: str) -> dict[str, Any]:
    return {"event": "started", "job_id": job, "restart": restart, "nodes": list(nodes)}


def hang(*hosts: str, step: int = 5) -> dict[str, Any]:
    return {"event": "hang", "ranks": [3], "hosts": list(hosts), "step": step, "job_id": "7", "restart": 0}


def failed(host: str, **extra: Any) -> dict[str, Any]:
    return {"event": "failed", "host": host, "error": "RuntimeError: CUDA error: an illegal memory access",
            "retry": True, **extra}


TWO = started("7", 0, "n1", "n2")
CASES = {
    "a hang on one node": ([TWO, hang("n2")], {"n2": 1}),
    "two hangs on it": ([TWO, hang("n2"), started("7", 1, "n1", "n2"), hang("n2", step=9)], {"n2": 2}),
    "a hang over two nodes blames neither": ([TWO, hang("n1", "n2")], {}),
    "a hang nobody was pinned for": ([TWO, {**hang("n2"), "ranks": []}], {}),
    "a failure on one node of two": ([TWO, failed("n2"), failed("n1", consequence=True)], {"n2": 1}),
    "the same failure on both: the code's": ([TWO, failed("n1"), failed("n2")], {}),
    "a one-node job's failure is not the node's": ([started("7", 0, "n1"), failed("n1")], {}),
    "bad input is nobody's node": ([TWO, failed("n2", retry=False)], {}),
    "failures in two attempts": ([TWO, failed("n2"), started("7", 1, "n1", "n2"), failed("n2")], {"n2": 2}),
    "forgotten: counted afresh": ([TWO, hang("n2"), hang("n2"), {"event": "node_decision", "node": "n2",
                                                                  "decision": "forgotten"}, hang("n2")], {"n2": 1}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_blamed_nodes(name: str) -> None:
    events, counts = CASES[name]
    assert {node: b.count for node, b in blamed_nodes(events).items()} == counts


def test_twice_blamed_is_remembered_unless_forgotten() -> None:
    events = CASES["two hangs on it"][0]
    assert list(remembered_nodes(events)) == ["n2"] and remembered_nodes(events, forget=["n2"]) == {}
    assert remembered_nodes(CASES["a hang on one node"][0]) == {}


def write_run(run: Path, events: list[dict[str, Any]]) -> None:
    run.mkdir(parents=True)
    with (run / "events.jsonl").open("w") as file:
        for i, event in enumerate(events):
            file.write(json.dumps({"time": 1000.0 + i, "job_id": "7", "restart": 0, **event}) + "\n")


def test_each_decision_is_one_ledger_line_and_forgetting_reverses_it(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r"
    write_run(run, CASES["two hangs on it"][0])
    memory = NodeMemory.read([run], forget=[])
    assert memory.merged_exclude("gpu[01-02]") == "gpu[01-02],n2" and memory.merged_exclude(None) == "n2"
    (line,) = memory.lines()
    assert line.startswith(f"excluding n2: blamed in 2 attempts of run {run} (hang: ranks [3] stuck after step 5")
    memory.record()
    (decision,) = [e for e in read_ledger(run / "events.jsonl") if e["event"] == "node_decision"]
    assert (decision["node"], decision["decision"], decision["blames"]) == ("n2", "excluded", 2)
    forgotten = NodeMemory.read([run], forget=["n2"])
    assert forgotten.excluded == [] and forgotten.lines() == [f"forgetting n2's blames in run {run} (--forget-node): "
                                                              "it may be used again"]
    forgotten.record()
    assert NodeMemory.read([run], forget=[]).excluded == []  # cleared: its blames count afresh
    lines = describe(run, now=2000.0)
    assert any(line.startswith("node        n2 forgotten at a submission") for line in lines), lines


def test_status_shows_the_blamed_nodes(tmp_path: Path) -> None:
    run = tmp_path / "r"
    write_run(run, CASES["two hangs on it"][0])
    lines = describe(run, now=2000.0)
    assert any(line.startswith("bad node    n2: blamed 2x (hang: ranks [3] stuck after step 9") and
               "excluded at the next submission (--forget-node n2 clears it)" in line for line in lines), lines


def test_a_dry_run_excludes_a_twice_blamed_node_says_so_and_changes_nothing(tmp_path: Path) -> None:
    from tests.test_submission import NO_TORCH, SUBMIT

    run = tmp_path / "runs" / "r"
    write_run(run, CASES["two hangs on it"][0])
    before = (run / "events.jsonl").read_bytes()
    argv = [PYTHON, "-c", NO_TORCH, SUBMIT, "--folder", str(tmp_path / "runs"), "run.name=r", "--dry-run",
            "--cluster", "slurm", "--gpus-per-node", "0", "--exclude", "n9"]
    result = subprocess.run(argv, cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=120)
    assert "heavy=[]" in result.stderr and "CHECK code=0" in result.stderr, result.stderr[-3000:]
    assert "#SBATCH --exclude=n9,n2" in result.stdout, result.stdout
    assert "# excluding n2: blamed in 2 attempts" in result.stderr and "(dry run: not recorded)" in result.stderr
    assert (run / "events.jsonl").read_bytes() == before
    forgot = subprocess.run([*argv, "--forget-node", "n2"], cwd=ROOT, env=base_env(), capture_output=True, text=True,
                            timeout=120)
    assert "#SBATCH --exclude=n9\n" in forgot.stdout, forgot.stdout
    bad = subprocess.run([*argv, "--forget-node", "n2;rm"], cwd=ROOT, env=base_env(), capture_output=True, text=True,
                         timeout=120)
    assert "CHECK code=2" in bad.stderr and "submit: error: --forget-node 'n2;rm': give one node's name" in bad.stderr
