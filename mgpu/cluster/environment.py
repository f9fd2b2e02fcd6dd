"""Who am I, who are my peers, where do we meet: read from the launcher's environment variables.

Each launcher is a small `ClusterEnvironment`: `detect(environ)` says whether this process was
started by it, `resolve(environ)` returns a validated `ProcessEnv`. `detect_environment()` tries them
in `DETECT_ORDER`:

1. `TorchElasticEnvironment` (torchrun, known by TORCHELASTIC_RUN_ID): first, because torchrun inside
   an srun step (one task per node) leaves the step's SLURM_* variables in its workers, and only
   torchrun's describe a worker.
2. `SubmititLocalEnvironment`: submitit's local executor (tasks are processes on this machine).
3. `SlurmEnvironment`: a task started by srun, or the batch / salloc shell of a one-task job.
   RANK/LOCAL_RANK/WORLD_SIZE exported by hand are not read there (WORLD_SIZE must agree).
4. `EnvVarEnvironment`: RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR set by another launcher, outside Slurm.
5. `SingleProcessEnvironment`: anything else, e.g. `python jobs/train.py` on a laptop.

Everything here is pure (a mapping in, a dataclass out) and nothing imports torch, so a bad
environment fails in milliseconds with one line naming the variable and the fix, before any
process group could wait for peers that will never come.
"""

from __future__ import annotations

import os
import socket
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Mapping

from mgpu.errors import MgpuError
from mgpu.cluster.hostlist import HostlistError, expand_hostlist, expand_tasks_per_node

__all__ = [
    "DETECT_ORDER",
    "ClusterEnvironment",
    "EnvVarEnvironment",
    "ProcessEnv",
    "SingleProcessEnvironment",
    "SlurmEnvironment",
    "SubmititLocalEnvironment",
    "TorchElasticEnvironment",
    "derive_master_port",
    "detect_environment",
]

MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 12000
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})


@dataclass(frozen=True)
class ProcessEnv:
    """Where this process stands in the job. Ranks count from 0."""

    launcher: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    nodes: tuple[str, ...]
    job_id: str
    """Array-aware (`<array job>_<task>`), the same across requeues of the same job."""
    restart_count: int
    """How many times the scheduler restarted this job (Slurm's SLURM_RESTART_COUNT; 0 on the first run)."""
    master_addr: str
    master_port: int
    gpus_per_node: int | None = None
    """GPUs the scheduler gave this node, when it says (None: unknown or not a scheduler)."""

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0


def derive_master_port(job_id: str) -> int:
    """A rendezvous port that every rank of a job computes alike, without talking to each other.

    Numeric Slurm job ids (SLURM_JOB_ID, unique per array task and kept across requeues) map to
    `20000 + id % 12000`, so two jobs sharing a node collide only if their ids differ by a multiple of
    12000, i.e. 12000 jobs were submitted between them; other ids are hashed (CRC32), which collides
    for 1 pair in 12000. The range ends below Linux's ephemeral ports (32768+), so the kernel never
    hands the port to some other process's outgoing connection.
    """
    number = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return MASTER_PORT_BASE + number % MASTER_PORT_SPAN


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            return name, value
    return None


def _int(environ: Mapping[str, str], *names: str, fix: str, default: int | None = None) -> int:
    """The first of `names` that is set, as an int; a missing or non-integer one fails in one line."""
    found = _first(environ, names)
    if found is None:
        if default is not None:
            return default
        raise MgpuError(f"{names[0]} is not set: {fix}")
    name, value = found
    try:
        return int(value)
    except ValueError:
        raise MgpuError(f"{name}={value!r} is not an integer: {fix}") from None


def _master(environ: Mapping[str, str], first_node: str, job_id: str) -> tuple[str, int]:
    """MASTER_ADDR / MASTER_PORT from the environment when given, else the first node and a derived port."""
    addr = environ.get("MASTER_ADDR") or first_node
    port = _int(environ, "MASTER_PORT", fix="set MASTER_PORT to a free TCP port or unset it",
                default=derive_master_port(job_id))
    if not 0 < port < 65536:
        raise MgpuError(f"MASTER_PORT={port} is not a TCP port: use a value in 1024-65535 or unset it")
    return addr, port


def _parse_gpu_count(value: str) -> int:
    """`4`, `gpu:4` or `a100:4` (SLURM_GPUS_PER_NODE's forms) -> 4."""
    return int(value.rsplit(":", 1)[-1].split("(")[0])


class ClusterEnvironment(ABC):
    """One way a process can be launched."""

    name: ClassVar[str]

    @staticmethod
    @abstractmethod
    def detect(environ: Mapping[str, str]) -> bool:
        """Whether this launcher started the current process."""

    @classmethod
    @abstractmethod
    def resolve(cls, environ: Mapping[str, str]) -> ProcessEnv:
        """Read and validate the environment; raise MgpuError with one actionable line."""


class SlurmEnvironment(ClusterEnvironment):
    """A task of a Slurm job step (srun), one task per GPU; or the job's own shell (sbatch, salloc)."""

    name = "slurm"
    # Step-scoped variables win over job-scoped ones: a step may run on part of the allocation
    # (`srun -N1` inside a 2-node job), and only the step's describe the processes that will join.
    WORLD_SIZE = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    NODELIST = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    NUM_NODES = ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    SRUN_FIX = "launch every task with srun (see slurm/train.sbatch)"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        # Not only tasks (SLURM_PROCID): salloc's shell has the job but no task, and must not pass for a
        # world of one on a multi-task allocation.
        return "SLURM_JOB_ID" in environ

    @classmethod
    def resolve(cls, environ: Mapping[str, str]) -> ProcessEnv:
        fix = cls.SRUN_FIX
        nodelist = _first(environ, cls.NODELIST)
        if nodelist is None:
            raise MgpuError(f"SLURM_JOB_NODELIST is not set: {fix}")
        try:
            nodes = tuple(expand_hostlist(nodelist[1]))
        except HostlistError as error:
            raise MgpuError(f"{nodelist[0]}: {error}") from None
        if _first(environ, ("SLURM_STEP_ID", "SLURM_STEPID")) is None:
            return cls._job_shell(environ, nodes)
        # Every check that can fail on one rank must fail on all: the job-wide ones come first, and none
        # reads a variable that differs between nodes.
        world = _first(environ, cls.WORLD_SIZE)
        world_size = _int(environ, *cls.WORLD_SIZE, fix=fix, default=1)
        exported = environ.get("WORLD_SIZE")
        if exported is not None and exported != str(world_size):
            step = f" ({world[0]}={world[1]})" if world else ""
            raise MgpuError(f"WORLD_SIZE={exported} but the Slurm step has {world_size} tasks{step}: "
                            "unset RANK/LOCAL_RANK/WORLD_SIZE (mgpu reads Slurm's variables)")
        num_var = _first(environ, cls.NUM_NODES)
        num_nodes = _int(environ, *cls.NUM_NODES, fix=fix, default=len(nodes))
        if num_nodes != len(nodes):
            raise MgpuError(f"{nodelist[0]}={nodelist[1]!r} names {len(nodes)} nodes but "
                            f"{num_var[0]}={num_nodes}: the job's variables contradict each other")  # type: ignore[index]  # set when NUM_NODES was read
        tasks_per_node, tasks = cls._tasks_per_node(environ, world_size, num_nodes)
        if len(tasks_per_node) != num_nodes or sum(tasks_per_node) != world_size:
            raise MgpuError(
                f"{tasks} does not give {world_size} tasks on "
                f"{num_nodes} nodes: submit with --ntasks-per-node and --nodes that multiply to --ntasks"
            )
        every_node, _, gpus_per_node = cls._gpu_shape(environ, num_nodes)
        if every_node and any(count != every_node for count in tasks_per_node):
            if all(str(count) == environ.get("SLURM_NTASKS_PER_NODE") for count in tasks_per_node):
                tasks = f"SLURM_NTASKS_PER_NODE={environ['SLURM_NTASKS_PER_NODE']}"
            raise MgpuError(f"{tasks} but {every_node} GPUs per node requested: "
                            f"submit with --ntasks-per-node={every_node} (one task per GPU)")
        master_addr, master_port = _master(environ, nodes[0], environ["SLURM_JOB_ID"])
        if num_nodes > 1 and master_addr in _LOOPBACK_NAMES:
            raise MgpuError(f"MASTER_ADDR={master_addr} on a {num_nodes}-node job would give every node a world "
                            f"of its own: unset MASTER_ADDR (the first node, {nodes[0]}, is used)")

        # RANK/LOCAL_RANK exported by hand are not read: in the batch script they would be rank 0 on
        # every task, and rank 0 itself could not tell, so refusing would split the ranks.
        rank = _int(environ, "SLURM_PROCID", fix=fix)
        local_rank = _int(environ, "SLURM_LOCALID", fix=fix, default=0 if world_size == 1 else None)
        node_rank = _int(environ, "SLURM_NODEID", fix=fix, default=0 if world_size == 1 else None)
        if not 0 <= node_rank < num_nodes:
            raise MgpuError(f"SLURM_NODEID={node_rank} but the step has {num_nodes} nodes: {fix}")
        local_world_size = tasks_per_node[node_rank]
        if not 0 <= rank < world_size:
            raise MgpuError(f"SLURM_PROCID={rank} but the step has {world_size} tasks: {fix}")
        if not 0 <= local_rank < local_world_size:
            raise MgpuError(f"SLURM_LOCALID={local_rank} but node {node_rank} runs {local_world_size} tasks")
        return ProcessEnv(cls.name, rank, local_rank, world_size, local_world_size, node_rank, num_nodes,
                          nodes, cls.job_id(environ), cls._restarts(environ), master_addr, master_port,
                          gpus_per_node)

    @classmethod
    def _job_shell(cls, environ: Mapping[str, str], nodes: tuple[str, ...]) -> ProcessEnv:
        """The batch shell (sbatch) or salloc's shell: a world of one only in a one-task job."""
        found = _first(environ, ("SLURM_NTASKS", "SLURM_TASKS_PER_NODE", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"))
        tasks = 1
        if found is not None:
            try:
                tasks = sum(expand_tasks_per_node(found[1]))
            except HostlistError as error:
                raise MgpuError(f"{found[0]}: {error}") from None
        # sbatch's shell is the job's first task (SLURM_PROCID=0) on its first node; salloc's is no task
        # at all and runs where salloc was typed.
        batch = "SLURM_PROCID" in environ
        if tasks > 1:
            where = "the batch shell" if batch else "salloc's shell"
            raise MgpuError(f"running in {where} of a {tasks}-task Slurm job ({found[0]}={found[1]}), "  # type: ignore[index]  # tasks > 1 only when found
                            f"not in a task: {cls.SRUN_FIX}")
        host = nodes[0] if batch else environ.get("SLURM_SUBMIT_HOST") or socket.gethostname()
        every_node, gpu_source, gpus_per_node = cls._gpu_shape(environ, 1)
        if every_node and every_node != 1:
            where = "the batch shell" if batch else "salloc's shell"
            count = f" ({found[0]}={found[1]})" if found else ""
            raise MgpuError(f"running in {where} of a 1-task Slurm job{count} with {every_node} GPUs ({gpu_source}): "
                            f"submit with --ntasks-per-node={every_node} and launch the tasks with srun (one task per "
                            f"GPU, see slurm/train.sbatch)")
        master_addr, master_port = _master(environ, host, environ["SLURM_JOB_ID"])
        return ProcessEnv(cls.name, 0, 0, 1, 1, 0, 1, (host,), cls.job_id(environ), cls._restarts(environ),
                          master_addr, master_port, gpus_per_node)

    @staticmethod
    def job_id(environ: Mapping[str, str]) -> str:
        """`<array job>_<task>` for an array task, else SLURM_JOB_ID: what `scontrol requeue` must name."""
        array_job, array_task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
        if array_job and array_task:
            return f"{array_job}_{array_task}"
        return environ["SLURM_JOB_ID"]

    @staticmethod
    def _restarts(environ: Mapping[str, str]) -> int:
        return _int(environ, "SLURM_RESTART_COUNT", fix="unset it", default=0)

    @classmethod
    def _tasks_per_node(cls, environ: Mapping[str, str], world_size: int, num_nodes: int
                        ) -> tuple[list[int], str]:
        """Every node's task count, and where it came from as Slurm wrote it (`SLURM_..._TASKS_PER_NODE=2(x2)`)."""
        found = _first(environ, cls.TASKS_PER_NODE)
        if found is None:
            if num_nodes > 1:
                raise MgpuError(f"{cls.TASKS_PER_NODE[0]} is not set: {cls.SRUN_FIX}")
            world = _first(environ, cls.WORLD_SIZE)  # one node: it runs the whole step
            return [world_size], f"{world[0]}={world[1]}" if world else f"{world_size} task (no task count is set)"
        try:
            return expand_tasks_per_node(found[1]), f"{found[0]}={found[1]}"
        except HostlistError as error:
            raise MgpuError(f"{found[0]}: {error}") from None

    @staticmethod
    def _gpu_count(environ: Mapping[str, str], name: str) -> int | None:
        value = environ.get(name)
        if not value:
            return None
        try:
            return _parse_gpu_count(value)
        except ValueError:
            raise MgpuError(f"{name}={value!r} is not a GPU count") from None

    @classmethod
    def _gpu_shape(cls, environ: Mapping[str, str], num_nodes: int) -> tuple[int | None, str, int | None]:
        """(the GPUs every node of the step has, the variable that says so, this node's GPUs).

        Read from job-wide variables only, so every rank decides the job's shape alike: SLURM_GPUS_ON_NODE is
        this node's count and differs between nodes under `--gpus=N` or `--gpus-per-task`. The first is None
        where each task has its own GPU (--gpus-per-task=1) or Slurm gave none."""
        here = cls._gpu_count(environ, "SLURM_GPUS_ON_NODE")
        per_task = environ.get("SLURM_GPUS_PER_TASK")
        if per_task:
            # --gpus-per-task: each node has as many GPUs as tasks, even where the nodes' counts differ.
            if per_task.rsplit(":", 1)[-1] != "1":
                raise MgpuError(f"SLURM_GPUS_PER_TASK={per_task}: submit with --gpus-per-task=1 (one task per GPU)")
            return None, "", here
        per_node, total = cls._gpu_count(environ, "SLURM_GPUS_PER_NODE"), cls._gpu_count(environ, "SLURM_GPUS")
        if per_node is not None:  # --gpus-per-node
            every, source = per_node, f"SLURM_GPUS_PER_NODE={environ['SLURM_GPUS_PER_NODE']}"
        elif total is not None and num_nodes > 1:  # --gpus=N: Slurm spreads them, maybe 2 + 1
            raise MgpuError(f"SLURM_GPUS={environ['SLURM_GPUS']} (--gpus) leaves how many GPUs each of the {num_nodes} "
                            f"nodes gets to Slurm: submit with --gpus-per-node=N and --ntasks-per-node=N (one task "
                            f"per GPU), or --gpus-per-task=1")
        elif here is not None:  # --gres=gpu:N gives every node N; or the step's one node
            every, source = here, f"SLURM_GPUS_ON_NODE={environ['SLURM_GPUS_ON_NODE']}"
        elif total is not None:
            every, source = total, f"SLURM_GPUS={environ['SLURM_GPUS']}"
        else:
            return None, "", None
        return every, source, here if here is not None else every


class TorchElasticEnvironment(ClusterEnvironment):
    """A worker started by torchrun / torch.distributed.run, alone or one agent per Slurm task."""

    name = "torchrun"
    REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        # TORCHELASTIC_RUN_ID, as torch's own is_torchelastic_launched(): RANK & co. alone are often
        # exported by hand in Slurm scripts, where Slurm's variables must win.
        return "TORCHELASTIC_RUN_ID" in environ and all(name in environ for name in TorchElasticEnvironment.REQUIRED)

    @classmethod
    def resolve(cls, environ: Mapping[str, str]) -> ProcessEnv:
        fix = "launch with torchrun, which sets it"
        rank = _int(environ, "RANK", fix=fix)
        world_size = _int(environ, "WORLD_SIZE", fix=fix)
        local_rank = _int(environ, "LOCAL_RANK", fix=fix)
        local_world_size = _int(environ, "LOCAL_WORLD_SIZE", fix=fix, default=world_size)
        role_world_size = _int(environ, "ROLE_WORLD_SIZE", fix=fix, default=world_size)
        if role_world_size != world_size:
            raise MgpuError(f"ROLE_WORLD_SIZE={role_world_size} but WORLD_SIZE={world_size}: "
                            "mgpu runs every worker in one role, as torchrun does")
        if "GROUP_WORLD_SIZE" in environ:
            # torchrun's own node count and rank, never WORLD_SIZE / LOCAL_WORLD_SIZE: nodes may run
            # different numbers of workers (1+2+3), and each would compute another count.
            num_nodes = _int(environ, "GROUP_WORLD_SIZE", fix=fix)
            node_rank = _int(environ, "GROUP_RANK", fix=fix)
            if not 1 <= num_nodes <= world_size or not 0 <= node_rank < num_nodes:
                raise MgpuError(f"GROUP_RANK={node_rank}/GROUP_WORLD_SIZE={num_nodes} outside WORLD_SIZE="
                                f"{world_size}: the launcher's variables contradict each other")
        else:
            if local_world_size < 1 or world_size % local_world_size:
                raise MgpuError(f"WORLD_SIZE={world_size} is not a multiple of LOCAL_WORLD_SIZE={local_world_size}: "
                                "start the same --nproc-per-node on every node")
            num_nodes = world_size // local_world_size
            node_rank = _int(environ, "GROUP_RANK", fix=fix, default=rank // local_world_size)
        if not 0 <= rank < world_size or not 0 <= local_rank < local_world_size <= world_size:
            raise MgpuError(f"RANK={rank}/LOCAL_RANK={local_rank} outside WORLD_SIZE={world_size}/"
                            f"LOCAL_WORLD_SIZE={local_world_size}: the launcher's variables contradict each other")
        if "MASTER_ADDR" not in environ:
            raise MgpuError(f"MASTER_ADDR is not set: {fix}")
        nodes: tuple[str, ...] = ()
        slurm_nodes = _first(environ, SlurmEnvironment.NODELIST)
        if slurm_nodes is not None:
            # Slurm's hosts are torchrun's nodes only when there are as many (not with two agents on a host).
            try:
                hosts = tuple(expand_hostlist(slurm_nodes[1]))
            except HostlistError as error:
                raise MgpuError(f"{slurm_nodes[0]}: {error}") from None
            nodes = hosts if len(hosts) == num_nodes else ()
        elif num_nodes == 1:
            nodes = (socket.gethostname(),)
        in_slurm = "SLURM_JOB_ID" in environ
        job_id = SlurmEnvironment.job_id(environ) if in_slurm else environ.get("TORCHELASTIC_RUN_ID", "local")
        restart_var = "SLURM_RESTART_COUNT" if in_slurm else "TORCHELASTIC_RESTART_COUNT"
        restart_count = _int(environ, restart_var, fix="unset it", default=0)
        master_addr, master_port = _master(environ, environ["MASTER_ADDR"], job_id)
        return ProcessEnv(cls.name, rank, local_rank, world_size, local_world_size, node_rank, num_nodes,
                          nodes, job_id, restart_count, master_addr, master_port)


class EnvVarEnvironment(TorchElasticEnvironment):
    """RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR set by another launcher, outside Slurm (env:// style)."""

    name = "env"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return all(name in environ for name in TorchElasticEnvironment.REQUIRED)


class SubmititLocalEnvironment(ClusterEnvironment):
    """A task of submitit's LocalExecutor: processes on this machine."""

    name = "submitit-local"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return environ.get("SUBMITIT_EXECUTOR") == "local"

    @classmethod
    def resolve(cls, environ: Mapping[str, str]) -> ProcessEnv:
        fix = "start the job through submitit's LocalExecutor, which sets it"
        rank = _int(environ, "SUBMITIT_LOCAL_GLOBALID", fix=fix)
        local_rank = _int(environ, "SUBMITIT_LOCAL_LOCALID", fix=fix)
        world_size = _int(environ, "SUBMITIT_LOCAL_NTASKS", fix=fix)
        if not 0 <= rank < world_size:
            raise MgpuError(f"SUBMITIT_LOCAL_GLOBALID={rank} outside SUBMITIT_LOCAL_NTASKS={world_size}")
        job_id = environ.get("SUBMITIT_LOCAL_JOB_ID", "local")
        master_addr, master_port = _master(environ, "127.0.0.1", job_id)
        return ProcessEnv(cls.name, rank, local_rank, world_size, world_size, 0, 1, (socket.gethostname(),),
                          job_id, 0, master_addr, master_port)


class SingleProcessEnvironment(ClusterEnvironment):
    """A plain `python` process: a world of one."""

    name = "single"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return True

    @classmethod
    def resolve(cls, environ: Mapping[str, str]) -> ProcessEnv:
        job_id = f"local-{os.getpid()}"
        master_addr, master_port = _master(environ, "127.0.0.1", job_id)
        return ProcessEnv(cls.name, 0, 0, 1, 1, 0, 1, (socket.gethostname(),), job_id, 0,
                          master_addr, master_port)


DETECT_ORDER: tuple[type[ClusterEnvironment], ...] = (
    TorchElasticEnvironment,
    SubmititLocalEnvironment,
    SlurmEnvironment,
    EnvVarEnvironment,
    SingleProcessEnvironment,
)


def detect_environment(environ: Mapping[str, str] | None = None) -> ProcessEnv:
    """Resolve the first launcher in `DETECT_ORDER` that recognises the environment."""
    environ = os.environ if environ is None else environ
    for kind in DETECT_ORDER:
        if kind.detect(environ):
            return kind.resolve(environ)
    raise AssertionError("SingleProcessEnvironment always matches")  # pragma: no cover
