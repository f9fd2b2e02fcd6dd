"""Launcher detection and validation, one table per environment kind (plain dicts, no os.environ)."""

from __future__ import annotations

import pytest

from mgpu.cluster.environment import (
    MASTER_PORT_BASE,
    MASTER_PORT_SPAN,
    ProcessEnv,
    derive_master_port,
    detect_environment,
)
from mgpu.errors import MgpuError


def srun_task(procid: int, localid: int, nodeid: int, **extra: str) -> dict[str, str]:
    """Variables as srun sets them for a 2-node x 2-task step of job 4242."""
    env = {
        "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid), "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS_PER_NODE": "2",
    }
    env.update(extra)
    return env


SLURM_CASES: list[tuple[dict[str, str], dict[str, object]]] = [
    (srun_task(0, 0, 0), dict(rank=0, local_rank=0, node_rank=0, world_size=4, local_world_size=2,
                              num_nodes=2, nodes=("n1", "n2"), master_addr="n1", job_id="4242", restart_count=0)),
    (srun_task(3, 1, 1), dict(rank=3, local_rank=1, node_rank=1, master_addr="n1")),
    (srun_task(2, 0, 1, SLURM_RESTART_COUNT="2"), dict(restart_count=2)),
    (srun_task(1, 1, 0, SLURM_ARRAY_JOB_ID="4200", SLURM_ARRAY_TASK_ID="7"), dict(job_id="4200_7")),
    (srun_task(0, 0, 0, MASTER_ADDR="10.0.0.5", MASTER_PORT="31000"), dict(master_addr="10.0.0.5", master_port=31000)),
    (srun_task(0, 0, 0, SLURM_GPUS_ON_NODE="2"), dict(gpus_per_node=2)),
    (srun_task(0, 0, 0, SLURM_GPUS_PER_NODE="a100:2"), dict(gpus_per_node=2)),
    # The step runs on one node of a 2-node job: the step's variables win.
    (srun_task(1, 1, 0, SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="n2", SLURM_STEP_NUM_NODES="1",
               SLURM_STEP_TASKS_PER_NODE="2"), dict(world_size=2, nodes=("n2",), num_nodes=1, master_addr="n2")),
    (dict(srun_task(0, 0, 0), SLURM_JOB_NODELIST="gpu-a[001-002]", SLURM_STEP_NODELIST="gpu-a[001-002]"),
     dict(nodes=("gpu-a001", "gpu-a002"), master_addr="gpu-a001")),
    (srun_task(4, 0, 2, SLURM_NTASKS="5", SLURM_STEP_NUM_TASKS="5", SLURM_STEP_NODELIST="n[1-3]",
               SLURM_STEP_NUM_NODES="3", SLURM_STEP_TASKS_PER_NODE="2(x2),1"),
     dict(world_size=5, local_world_size=1, node_rank=2, nodes=("n1", "n2", "n3"))),
    # The batch shell of a one-task job is a world of one.
    ({"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1",
      "SLURM_TASKS_PER_NODE": "1"}, dict(world_size=1, rank=0, nodes=("n1",))),
]


@pytest.mark.parametrize("environ, expected", SLURM_CASES)
def test_slurm_environment(environ: dict[str, str], expected: dict[str, object]) -> None:
    env = detect_environment(environ)
    assert env.launcher == "slurm"
    for field, value in expected.items():
        assert getattr(env, field) == value, field


SLURM_ERRORS: list[tuple[dict[str, str], str]] = [
    (srun_task(0, 0, 0, SLURM_NTASKS_PER_NODE="1", SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS="2",
               SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_GPUS_ON_NODE="4"),
     "SLURM_NTASKS_PER_NODE=1 but 4 GPUs per node requested: submit with --ntasks-per-node=4 (one task per GPU)"),
    (srun_task(0, 0, 0, SLURM_STEP_NUM_TASKS="6"), "does not give 6 tasks on 2 nodes"),
    (srun_task(0, 0, 0, SLURM_STEP_NUM_NODES="3"), "names 2 nodes but SLURM_STEP_NUM_NODES=3"),
    (srun_task(5, 1, 1), "SLURM_PROCID=5 but the step has 4 tasks"),
    (srun_task(0, 2, 0), "SLURM_LOCALID=2 but node 0 runs 2 tasks"),
    (srun_task(0, 0, 2), "SLURM_NODEID=2 but the step has 2 nodes"),
    (srun_task(0, 0, 0, SLURM_PROCID="x"), "SLURM_PROCID='x' is not an integer"),
    (srun_task(0, 0, 0, SLURM_STEP_NODELIST="n[1-2"), "SLURM_STEP_NODELIST: unbalanced"),
    (srun_task(0, 0, 0, MASTER_ADDR="localhost"), "MASTER_ADDR=localhost on a 2-node job"),
    (srun_task(0, 0, 0, MASTER_PORT="70000"), "MASTER_PORT=70000 is not a TCP port"),
    ({k: v for k, v in srun_task(0, 0, 0).items() if not k.startswith("SLURM_STEP")},
     "running in the batch shell of a 4-task Slurm job"),
    ({k: v for k, v in srun_task(0, 0, 0).items() if k != "SLURM_NODEID"}, "SLURM_NODEID is not set"),
]


@pytest.mark.parametrize("environ, message", SLURM_ERRORS)
def test_slurm_environment_errors(environ: dict[str, str], message: str) -> None:
    with pytest.raises(MgpuError, match=".*") as caught:
        detect_environment(environ)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def torchrun_worker(rank: int, local_rank: int, **extra: str) -> dict[str, str]:
    env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": str(rank // 2), "MASTER_ADDR": "host-a", "MASTER_PORT": "29400",
           "TORCHELASTIC_RUN_ID": "run7", "TORCHELASTIC_RESTART_COUNT": "1"}
    env.update(extra)
    return env


def test_torchrun_environment() -> None:
    env = detect_environment(torchrun_worker(3, 1))
    assert (env.launcher, env.rank, env.local_rank, env.world_size, env.local_world_size) == ("torchrun", 3, 1, 4, 2)
    assert (env.node_rank, env.num_nodes, env.master_addr, env.master_port) == (1, 2, "host-a", 29400)
    assert (env.job_id, env.restart_count) == ("run7", 1)


def test_torchrun_inside_slurm_uses_torchrun_ranks_and_slurm_job() -> None:
    # torchrun in an srun step of one task per node: the worker sees both sets of variables.
    environ = {**srun_task(1, 0, 1, SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="1(x2)",
                           SLURM_RESTART_COUNT="3"), **torchrun_worker(3, 1, MASTER_ADDR="n1")}
    env = detect_environment(environ)
    assert (env.launcher, env.rank, env.world_size, env.nodes) == ("torchrun", 3, 4, ("n1", "n2"))
    assert (env.job_id, env.restart_count) == ("4242", 3)


@pytest.mark.parametrize("environ, message", [
    (torchrun_worker(0, 0, WORLD_SIZE="3"), "WORLD_SIZE=3 is not a multiple of LOCAL_WORLD_SIZE=2"),
    (torchrun_worker(0, 5), "RANK=0/LOCAL_RANK=5 outside"),
    ({k: v for k, v in torchrun_worker(0, 0).items() if k != "MASTER_ADDR"}, "MASTER_ADDR is not set"),
])
def test_torchrun_errors(environ: dict[str, str], message: str) -> None:
    with pytest.raises(MgpuError) as caught:
        detect_environment(environ)
    assert message in str(caught.value)


def test_submitit_local_environment() -> None:
    environ = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_LOCALID": "1",
               "SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_JOB_ID": "31337"}
    env = detect_environment(environ)
    assert (env.launcher, env.rank, env.local_rank, env.world_size, env.num_nodes) == ("submitit-local", 1, 1, 2, 1)
    assert (env.master_addr, env.master_port, env.job_id) == ("127.0.0.1", derive_master_port("31337"), "31337")


def test_single_process_environment() -> None:
    env = detect_environment({})
    assert isinstance(env, ProcessEnv)
    assert (env.launcher, env.rank, env.world_size, env.num_nodes, env.restart_count) == ("single", 0, 1, 1, 0)


def test_master_port_is_stable_distinct_and_in_range() -> None:
    assert derive_master_port("4242") == derive_master_port("4242")
    ids = [str(i) for i in range(100000, 100000 + MASTER_PORT_SPAN)]
    ports = {derive_master_port(i) for i in ids}
    assert len(ports) == MASTER_PORT_SPAN  # consecutive job ids never share a port
    assert all(MASTER_PORT_BASE <= p < 32768 for p in ports)
    assert MASTER_PORT_BASE <= derive_master_port("local-77") < MASTER_PORT_BASE + MASTER_PORT_SPAN


def test_every_rank_of_a_step_agrees_on_the_rendezvous() -> None:
    envs = [detect_environment(srun_task(r, r % 2, r // 2)) for r in range(4)]
    assert len({(e.master_addr, e.master_port) for e in envs}) == 1
    assert sorted(e.rank for e in envs) == [0, 1, 2, 3]


# Issue 17: who am I on every launch users do (the shapes themselves, on captured environments, are in
# tests/test_launch_shapes.py; these are the single rules, on hand-made ones).
def test_contradiction_names_the_node_count_variable_actually_set() -> None:
    environ = {k: v for k, v in srun_task(0, 0, 0, SLURM_JOB_NUM_NODES="3").items() if k != "SLURM_STEP_NUM_NODES"}
    with pytest.raises(MgpuError, match="names 2 nodes but SLURM_JOB_NUM_NODES=3"):
        detect_environment(environ)


def test_hand_exported_ranks_inside_a_step_read_slurm() -> None:
    # `export RANK=$SLURM_PROCID ...` in the batch script: every task inherits rank 0.
    envs = [detect_environment(srun_task(r, r % 2, r // 2, RANK="0", LOCAL_RANK="0", WORLD_SIZE="4")) for r in range(4)]
    assert [(e.launcher, e.rank, e.local_rank, e.node_rank, e.local_world_size) for e in envs] == [
        ("slurm", 0, 0, 0, 2), ("slurm", 1, 1, 0, 2), ("slurm", 2, 0, 1, 2), ("slurm", 3, 1, 1, 2)]


def test_hand_exported_world_size_that_contradicts_the_step_is_refused() -> None:
    with pytest.raises(MgpuError, match=r"WORLD_SIZE=8 but the Slurm step has 4 tasks \(SLURM_STEP_NUM_TASKS=4\): "
                                        r"unset RANK/LOCAL_RANK/WORLD_SIZE"):
        detect_environment(srun_task(1, 1, 0, RANK="1", LOCAL_RANK="1", WORLD_SIZE="8"))


def test_hand_exported_ranks_outside_slurm_are_an_env_launch() -> None:
    env = detect_environment({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": "29500"})
    assert (env.launcher, env.rank, env.world_size, env.num_nodes, env.master_port) == ("env", 1, 2, 1, 29500)


def test_salloc_shell_of_several_tasks_is_refused() -> None:
    environ = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2",
               "SLURM_TASKS_PER_NODE": "2(x2)"}
    with pytest.raises(MgpuError, match=r"running in salloc's shell of a 4-task Slurm job \(SLURM_NTASKS=4\)"):
        detect_environment(environ)


def test_batch_shell_without_a_task_count_is_refused_for_srun() -> None:
    environ = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2"}
    with pytest.raises(MgpuError, match=r"batch shell of a 2-task Slurm job \(SLURM_JOB_NUM_NODES=2\), not in a task: "
                                        r"launch every task with srun"):
        detect_environment(environ)


def test_gpu_shape_is_decided_alike_on_every_node() -> None:
    # srun -N2 -n3 --gres=gpu:2: both nodes have 2 GPUs, the second runs one task; no SLURM_NTASKS_PER_NODE.
    uneven = dict(SLURM_NTASKS="3", SLURM_STEP_NUM_TASKS="3", SLURM_TASKS_PER_NODE="2,1",
                  SLURM_STEP_TASKS_PER_NODE="2,1", SLURM_GPUS_ON_NODE="2")
    messages = set()
    for rank, local, node in ((0, 0, 0), (1, 1, 0), (2, 0, 1)):
        environ = {k: v for k, v in srun_task(rank, local, node, **uneven).items() if k != "SLURM_NTASKS_PER_NODE"}
        with pytest.raises(MgpuError) as caught:
            detect_environment(environ)
        messages.add(str(caught.value))
    assert messages == {"SLURM_STEP_TASKS_PER_NODE=2,1 but 2 GPUs per node requested: submit with "
                        "--ntasks-per-node=2 (one task per GPU)"}


def test_gpus_per_task_allows_uneven_nodes_but_only_one_gpu_each() -> None:
    uneven = dict(SLURM_NTASKS="3", SLURM_STEP_NUM_TASKS="3", SLURM_STEP_TASKS_PER_NODE="2,1", SLURM_GPUS_PER_TASK="1")
    assert detect_environment(srun_task(2, 0, 1, SLURM_GPUS_ON_NODE="1", **uneven)).gpus_per_node == 1
    with pytest.raises(MgpuError, match="SLURM_GPUS_PER_TASK=2: submit with --gpus-per-task=1"):
        detect_environment(srun_task(0, 0, 0, **{**uneven, "SLURM_GPUS_PER_TASK": "2", "SLURM_GPUS_ON_NODE": "4"}))


@pytest.mark.parametrize("workers", [(1, 2, 3), (4, 2)])
def test_torchrun_with_different_workers_per_node(workers: tuple[int, ...]) -> None:
    world, first = sum(workers), [sum(workers[:i]) for i in range(len(workers))]
    for node, count in enumerate(workers):
        for local in range(count):
            env = detect_environment(torchrun_worker(first[node] + local, local, WORLD_SIZE=str(world),
                                                     LOCAL_WORLD_SIZE=str(count), GROUP_RANK=str(node),
                                                     GROUP_WORLD_SIZE=str(len(workers)), ROLE_WORLD_SIZE=str(world)))
            assert (env.num_nodes, env.node_rank, env.local_world_size) == (len(workers), node, count)
