"""The pieces of one rank's setup and teardown that mgpu.run.session puts together: its logs, its record of
the launcher, the run directory's claim, the watchdog, and removing what an attempt that never began
created. Nothing here imports torch at module import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from mgpu.config.loading import Config
from mgpu.cluster.environment import ProcessEnv
from mgpu.errors import MgpuError
from mgpu.record.rundir import RunDir, RunInUse

__all__ = ["claim", "discard", "first_missing", "join_run", "no_beat", "prepare_run_dir", "process_start", "record_rank",
           "setup_logging", "start_watchdog"]

log = logging.getLogger("mgpu.train")


def no_beat(phase: str, step: int | None = None) -> None:
    """Without a watchdog, progress is not recorded."""


def process_start() -> float:
    """This process's start (Unix time), from /proc (Linux); now, where it cannot be read."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def prepare_run_dir(run: RunDir) -> Path | None:
    """Create the run directory (and its logs); returns what this attempt created (removed if it never trains).
    MgpuError, in one line, for a path that is a file or a directory that cannot be created."""
    for path in (run.path, run.checkpoints, run.tensorboard):
        if path.exists() and not path.is_dir():
            raise MgpuError(f"{path} is a file, not a directory: move it away, or start another run (run.name=...)")
    created = first_missing(run.path)
    try:
        run.logs.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise MgpuError(f"run directory {run.path}: cannot create it ({error.strerror}): set run.root "
                        f"(or jobs/submit.py --folder) to a writable directory") from None
    return created


def setup_logging(run: RunDir, rank: int) -> None:
    """Every rank logs to `<run>/logs/rank<N>.log`; rank 0 also to stdout (the batch log)."""
    root = logging.getLogger("mgpu")
    root.setLevel(logging.INFO)
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S")
    run.logs.mkdir(parents=True, exist_ok=True)
    try:
        file_handler = logging.FileHandler(run.rank_log(rank))
    except OSError as error:  # a run directory that exists on a read-only filesystem, or another user's
        raise MgpuError(f"run directory {run.path}: cannot write {run.rank_log(rank)} ({error.strerror}): make it "
                        f"writable for this user, or set run.root (or jobs/submit.py --folder) to a writable "
                        f"directory (a new run)") from None
    file_handler.setFormatter(formatter)
    root.addHandler(file_handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        root.addHandler(console)
    root.propagate = False
    # A handler that cannot write (a full disk) must not print a traceback per log line.
    logging.raiseExceptions = False


NODE_ENV = "MGPU_NODE_NAME"
"""This node's name where the launcher does not give one (tests: two "nodes" on one host)."""


def node_name(env: ProcessEnv) -> str:
    """The node this rank runs on, as Slurm names it (MGPU_NODE_NAME first, else the job's node list, else the host)."""
    return os.environ.get(NODE_ENV) or (env.nodes[env.node_rank] if 0 <= env.node_rank < len(env.nodes)
                                        else socket.gethostname())


def rank_node(run: RunDir, rank: int) -> str:
    """The node `rank` recorded at its start (`logs/rank<N>.json`: its `node`, else its host; "?" when unreadable)."""
    try:
        record = json.loads(run.rank_record(rank).read_text())
        return str(record.get("node") or record["hostname"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "?"


def record_rank(run: RunDir, env: ProcessEnv, device: str, backend: str) -> None:
    """`logs/rank<N>.json`: who this rank was in this run (the launcher's view, for debugging and tests)."""
    import torch

    record = {**dataclasses.asdict(env), "device": device, "backend": backend, "hostname": socket.gethostname(),
              "node": node_name(env),
              "slurmd_nodename": os.environ.get("SLURMD_NODENAME"), "pid": os.getpid(),
              "cpu_threads": torch.get_num_threads()}
    try:
        run.rank_record(env.rank).write_text(json.dumps(record, indent=1))
    except OSError as error:  # a full disk: the record is for debugging, training must not stop for it
        log.warning("cannot write %s: %s", run.rank_record(env.rank), error.strerror)


def start_watchdog(cfg: Config, env: ProcessEnv, run: RunDir, backend: str, checkpoint_s: float | None = None,
                   resume_s: float | None = None) -> Any:
    """This rank's watchdog, started; `checkpoint_s`, `resume_s`: its allowances for a save and for a resume
    (default: the config's checkpoint_s and first_step_s; mgpu.state.save_budget)."""
    from mgpu.stop.hang_evidence import report_hang
    from mgpu.stop.watchdog import Watchdog

    def on_hang(beats: Any, stuck: list[int], waited: float, detected: float) -> None:
        if backend == "nccl":
            _dump_nccl_trace(run, env.rank)
        report_hang(run, env.job_id, env.restart_count, env.rank, beats, stuck, waited, watchdog.allowance(),
                    detected)

    def log_file() -> Any:
        return next((h.stream for h in logging.getLogger("mgpu").handlers
                     if isinstance(h, logging.FileHandler)), None)

    watchdog = Watchdog.from_config(cfg.watchdog, env.rank, env.world_size, run.logs, on_hang=on_hang,
                                    log_file=log_file, checkpoint_s=checkpoint_s, resume_s=resume_s)
    return watchdog.start()


def _dump_nccl_trace(run: RunDir, rank: int) -> None:
    """NCCL's flight recorder (enabled by mgpu.parallel.distributed: TORCH_FR_BUFFER_SIZE): what every collective in
    flight was doing, for torch's `torchfrtrace` analyser. Not run here (no GPU)."""
    try:
        import torch

        trace = torch._C._distributed_c10d._dump_nccl_trace()  # type: ignore[attr-defined]  # noqa: SLF001  (NCCL builds only: not in torch's stubs)
        (run.logs / f"nccl-trace-rank{rank}.pkl").write_bytes(trace)
    except Exception as error:  # noqa: BLE001  (evidence is best effort; the exit must still happen)
        log.warning("NCCL flight recorder dump failed: %s", error)


def first_missing(path: Path) -> Path | None:
    """The outermost directory of `path` that does not exist yet (None: `path` exists)."""
    missing = None
    while not path.exists() and path != path.parent:
        missing, path = path, path.parent
    return missing


def discard(run: RunDir, rank: int, created: Path) -> None:
    """Remove what this attempt created in a run directory it created itself, up to `created` (each rank its
    own files, rank 0 the rest; the last to finish removes the emptied directories)."""
    root = logging.getLogger("mgpu")
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    if rank == 0:
        shutil.rmtree(run.path, ignore_errors=True)
    for path in (run.rank_log(rank), run.rank_record(rank)):
        with contextlib.suppress(OSError):  # e.g. never created, under a path that is a file
            path.unlink(missing_ok=True)
    directories = [run.logs, run.path, *[p for p in run.path.parents if created in (p, *p.parents)]]
    for directory in directories:
        with contextlib.suppress(OSError):
            directory.rmdir()


def claim(run: RunDir, env: ProcessEnv) -> None:
    """Rank 0 claims the run directory; every rank fails alike if another live job holds it."""
    from mgpu.parallel.distributed import broadcast_object
    from mgpu.cluster.slurm_job import owns_slurm_job

    refusal = None
    if env.rank == 0:
        try:
            run.claim(env.job_id, slurm=owns_slurm_job())
        except MgpuError as error:
            refusal = str(error)
    refusal = broadcast_object(refusal)
    if refusal is not None:
        raise RunInUse(refusal)


def join_run(run: RunDir, env: ProcessEnv, device: str, backend: str) -> None:
    """*Collective.* This rank in the run directory: its launcher record, the run's claim (every rank fails
    alike if another live job holds it), and on rank 0 where slurm/loop.sbatch's recovery finds the run."""
    record_rank(run, env, device, backend)
    claim(run, env)
    if env.rank == 0:
        run.announce(os.environ)
