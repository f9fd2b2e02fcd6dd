"""The process group: pick the device and backend, form the group, tear it down on every exit path.

Also the few collective helpers the trainer needs. Each works in a world of one without a group,
so single-process code paths stay the same as distributed ones.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping, TypeVar

import torch
import torch.distributed as dist

from mgpu.cluster.environment import ProcessEnv, detect_environment
from mgpu.errors import MgpuError
from mgpu.parallel.gloo_threads import settle_at_exit

__all__ = [
    "DEFAULT_INIT_TIMEOUT",
    "DistContext",
    "all_reduce",
    "barrier",
    "broadcast_object",
    "cpu_threads_per_rank",
    "get_rank",
    "get_world_size",
    "nccl_environment",
    "process_group",
    "rank_zero_only",
    "select_device",
    "set_collective_timeout",
]

# Long on purpose: on a busy cluster the last node of a job can start minutes after the first, and a
# short timeout turns that ordinary delay into a crash. Bad configurations fail earlier, in validation.
DEFAULT_INIT_TIMEOUT = timedelta(minutes=30)

F = TypeVar("F", bound=Callable[..., Any])

_groups_formed = 0
"""Default process groups this process formed (one after another: `process_group` refuses a second at once)."""


@dataclass(frozen=True)
class DistContext:
    """What a rank knows once its group is formed."""

    env: ProcessEnv
    device: torch.device
    backend: str


def select_device(env: ProcessEnv, cuda_available: bool | None = None, visible_gpus: int | None = None
                  ) -> torch.device:
    """The GPU this rank owns, or the CPU.

    With every GPU of the node visible to every task (`--gpus-per-node`), the local rank picks one;
    with one GPU per task (`--gpus-per-task=1`, `--gpu-bind`), the only visible device is ours.
    """
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if not cuda_available:
        return torch.device("cpu")
    visible_gpus = torch.cuda.device_count() if visible_gpus is None else visible_gpus
    if visible_gpus == 1:
        return torch.device("cuda", 0)
    if env.local_rank < visible_gpus:
        return torch.device("cuda", env.local_rank)
    shown = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    raise MgpuError(f"local rank {env.local_rank} but only {visible_gpus} GPUs are visible "
                    f"(CUDA_VISIBLE_DEVICES={shown}): request one GPU per task (--gpus-per-node equal to "
                    f"--ntasks-per-node)")


def cpu_threads_per_rank(local_world_size: int, environ: Mapping[str, str] | None = None,
                         usable_cpus: int | None = None) -> int | None:
    """Intra-op threads for each of `local_world_size` ranks sharing this machine's usable CPUs, or None
    to keep torch's default: a world of one, or OMP_NUM_THREADS set by the user (or by srun's
    templates). Without it every rank starts a thread per core and N ranks oversubscribe the cores
    N-fold (measured: the 2-rank quick start took twice as long on 2 cores). Lightning does the same.
    Where Slurm bound each task to its own CPUs, the usable CPUs (this process's affinity mask) are this
    task's alone and are not divided again (see `_bound_to_this_task`)."""
    environ = os.environ if environ is None else environ
    if local_world_size <= 1 or environ.get("OMP_NUM_THREADS"):
        return None
    if usable_cpus is None:
        usable_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if _bound_to_this_task(environ, usable_cpus, local_world_size):
        return max(1, usable_cpus)
    return max(1, usable_cpus // local_world_size)


def _bound_to_this_task(environ: Mapping[str, str], usable_cpus: int, local_world_size: int) -> bool:
    """Whether this rank's affinity mask is its own Slurm task's: SLURM_CPU_BIND_TYPE says Slurm bound it
    (`mask_cpu:`), or the mask is no larger than one task's share (SLURM_CPUS_PER_TASK, else
    SLURM_CPUS_ON_NODE / the ranks here), which a mask shared by the node's tasks cannot be. Not for
    torchrun's workers: they share their agent's mask (one Slurm task's). A mask merely smaller than the
    machine proves nothing: a job's cgroup is smaller too, and all its tasks on the node share it."""
    if "TORCHELASTIC_RUN_ID" in environ:
        return False
    if environ.get("SLURM_CPU_BIND_TYPE", "").strip(":,").lower() not in ("", "none"):
        return True
    share = _count(environ.get("SLURM_CPUS_PER_TASK"))
    if share is None:
        on_node = _count(environ.get("SLURM_CPUS_ON_NODE"))
        share = on_node // local_world_size if on_node is not None else None
    return share is not None and 0 < usable_cpus <= share


def _count(value: str | None) -> int | None:
    """A positive integer from a Slurm variable, or None (unset or garbage: then it says nothing)."""
    try:
        number = int(value) if value else None
    except ValueError:
        return None
    return number if number is not None and number > 0 else None


FLIGHT_RECORDER_ENTRIES = 2000
"""Entries NCCL's flight recorder keeps per rank (torch 2.13's default; older releases default to 0: off)."""
NCCL_TIMEOUT_TRACE = "nccl-timeout-trace-rank"
"""Where torch writes the flight recorder when NCCL's own watchdog times a collective out: `<logs>/<this><N>`."""


def nccl_environment(environ: Mapping[str, str], torch_version: str = torch.__version__,
                     trace_dir: Path | None = None) -> dict[str, str]:
    """The variables mgpu sets for an NCCL group where the user has not set them (nothing here is applied).

    - TORCH_NCCL_ASYNC_ERROR_HANDLING=3: a collective that times out or fails ends the process instead of
      waiting forever, without aborting the communicator first (torch's default: mode 1's abort from the
      watchdog thread ends the process before the flight recorder is written, pytorch/pytorch#121055);
    - the flight recorder on, with FLIGHT_RECORDER_ENTRIES entries: torch >= 2.9 reads TORCH_FR_BUFFER_SIZE
      (and the old TORCH_NCCL_TRACE_BUFFER_SIZE, with a deprecation warning; the cut torchtitan makes too),
      older ones only the old name;
      where the user set either, neither is touched (the new name would override a user's old one);
    - TORCH_NCCL_DUMP_ON_TIMEOUT=1: NCCL's own watchdog writes the recorder when a collective times out;
    - with `trace_dir`, that file goes there (TORCH_FR_DUMP_TEMP_FILE, before 2.9
      TORCH_NCCL_DEBUG_INFO_TEMP_FILE: a prefix, the rank appended) instead of ~/.cache/torch."""
    new_names = _release(torch_version) >= (2, 9)
    wanted = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    buffer = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
    if not any(name in environ for name in buffer):
        wanted[buffer[0] if new_names else buffer[1]] = str(FLIGHT_RECORDER_ENTRIES)
    dump = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if trace_dir is not None and not any(name in environ for name in dump):
        wanted[dump[0] if new_names else dump[1]] = str(trace_dir / NCCL_TIMEOUT_TRACE)
    return {name: value for name, value in wanted.items() if name not in environ}


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as '2.13.0+cpu' or '2.10.0a0+git1234'."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def _init_method(env: ProcessEnv) -> str:
    host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
    return f"tcp://{host}:{env.master_port}"


@contextlib.contextmanager
def process_group(env: ProcessEnv | None = None, timeout: timedelta = DEFAULT_INIT_TIMEOUT,
                  backend: str | None = None, trace_dir: Path | None = None,
                  wait_setting: str = "distributed.init_timeout_s") -> Iterator[DistContext]:
    """Form the default process group for this rank and destroy it however the block exits.

    NCCL when this rank has a GPU, gloo otherwise. `timeout` bounds the rendezvous and every
    collective; with NCCL, async error handling makes a stuck collective end the process
    instead of hanging it, and the flight recorder is on (see `nccl_environment`; `trace_dir`:
    where NCCL's watchdog writes it on a timeout). A rendezvous that does not complete in `timeout` is an
    MgpuError in one line, which names `wait_setting` as what sets the wait.
    """
    env = detect_environment() if env is None else env
    threads = cpu_threads_per_rank(env.local_world_size)
    if threads is not None:
        torch.set_num_threads(threads)
    device = select_device(env)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "nccl":
        # Read when the group is created: set before it is.
        os.environ.update(nccl_environment(os.environ, trace_dir=trace_dir))
    if dist.is_initialized():
        raise MgpuError("a default process group already exists in this process: form it only once")
    kwargs: dict[str, Any] = {"backend": backend, "rank": env.rank, "world_size": env.world_size,
                              "timeout": timeout}
    if backend == "nccl":
        kwargs["device_id"] = device
    global _groups_formed
    try:
        if env.world_size == 1:
            kwargs["store"] = dist.HashStore()  # a world of one needs no port at all
        elif _groups_formed == 0:
            kwargs["init_method"] = _init_method(env)
        else:
            # Not the first group this process forms (a sweep of Sessions in one script): its keys in a namespace
            # of its own. A store that outlives a group (torchrun's agent's, mgpu.run.spawn's) still holds the
            # first's, and torch names every default group alike: the rendezvous met them and waited for ever.
            store, _, _ = next(dist.rendezvous(_init_method(env), env.rank, env.world_size, timeout=timeout))
            store.set_timeout(timeout)
            kwargs["store"] = dist.PrefixStore(f"mgpu-group-{_groups_formed}", store)
        dist.init_process_group(**kwargs)
    except (dist.DistStoreError, dist.DistNetworkError) as error:
        raise MgpuError(_rendezvous_failure(env, timeout, error, wait_setting)) from None
    _groups_formed += 1
    settle_at_exit()  # a group's gloo workers, done before the interpreter finalizes (mgpu.parallel.gloo_threads)
    try:
        yield DistContext(env=env, device=device, backend=backend)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _rendezvous_failure(env: ProcessEnv, timeout: timedelta, error: Exception,
                        wait_setting: str = "distributed.init_timeout_s") -> str:
    """One line for a rendezvous that did not complete: who waited for whom, and where to look."""
    where = f"{env.master_addr}:{env.master_port}"
    seen = " ".join(str(error).split())[:160]
    if env.rank == 0:
        what = f"rank 0 waited {timeout.total_seconds():.0f} s at {where} for all {env.world_size} ranks ({seen})"
    else:
        what = f"rank {env.rank} could not reach rank 0 at {where} within {timeout.total_seconds():.0f} s ({seen})"
    return (f"rendezvous failed: {what}: check that every task started (squeue, sacct), that "
            f"{env.master_addr} resolves on every node and port {env.master_port} is free; "
            f"{wait_setting} sets the wait")


def set_collective_timeout(timeout: timedelta, *groups: Any) -> None:
    """The timeout of every collective on the default group (and `groups`) from now on: once every rank has
    trained a step, a collective that waits long means a hung peer, not a slow start (torchtitan does the
    same after its first step)."""
    for group in (None, *groups):
        if group is not None or dist.is_initialized():
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank_zero_only(fn: F) -> F:
    """Run `fn` on global rank 0 only; other ranks get None."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs) if get_rank() == 0 else None

    return wrapper  # type: ignore[return-value]  # wraps() keeps fn's signature


def barrier() -> None:
    if get_world_size() > 1:
        dist.barrier()


def all_reduce(value: torch.Tensor | float, op: Literal["sum", "mean", "max", "min"] = "sum",
               device: torch.device | None = None) -> torch.Tensor:
    """Reduce a tensor or a Python number across ranks; returns a new tensor, the input is untouched."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().clone()
    else:
        tensor = torch.tensor(value, dtype=torch.float64, device=device)
    if get_world_size() > 1:
        reduce_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM,
                     "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        dist.all_reduce(tensor, op=reduce_op)
        if op == "mean":
            # gloo has no AVG op; sum then divide works on every backend.
            tensor = tensor / get_world_size()
    return tensor


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Every rank returns rank `src`'s `obj` (pickled; keep it small)."""
    if get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]
