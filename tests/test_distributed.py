"""The process group: device choice (GPU counts simulated: no GPU here) and real multi-process gloo groups."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import pytest
import torch

from mgpu.parallel.distributed import all_reduce, broadcast_object, cpu_threads_per_rank, process_group, select_device
from mgpu.cluster.environment import detect_environment
from mgpu.errors import MgpuError
from tests.conftest import PYTHON, ROOT, base_env, ensure_resolvable, run_processes
from tests.test_environment import srun_task

CHECK = str(ROOT / "jobs" / "check_env.py")


@pytest.mark.parametrize("local_rank, visible, expected", [
    (0, 4, "cuda:0"), (3, 4, "cuda:3"), (2, 1, "cuda:0"),  # --gpus-per-node vs one GPU per task
])
def test_select_device_by_local_rank(local_rank: int, visible: int, expected: str) -> None:
    env = detect_environment(srun_task(local_rank, local_rank, 0, SLURM_STEP_TASKS_PER_NODE="4(x2)",
                                       SLURM_STEP_NUM_TASKS="8"))
    assert str(select_device(env, cuda_available=True, visible_gpus=visible)) == expected


def test_select_device_rejects_local_rank_without_gpu() -> None:
    env = detect_environment(srun_task(3, 3, 0, SLURM_STEP_TASKS_PER_NODE="4(x2)", SLURM_STEP_NUM_TASKS="8"))
    with pytest.raises(MgpuError, match="local rank 3 but only 2 GPUs are visible"):
        select_device(env, cuda_available=True, visible_gpus=2)


def test_select_device_cpu_without_cuda() -> None:
    assert select_device(detect_environment({}), cuda_available=False) == torch.device("cpu")


@pytest.mark.parametrize("local_world, environ, cpus, expected", [
    (1, {}, 16, None),                            # alone on the machine: torch's default
    (2, {}, 2, 1), (4, {}, 16, 4), (3, {}, 8, 2),  # an equal share each
    (8, {}, 4, 1),                                # more ranks than cores: one thread, never zero
    (2, {"OMP_NUM_THREADS": "3"}, 16, None),     # the user's (or srun template's) choice stands
    (2, {"OMP_NUM_THREADS": ""}, 16, 8),          # set but empty is unset
    # Slurm bound each task to its own CPUs (srun --cpu-bind, task/affinity): the mask is this task's alone.
    (4, {"SLURM_CPU_BIND_TYPE": "mask_cpu:"}, 8, 8),
    (4, {"SLURM_CPU_BIND_TYPE": "none"}, 16, 4),  # no binding: the node's CPUs are shared
    # Bound without saying so (no SLURM_CPU_BIND_TYPE): a mask no larger than one task's share is its own.
    (4, {"SLURM_CPUS_PER_TASK": "2"}, 2, 2),
    (4, {"SLURM_CPUS_PER_TASK": "2", "SLURM_CPU_BIND_TYPE": "none"}, 2, 2),
    (4, {"SLURM_CPUS_PER_TASK": "2"}, 8, 2),     # the 4 tasks' 8 CPUs, shared: an equal share each
    (2, {"SLURM_CPUS_ON_NODE": "8"}, 4, 4),      # no --cpus-per-task: the node's 8 / 2 tasks
    (2, {"SLURM_CPUS_ON_NODE": "8"}, 8, 4),
    (2, {"SLURM_CPUS_PER_TASK": "x", "SLURM_CPUS_ON_NODE": ""}, 8, 4),  # garbage says nothing
    (2, {}, 4, 2),  # outside Slurm a mask smaller than the machine (a container's cpuset) is still shared
    # torchrun inside srun: its workers share their agent's (one Slurm task's) CPUs, bound or not.
    (4, {"TORCHELASTIC_RUN_ID": "1", "SLURM_CPU_BIND_TYPE": "mask_cpu:", "SLURM_CPUS_PER_TASK": "16"}, 16, 4),
])
def test_cpu_threads_per_rank(local_world: int, environ: dict[str, str], cpus: int, expected: int | None) -> None:
    assert cpu_threads_per_rank(local_world, environ, cpus) == expected


def test_world_of_one_forms_and_tears_down_a_group() -> None:
    with process_group(detect_environment({})) as ctx:
        assert (ctx.backend, ctx.device.type) == ("gloo", "cpu")
        assert all_reduce(2.0, "mean").item() == 2.0
        assert broadcast_object({"a": 1}) == {"a": 1}
        assert torch.distributed.is_initialized()
    assert not torch.distributed.is_initialized()


def test_group_is_destroyed_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with process_group(detect_environment({})):
            raise RuntimeError("boom")
    assert not torch.distributed.is_initialized()


def _read_ranks(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.multiprocess
def test_simulated_two_nodes_two_tasks(tmp_path: Path) -> None:
    """4 real processes with SLURM variables as srun sets them for 2 nodes x 2 tasks form one gloo group."""
    ensure_resolvable(["n1", "n2"])
    job_id = str(random.randint(10**6, 10**7))
    commands = []
    for rank in range(4):
        env = base_env(**srun_task(rank, rank % 2, rank // 2, SLURM_JOB_ID=job_id,
                                   SLURMD_NODENAME=f"n{rank // 2 + 1}"))
        commands.append(([PYTHON, CHECK, "--out", str(tmp_path), "--timeout-s", "60"], env))
    results = run_processes(commands, timeout=120)
    assert [r.returncode for r in results] == [0] * 4, [r.stdout for r in results]
    records = _read_ranks(tmp_path, 4)
    for rank, rec in enumerate(records):
        assert (rec["rank"], rec["local_rank"], rec["node_rank"]) == (rank, rank % 2, rank // 2)
        assert (rec["world_size"], rec["local_world_size"], rec["num_nodes"]) == (4, 2, 2)
        assert (rec["master_addr"], rec["nodes"], rec["backend"]) == ("n1", ["n1", "n2"], "gloo")
        assert rec["allreduce_sum"] == 10
    assert len({rec["master_port"] for rec in records}) == 1


@pytest.mark.multiprocess
def test_ranks_sharing_a_machine_share_its_cores(tmp_path: Path) -> None:
    """2 tasks on one node and no OMP_NUM_THREADS: each rank takes half the usable cores, not all."""
    usable = len(os.sched_getaffinity(0))
    job_id = str(random.randint(10**6, 10**7))
    one_node = dict(SLURM_JOB_ID=job_id, SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_JOB_NODELIST="localhost",
                    SLURM_STEP_NODELIST="localhost", SLURM_JOB_NUM_NODES="1", SLURM_STEP_NUM_NODES="1",
                    SLURM_TASKS_PER_NODE="2", SLURM_STEP_TASKS_PER_NODE="2", SLURM_NTASKS_PER_NODE="2")
    commands = []
    for rank in range(2):
        env = base_env(**srun_task(rank, rank, 0, **one_node))
        del env["OMP_NUM_THREADS"]
        commands.append(([PYTHON, CHECK, "--out", str(tmp_path), "--timeout-s", "60"], env))
    results = run_processes(commands, timeout=120)
    assert [r.returncode for r in results] == [0] * 2, [r.stdout for r in results]
    assert [r["cpu_threads"] for r in _read_ranks(tmp_path, 2)] == [max(1, usable // 2)] * 2


@pytest.mark.multiprocess
def test_torchrun_two_processes(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(PYTHON).parent)) or shutil.which("torchrun")
    assert torchrun, "torchrun is installed with torch"
    port = str(random.SystemRandom().randint(20000, 32000))
    cmd = [torchrun, "--nproc-per-node", "2", "--master-port", port, CHECK, "--out", str(tmp_path)]
    (result,) = run_processes([(cmd, base_env())], timeout=120)
    assert result.returncode == 0, result.stdout
    records = _read_ranks(tmp_path, 2)
    assert [(r["launcher"], r["rank"], r["world_size"], r["allreduce_sum"]) for r in records] == [
        ("torchrun", 0, 2, 3), ("torchrun", 1, 2, 3)]


@pytest.mark.multiprocess
def test_check_env_says_a_rendezvous_that_did_not_complete_in_one_line(tmp_path: Path) -> None:
    # Issue 46: rank 0 of a world of two whose other rank never came printed the MgpuError's traceback.
    port = str(random.SystemRandom().randint(20000, 32000))
    env = base_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0",
                   LOCAL_WORLD_SIZE="2")
    results = run_processes([([PYTHON, CHECK, "--out", str(tmp_path), "--timeout-s", "2"], env),
                             ([PYTHON, CHECK, "--timeout-s", "nan"], env)], timeout=90)
    for result, said in zip(results, ["rank 0 waited 2 s at 127.0.0.1:" + port + " for all 2 ranks",
                                      "--timeout-s nan: must be in (0, 604800] seconds"]):
        lines = result.stdout.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and said in lines[0], result.stdout
    assert "--timeout-s sets the wait" in results[0].stdout and "Traceback" not in results[0].stdout
    assert not list(tmp_path.iterdir())


@pytest.mark.multiprocess
def test_inconsistent_environment_fails_fast_with_one_line(tmp_path: Path) -> None:
    # Rank 0 of a step that claims 4 tasks on 2 nodes but whose task layout says 1 per node: without
    # validation it would wait 30 minutes for peers that never come.
    env = base_env(**srun_task(0, 0, 0, SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_TASKS_PER_NODE="1(x2)"))
    start = time.monotonic()
    (result,) = run_processes([([PYTHON, CHECK, "--out", str(tmp_path)], env)], timeout=30)
    elapsed = time.monotonic() - start
    assert result.returncode == 2
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and "SLURM_STEP_TASKS_PER_NODE=1(x2) does not give 4 tasks on 2 nodes" in lines[0]  # as Slurm wrote it
    assert elapsed < 5, f"took {elapsed:.1f}s"
    assert not list(tmp_path.iterdir())
