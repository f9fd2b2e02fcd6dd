"""`mgpu.spawn(main, args, nprocs=N)`: torch's `mp.spawn` (it calls `main(rank, *args)`) for a loop on
mgpu.Session, that also runs unchanged under a launcher: where srun, torchrun or submitit already started
this process as one rank, `main(rank, *args)` runs here, once; otherwise N local ranks start, each with
the environment a Session reads (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

Unlike mp.spawn, a stop reaches every rank and nothing is left behind: the ranks share this process's
process group, so a terminal's Ctrl-C reaches each of them (each treats it as a stop: save, then exit);
this process ignores it and waits for them; a SIGTERM sent to this process alone is passed on to them;
a rank whose parent dies gets SIGTERM (PR_SET_PDEATHSIG), so no rank is orphaned. The exit code is the
ranks': 0 when all finished, 3 when they stopped and saved, else the first other non-zero one.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import socket
import sys
from typing import Any, Callable

__all__ = ["spawn"]

STOPPED_EXIT_CODE = 3
_PR_SET_PDEATHSIG = 1


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank(fn: Callable[..., Any], args: tuple[Any, ...], rank: int, world: int, port: int, parent: int) -> None:
    try:  # Linux: SIGTERM to this rank when the spawning process dies, whatever killed it
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the line above: nobody waits for this rank
        os._exit(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fn(rank, *args)


def spawn(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int | None = None) -> None:
    """Run `fn(rank, *args)` on every rank: here, if a launcher started this process as one rank; else in
    `nprocs` local processes (default: one per visible GPU, at least one). `fn` must be importable (defined at
    module level, the script guarded by `if __name__ == "__main__":`), as for mp.spawn. Exits with the
    ranks' code when it is not 0."""
    from mgpu.environment import detect_environment

    env = detect_environment()
    if env.launcher != "single" or env.world_size > 1:
        fn(env.rank, *args)
        return
    if nprocs is None:
        import torch

        nprocs = max(torch.cuda.device_count(), 1)
    if nprocs == 1:
        fn(0, *args)
        return
    port = _free_port()
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_rank, args=(fn, args, rank, nprocs, port, os.getpid()), name=f"rank{rank}")
             for rank in range(nprocs)]
    # The ranks start with the stop signals as this process has them; this process then only waits.
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal sends Ctrl-C to the ranks too

    def forward(signum: int, frame: Any) -> None:
        for proc in procs:
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    codes = [proc.exitcode for proc in procs]
    failed = [code for code in codes if code not in (0, STOPPED_EXIT_CODE)]
    if failed:
        print(f"mgpu.spawn: ranks exited with {codes}", file=sys.stderr, flush=True)
        raise SystemExit(failed[0] if failed[0] and failed[0] > 0 else 1)
    if STOPPED_EXIT_CODE in codes:
        raise SystemExit(STOPPED_EXIT_CODE)
