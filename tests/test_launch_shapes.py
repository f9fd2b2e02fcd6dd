"""Every launch shape users meet, on environments a real Slurm 22.05 and torchrun 2.13 produced.

`tests/fixtures/launch_envs/<shape>.json` holds the launcher variables of every process of one launch
(captured by `tests/fixtures/capture_launch_envs.py` on the local test cluster: nodes n1, n2, `gpu:2` each).
Each shape must give the right answer on every rank, or the same one-line refusal on every rank, naming
a variable that is actually set and the fix.
"""

from __future__ import annotations

import copy
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from mgpu.cluster.environment import ProcessEnv, derive_master_port, detect_environment
from mgpu.errors import MgpuError

FIXTURES = Path(__file__).parent / "fixtures" / "launch_envs"


@dataclass(frozen=True)
class Runs:
    """The answer every rank of each world must get. Tuples are indexed by node rank."""

    world_size: int
    nodes: tuple[str, ...]
    local_world_sizes: tuple[int, ...]
    launcher: str = "slurm"
    master_addr: str = "n1"
    master_port: int | None = None
    """None: the port derived from the world's SLURM_JOB_ID."""
    array_tasks: tuple[int, ...] = ()
    """Array task ids: the job ids are `<sbatch's id>_<task>`."""
    restart_count: int = 0
    gpus_per_node: tuple[int | None, ...] | None = None


@dataclass(frozen=True)
class Refused:
    """Every process fails with this same one line (a substring of it)."""

    message: str


SRUN = "launch every task with srun"
UNSET = "unset RANK/LOCAL_RANK/WORLD_SIZE (mgpu reads Slurm's variables)"
EXPECTED: dict[str, Runs | Refused] = {
    # srun starts every task.
    "srun_per_task": Runs(4, ("n1", "n2"), (2, 2)),
    "srun_n_uneven": Runs(3, ("n1", "n2"), (2, 1)),
    "srun_n_only": Runs(2, ("n1",), (2,)),
    "ntasks_per_node_gpus": Runs(4, ("n1", "n2"), (2, 2), gpus_per_node=(2, 2)),
    "gpus_per_task": Runs(4, ("n1", "n2"), (2, 2), gpus_per_node=(2, 2)),
    "gpus_per_task_uneven": Runs(3, ("n1", "n2"), (2, 1), gpus_per_node=(2, 1)),
    "uneven_gres": Refused("SLURM_STEP_TASKS_PER_NODE=2,1 but 2 GPUs per node requested: "
                           "submit with --ntasks-per-node=2 (one task per GPU)"),
    "too_few_tasks_for_gpus": Refused("SLURM_NTASKS_PER_NODE=1 but 2 GPUs per node requested: "
                                      "submit with --ntasks-per-node=2 (one task per GPU)"),
    "array": Runs(2, ("n1",), (2,), array_tasks=(0, 1)),
    "step_on_one_node": Runs(2, ("n1",), (2,)),
    "step_one_task_per_node": Runs(2, ("n1", "n2"), (1, 1)),
    "requeued": Runs(2, ("n1",), (2,), restart_count=1),
    # Python in the batch shell or in salloc's shell, without srun.
    "batch_shell_multi_task": Refused(f"running in the batch shell of a 4-task Slurm job (SLURM_NTASKS=4), "
                                      f"not in a task: {SRUN}"),
    "batch_shell_nodes_only": Refused(f"running in the batch shell of a 2-task Slurm job "
                                      f"(SLURM_TASKS_PER_NODE=1(x2)), not in a task: {SRUN}"),
    "batch_shell_one_task": Runs(1, ("n1",), (1,)),
    "salloc_no_srun": Refused(f"running in salloc's shell of a 4-task Slurm job (SLURM_NTASKS=4), "
                              f"not in a task: {SRUN}"),
    # salloc's shell runs where salloc was typed (the fixture's SLURM_SUBMIT_HOST), not on n1.
    "salloc_one_task": Runs(1, ("vm",), (1,), master_addr="vm"),
    "salloc_srun": Runs(4, ("n1", "n2"), (2, 2)),
    # torchrun, one agent per Slurm task.
    "torchrun_even": Runs(4, ("n1", "n2"), (2, 2), launcher="torchrun", master_port=29611),
    "torchrun_uneven": Runs(6, ("n1", "n2"), (4, 2), launcher="torchrun", master_port=29612),
    # Three agents on two machines: torchrun's nodes are not Slurm's, so the host list is unknown.
    "torchrun_1_2_3": Runs(6, (), (1, 2, 3), launcher="torchrun", master_port=29613),
    # RANK/LOCAL_RANK/WORLD_SIZE exported by hand: Slurm's own view wins where it can answer.
    "exported_before_srun": Runs(4, ("n1", "n2"), (2, 2), master_port=29614),
    "exported_inside_srun": Runs(4, ("n1", "n2"), (2, 2)),
    "exported_world_size_mismatch": Refused(f"WORLD_SIZE=4 but the Slurm step has 2 tasks "
                                            f"(SLURM_STEP_NUM_TASKS=2): {UNSET}"),
    # MASTER_ADDR / MASTER_PORT from the submitting shell.
    "leftover_master_localhost": Refused("MASTER_ADDR=localhost on a 2-node job would give every node a world "
                                         "of its own: unset MASTER_ADDR (the first node, n1, is used)"),
    "master_localhost_one_node": Runs(2, ("n1",), (2,), master_addr="localhost"),
    "user_master_port": Runs(2, ("n1", "n2"), (1, 1), master_port=29615),
}


def load(shape: str) -> dict[str, object]:
    return json.loads((FIXTURES / f"{shape}.json").read_text())


def test_every_fixture_has_an_expectation() -> None:
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(EXPECTED)


def _host(environ: dict[str, str]) -> str:
    """Where a process really runs: its node, or (salloc's shell) the host salloc was typed on."""
    return environ.get("SLURMD_NODENAME") or environ["SLURM_SUBMIT_HOST"]


def _machine(environ: dict[str, str]) -> tuple[str, ...]:
    """A node rank's identity: its host, and for a torchrun worker its agent (one Slurm task)."""
    if "TORCHELASTIC_RUN_ID" in environ:
        return _host(environ), environ["SLURM_PROCID"]
    return (_host(environ),)


def _check_world(shape: str, expected: Runs, job_id: str, world: list[dict[str, str]]) -> None:
    envs: list[ProcessEnv] = [detect_environment(environ) for environ in world]
    port = expected.master_port or derive_master_port(world[0]["SLURM_JOB_ID"])
    for env in envs:
        assert (env.launcher, env.world_size, env.num_nodes, env.nodes) == (
            expected.launcher, expected.world_size, len(expected.local_world_sizes), expected.nodes), shape
        assert (env.master_addr, env.master_port, env.job_id, env.restart_count) == (
            expected.master_addr, port, job_id, expected.restart_count), shape
        assert env.local_world_size == expected.local_world_sizes[env.node_rank], shape
        if expected.gpus_per_node is not None:
            assert env.gpus_per_node == expected.gpus_per_node[env.node_rank], shape
    assert len(world) == expected.world_size, shape
    assert sorted(env.rank for env in envs) == list(range(expected.world_size)), shape
    # A node rank is one machine (or torchrun agent), its local ranks count from 0, and it sits in `nodes`.
    by_node: dict[int, set[tuple[str, ...]]] = defaultdict(set)
    local_ranks: dict[int, list[int]] = defaultdict(list)
    for environ, env in zip(world, envs):
        by_node[env.node_rank].add(_machine(environ))
        local_ranks[env.node_rank].append(env.local_rank)
        if env.nodes:
            assert env.nodes[env.node_rank] == _host(environ), shape
    assert all(len(machines) == 1 for machines in by_node.values()), shape
    assert len(set().union(*by_node.values())) == len(by_node), shape
    for node_rank, ranks in local_ranks.items():
        assert sorted(ranks) == list(range(expected.local_world_sizes[node_rank])), shape


@pytest.mark.parametrize("shape", sorted(EXPECTED))
def test_launch_shape(shape: str) -> None:
    _check_shape(shape, load(shape), EXPECTED[shape])


def _check_shape(shape: str, fixture: dict[str, object], expected: Runs | Refused) -> None:
    processes: list[dict[str, str]] = fixture["processes"]  # type: ignore[assignment]
    if isinstance(expected, Refused):
        messages = []
        for environ in processes:
            with pytest.raises(MgpuError) as caught:
                detect_environment(environ)
            messages.append(str(caught.value))
        assert len(set(messages)) == 1, f"{shape}: ranks disagree: {messages}"
        message = messages[0]
        assert expected.message in message and "\n" not in message, message
        for name in re.findall(r"\b([A-Z][A-Z0-9_]+)=", message):
            assert all(f"{name}={environ[name]}" in message for environ in processes), f"{name} is not set as named"
        return
    # One world per Slurm job (an array task is a job of its own); ids as sbatch printed them.
    worlds: dict[str, list[dict[str, str]]] = defaultdict(list)
    for environ in processes:
        array_task = environ.get("SLURM_ARRAY_TASK_ID")
        worlds[f"{fixture['job_id']}_{array_task}" if array_task else str(fixture["job_id"])].append(environ)
    job_ids = [f"{fixture['job_id']}_{task}" for task in expected.array_tasks] or [str(fixture["job_id"])]
    assert sorted(worlds) == sorted(job_ids), shape
    for job_id, world in worlds.items():
        _check_world(shape, expected, job_id, world)


# ------------------------------------------------------------------ shapes derived from the captured ones
# Launches the test cluster cannot make as such (GPUs spread by --gpus=N, a batch shell without -n holding
# GPUs, a step whose task lists are missing): copies of real captured environments, changed only in the
# variables that launch sets differently. The fixtures themselves stay as Slurm wrote them.
Edit = Callable[[dict[str, str]], None]


def _gpus_spread_2_1(env: dict[str, str]) -> None:
    # sbatch -N2 --ntasks-per-node=2 --gpus=3: Slurm put 2 GPUs on n1 and 1 on n2.
    on_node = "2" if env["SLURMD_NODENAME"] == "n1" else "1"
    env.update(SLURM_GPUS="3", SLURM_GPUS_ON_NODE=on_node, SLURM_JOB_GPUS="0,1" if on_node == "2" else "0",
               SLURM_STEP_GPUS="0,1" if on_node == "2" else "0")


def _gpus_on_one_node(env: dict[str, str]) -> None:
    env.update(SLURM_GPUS="2", SLURM_GPUS_ON_NODE="2", SLURM_JOB_GPUS="0,1", SLURM_STEP_GPUS="0,1")


def _gpus_per_node_4(env: dict[str, str]) -> None:
    # srun -N2 -n4 (no --ntasks-per-node) in a --gpus-per-node=4 job: only the per-node task lists say 2.
    del env["SLURM_NTASKS_PER_NODE"]
    env.update(SLURM_GPUS_PER_NODE="4", SLURM_GPUS_ON_NODE="4", SLURM_JOB_GPUS="0,1,2,3", SLURM_STEP_GPUS="0,1,2,3")


def _no_task_count_two_gpus(env: dict[str, str]) -> None:
    # sbatch --gpus-per-node=2 without -n: Slurm sets no SLURM_NTASKS / SLURM_NPROCS.
    for name in ("SLURM_NTASKS", "SLURM_NPROCS"):
        env.pop(name, None)
    env.update(SLURM_GPUS_PER_NODE="2", SLURM_GPUS_ON_NODE="2", SLURM_JOB_GPUS="0,1")


def _two_gpus(env: dict[str, str]) -> None:
    env.update(SLURM_GPUS_PER_NODE="2", SLURM_GPUS_ON_NODE="2", SLURM_JOB_GPUS="0,1")


def _no_task_lists_four_gpus(env: dict[str, str]) -> None:
    # Neither per-node task list nor SLURM_NTASKS: the step's one node runs SLURM_STEP_NUM_TASKS tasks.
    for name in ("SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS", "SLURM_NPROCS"):
        env.pop(name, None)
    env.update(SLURM_GPUS_ON_NODE="4", SLURM_STEP_GPUS="0,1,2,3")


ONE_PER_GPU = "submit with --ntasks-per-node={n} and launch the tasks with srun (one task per GPU"
DERIVED: dict[str, tuple[str, Edit, Runs | Refused]] = {
    # The shape is decided from job-wide variables: the same refusal on every rank, not rank 0 accepting.
    "gpus_spread_2_1": ("srun_per_task", _gpus_spread_2_1, Refused(
        "SLURM_GPUS=3 (--gpus) leaves how many GPUs each of the 2 nodes gets to Slurm: submit with "
        "--gpus-per-node=N and --ntasks-per-node=N (one task per GPU), or --gpus-per-task=1")),
    "gpus_on_one_node": ("srun_n_only", _gpus_on_one_node, Runs(2, ("n1",), (2,), gpus_per_node=(2,))),
    # Slurm's own spelling of the task counts, not a re-rendering (2,2).
    "gpus_per_node_tasks_by_list": ("srun_per_task", _gpus_per_node_4, Refused(
        "SLURM_STEP_TASKS_PER_NODE=2(x2) but 4 GPUs per node requested: submit with --ntasks-per-node=4 "
        "(one task per GPU)")),
    # A one-task shell holding 2 GPUs: named by a variable that is set, and the fix is srun.
    "batch_shell_no_task_count_two_gpus": ("batch_shell_one_task", _no_task_count_two_gpus, Refused(
        "running in the batch shell of a 1-task Slurm job (SLURM_TASKS_PER_NODE=1) with 2 GPUs "
        "(SLURM_GPUS_PER_NODE=2): " + ONE_PER_GPU.format(n=2))),
    "salloc_one_task_two_gpus": ("salloc_one_task", _two_gpus, Refused(
        "running in salloc's shell of a 1-task Slurm job (SLURM_NTASKS=1) with 2 GPUs (SLURM_GPUS_PER_NODE=2): "
        + ONE_PER_GPU.format(n=2))),
    "step_without_task_lists": ("srun_n_only", _no_task_lists_four_gpus, Refused(
        "SLURM_STEP_NUM_TASKS=2 but 4 GPUs per node requested: submit with --ntasks-per-node=4")),
}


@pytest.mark.parametrize("shape", sorted(DERIVED))
def test_derived_launch_shape(shape: str) -> None:
    base, edit, expected = DERIVED[shape]
    fixture = copy.deepcopy(load(base))
    for environ in fixture["processes"]:  # type: ignore[attr-defined]
        edit(environ)
    _check_shape(shape, fixture, expected)
