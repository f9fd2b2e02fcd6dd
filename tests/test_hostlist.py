"""Slurm node-list and task-count grammar, table-driven; checked against scontrol where installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mgpu.cluster.hostlist import MAX_HOSTS, MAX_RANGE, HostlistError, expand_hostlist, expand_tasks_per_node

HOSTLISTS: list[tuple[str, list[str]]] = [
    ("n1", ["n1"]),
    ("n1,n2", ["n1", "n2"]),
    ("n[1-2]", ["n1", "n2"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[001-003]", ["n001", "n002", "n003"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("n[1,3,5]", ["n1", "n3", "n5"]),
    ("n[1-2,5-6]", ["n1", "n2", "n5", "n6"]),
    ("n[5]", ["n5"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a[1-3,7],b-x,c[09-11]", ["a1", "a2", "a3", "a7", "b-x", "c09", "c10", "c11"]),
    ("gpu-a[001-002,010],gpu-b07", ["gpu-a001", "gpu-a002", "gpu-a010", "gpu-b07"]),
    ("node-1,node-2", ["node-1", "node-2"]),
    ("host.example.com", ["host.example.com"]),
    # Three or more groups: the last varies fastest, then the first, then the second (Slurm's order).
    ("x[0-1]y[0-1]z[0-1]", ["x0y0z0", "x0y0z1", "x1y0z0", "x1y0z1", "x0y1z0", "x0y1z1", "x1y1z0", "x1y1z1"]),
    ("a[1-2]b[1-2]c[1-2]d[1]", ["a1b1c1d1", "a2b1c1d1", "a1b2c1d1", "a2b2c1d1", "a1b1c2d1", "a2b1c2d1",
                                "a1b2c2d1", "a2b2c2d1"]),
    ("a[1-2]b[3,5]", ["a1b3", "a1b5", "a2b3", "a2b5"]),
    ("n[1-2]-[3-4]", ["n1-3", "n1-4", "n2-3", "n2-4"]),
    ("n[1-2]-ib[3-4]", ["n1-ib3", "n1-ib4", "n2-ib3", "n2-ib4"]),
    ("n[1-2],m[3-4]", ["n1", "n2", "m3", "m4"]),
    ("n2,n1", ["n2", "n1"]),
    ("n[10-10]", ["n10"]),
    ("[1-3]", ["1", "2", "3"]),
    ("cn[0-1],gpu01", ["cn0", "cn1", "gpu01"]),
    ("a-b-c[1-2]", ["a-b-c1", "a-b-c2"]),
    ("n[0000-0002]", ["n0000", "n0001", "n0002"]),
    ("node[7-9,10-11]", ["node7", "node8", "node9", "node10", "node11"]),
]

# Slurm 22.05 rejects text after the last bracket group ("Invalid hostlist: n[01-02]-ib").
SUFFIXED = ["n[01-02]-ib", "n[1-2].cluster", "p[1-2]q", "n[1-2]-ib,n[3-4]-ib"]
BAD_HOSTLISTS = ["", "n[1-2", "n1-2]", "n[a-b]", "n[3-1]", "n[[1]]", "n1,,n2", "n[]", *SUFFIXED]

TASKS: list[tuple[str, list[int]]] = [
    ("1", [1]),
    ("4", [4]),
    ("2(x3)", [2, 2, 2]),
    ("2(x3),1", [2, 2, 2, 1]),
    ("1,2,3", [1, 2, 3]),
    ("8(x2),4(x1)", [8, 8, 4]),
]


@pytest.mark.parametrize("text, expected", HOSTLISTS)
def test_expand_hostlist(text: str, expected: list[str]) -> None:
    assert expand_hostlist(text) == expected


@pytest.mark.parametrize("text", BAD_HOSTLISTS)
def test_bad_hostlist_is_rejected(text: str) -> None:
    with pytest.raises(HostlistError):
        expand_hostlist(text)


@pytest.mark.parametrize("text, expected", TASKS)
def test_expand_tasks_per_node(text: str, expected: list[int]) -> None:
    assert expand_tasks_per_node(text) == expected


@pytest.mark.parametrize("text", ["", "2(x)", "x2", "2(3)", "-1"])
def test_bad_tasks_per_node_is_rejected(text: str) -> None:
    with pytest.raises(HostlistError):
        expand_tasks_per_node(text)


# Each would need gigabytes (or int() of a 5000-digit number) if expanded: refused before anything is built.
ROOT = Path(__file__).resolve().parent.parent
TOO_LARGE: list[tuple[str, str]] = [
    ("n[0-99999999999]", "too many hosts in range"),
    ("n[0-65536]", "too many hosts in range '0-65536'"),  # one more than Slurm allows in a range
    ("n[1-" + "9" * 5000 + "]", "bad range"),
    ("n[1-60000,1-60000]", f"more than {MAX_HOSTS} hosts"),
    ("a[1-1000]b[1-1000]", f"more than {MAX_HOSTS} hosts"),
    ("a[1-400]b[1-400]c[1-400]", f"more than {MAX_HOSTS} hosts"),
    ("n[1-60000],m[1-60000]", f"more than {MAX_HOSTS} hosts"),
]
TOO_MANY_TASKS = ["1(x99999999999)", "2(x60000),2(x60000)", "9" * 5000, "1(x" + "9" * 5000 + ")"]


# Run in a child limited to 1 GiB of address space: a parser that did expand these would fill the
# machine's memory within seconds, not merely fail.
LIMITED = """\
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from mgpu.cluster.hostlist import HostlistError, expand_hostlist, expand_tasks_per_node
try:
    (expand_tasks_per_node if sys.argv[1] == "tasks" else expand_hostlist)(sys.argv[2])
except HostlistError as error:
    print(error)
"""


def expand_limited(kind: str, text: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", LIMITED, kind, text], capture_output=True, text=True, timeout=20,
                            env=env)
    assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]
    return result.stdout


@pytest.mark.parametrize("text, message", TOO_LARGE)
def test_huge_hostlist_is_refused_quickly(text: str, message: str) -> None:
    assert message in expand_limited("hosts", text)


def test_largest_lists_still_expand() -> None:
    assert len(expand_hostlist(f"n[1-{MAX_RANGE}]")) == MAX_RANGE
    assert len(expand_hostlist("a[1-250]b[1-400]")) == MAX_HOSTS
    assert len(expand_tasks_per_node(f"1(x{MAX_HOSTS})")) == MAX_HOSTS


@pytest.mark.parametrize("text", TOO_MANY_TASKS)
def test_huge_task_counts_are_refused_quickly(text: str) -> None:
    assert "task count" in expand_limited("tasks", text)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="Slurm's scontrol is not installed")
def test_range_limit_matches_scontrol() -> None:
    for text, ok in ((f"n[1-{MAX_RANGE}]", True), (f"n[1-{MAX_RANGE + 1}]", False)):
        out = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True, timeout=30)
        assert ("Too many hosts in range" not in out.stdout + out.stderr) == ok, text


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="Slurm's scontrol is not installed")
@pytest.mark.parametrize("text, expected", HOSTLISTS)
def test_matches_scontrol(text: str, expected: list[str]) -> None:
    out = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == expand_hostlist(text)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="Slurm's scontrol is not installed")
@pytest.mark.parametrize("text", SUFFIXED)
def test_scontrol_also_rejects(text: str) -> None:
    out = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True, timeout=30)
    assert "Invalid hostlist" in out.stdout + out.stderr
