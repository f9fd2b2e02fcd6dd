"""`mgpu.spawn(main, args, nprocs=N)`: torch's `mp.spawn` (it calls `main(rank, *args)`) for a loop on
mgpu.Session, that also runs unchanged under a launcher: where srun, torchrun or submitit already started
this process as one rank, `main(rank, *args)` runs here, once; otherwise N local ranks start, each with
the environment a Session reads (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
`python -m mgpu.run.spawn -n N script.py [args]` does the same for a script (torchrun's local role).

Unlike mp.spawn, a stop reaches every rank and nothing is left behind: the ranks share this process's
process group, so a terminal's Ctrl-C reaches each of them (each treats it as a stop: save, then exit);
this process ignores it and waits for them; a SIGTERM (or SIGHUP, SIGUSR1, SIGUSR2) sent to this process alone
is passed on to them as a stop;
a rank whose parent dies gets SIGTERM (PR_SET_PDEATHSIG), so no rank is orphaned. A time limit, when
given, is kept as Slurm keeps one: the requeue signal some seconds before it, SIGTERM at it, SIGKILL
after a grace period. The exit code is the ranks': 0 when all finished, 3 when they stopped and saved,
else the first other non-zero one. The resume command a rank prints is the command that started them
(`python -m mgpu.run.spawn -n 2 loop.py ...`, or the script that calls `mgpu.spawn`): pasted, it restarts the same
world. A rank's uncaught exception goes to `sys.excepthook` (where a session records it), then exit code 1.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import runpy
import signal
import sys
import time
from typing import Any, Callable, Sequence

from mgpu.run.outcome import SPAWN_ARGV, STOPPED_EXIT_CODE

__all__ = ["host_store", "spawn"]

_PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
"""Signals that stop the local ranks when sent to the spawning process alone (passed on as SIGTERM, the requeue
signal as itself)."""
KILL_AFTER_S = 30.0
"""After the time limit's SIGTERM, the ranks' grace period before SIGKILL (Slurm's KillWait)."""


def host_store() -> Any:
    """The ranks' rendezvous store, hosted here as torchrun's agent hosts it: bound to a port the system
    picks and kept for the ranks' lifetime. (A port found by binding and closing a probe could be taken by
    anyone before rank 0 binds it again.)"""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=30))


def _rank(fn: Callable[..., Any], args: tuple[Any, ...], rank: int, world: int, port: int, parent: int,
          launch: list[str], start_method: str | None) -> None:
    # A process started by `spawn` has its start method set to `spawn` too (multiprocessing's preparation): its
    # DataLoader workers would start from new interpreters, seconds each, where under srun or torchrun they fork.
    # The rank gets the spawning process's own choice instead (None: the platform's default).
    multiprocessing.set_start_method(start_method, force=True)
    try:  # Linux: SIGTERM to this rank when the spawning process dies, whatever killed it
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the line above: nobody waits for this rank
        os._exit(1)
    # TORCHELASTIC_USE_AGENT_STORE: rank 0 joins the store this process hosts instead of binding its own.
    # SPAWN_ARGV: the command that started the ranks (`python -m mgpu.run.spawn -n 2 loop.py`), for the resume command.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                      **{SPAWN_ARGV: json.dumps(launch)})
    try:
        fn(rank, *args)
    except Exception:  # multiprocessing would print it without sys.excepthook: a session's hook records it
        sys.excepthook(*sys.exc_info())
        raise SystemExit(1) from None


def spawn(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int | None = None, *, local: bool = False,
          time_limit_s: float | None = None, signal_lead_s: float = 0.0, requeue_signal: str = "USR2") -> None:
    """Run `fn(rank, *args)` on every rank: here, if a launcher started this process as one rank (unless
    `local`); else in `nprocs` local processes (default: one per visible GPU, at least one). `fn` must be
    importable (defined at module level, the script guarded by `if __name__ == "__main__":`), as for
    mp.spawn. Exits with the ranks' code when it is not 0."""
    from mgpu.cluster.environment import detect_environment

    if not local:
        env = detect_environment()
        if env.launcher != "single" or env.world_size > 1:
            fn(env.rank, *args)
            return
    if nprocs is None:
        import torch

        nprocs = max(torch.cuda.device_count(), 1)
    if nprocs == 1 and time_limit_s is None:
        fn(0, *args)
        return
    store = host_store()
    port = int(store.port)
    context = multiprocessing.get_context("spawn")
    launch = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])  # this process's command line
    chosen = multiprocessing.get_start_method(allow_none=True)  # the loop's own set_start_method, if it made one
    procs = [context.Process(target=_rank, args=(fn, args, rank, nprocs, port, os.getpid(), launch, chosen),
                             name=f"rank{rank}") for rank in range(nprocs)]

    def send(signum: int) -> None:
        for proc in procs:
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signum)

    # The ranks start with the stop signals as this process has them; this process then only waits. A stop signal
    # sent to it alone is passed on (SIGUSR1, say, killed it by its default action: its ranks, orphaned, stopped
    # on SIGTERM with a dozen C++ stack dumps): the requeue signal as itself, any other as SIGTERM (a rank does not
    # catch SIGUSR1, which NCCL uses, nor SIGHUP: their default action would end it without a save).
    from mgpu.stop.preemption import signal_number

    requeue = signal_number(requeue_signal)
    passed = {signum: signal.SIGTERM for signum in FORWARDED} | {requeue: requeue}
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, *passed)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal sends Ctrl-C to the ranks too
    for signum, as_signal in passed.items():
        signal.signal(signum, _passing_on(send, as_signal))
    try:
        for proc in procs:
            proc.start()
        _wait(procs, send, time_limit_s, signal_lead_s, requeue_signal)
    finally:
        del store
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    codes = [proc.exitcode for proc in procs]
    failed = [code for code in codes if code not in (0, STOPPED_EXIT_CODE)]
    if failed:
        print(f"mgpu.run.spawn: ranks exited with {codes}", file=sys.stderr, flush=True)
        raise SystemExit(failed[0] if failed[0] and failed[0] > 0 else 1)
    if STOPPED_EXIT_CODE in codes:
        raise SystemExit(STOPPED_EXIT_CODE)


def _passing_on(send: Callable[[int], None], as_signal: int) -> Callable[[int, Any], None]:
    return lambda signum, frame: send(as_signal)


def _wait(procs: list[Any], send: Callable[[int], None], time_limit_s: float | None, lead_s: float,
          requeue_signal: str) -> None:
    """Until every rank exits; with a time limit, its signals on the way (each sent once). A rank that fails
    (an exit other than 0 or 3) stops the others, as srun --kill-on-bad-exit does: SIGTERM (a stop: they
    save if they can), SIGKILL after KILL_AFTER_S."""
    from mgpu.stop.preemption import signal_number

    started = time.monotonic()
    due = [] if time_limit_s is None else [(time_limit_s - lead_s, signal_number(requeue_signal)),
                                           (time_limit_s, signal.SIGTERM), (time_limit_s + KILL_AFTER_S, signal.SIGKILL)]
    failed_at: float | None = None
    while alive := [proc for proc in procs if proc.is_alive()]:
        alive[0].join(timeout=0.5)  # one look at each rank: the last may exit between two (was a StopIteration)
        now = time.monotonic()
        if failed_at is None and any(proc.exitcode not in (None, 0, STOPPED_EXIT_CODE) for proc in procs):
            failed_at = now
            failed = [proc.name for proc in procs if proc.exitcode not in (None, 0, STOPPED_EXIT_CODE)]
            print(f"mgpu.run.spawn: {', '.join(failed)} failed: stopping the other ranks", file=sys.stderr, flush=True)
            send(signal.SIGTERM)
        if failed_at is not None and now - failed_at >= KILL_AFTER_S:
            send(signal.SIGKILL)
        while due and now - started >= due[0][0]:
            send(due.pop(0)[1])


def _run_script(rank: int, script: str, argv: list[str]) -> None:
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mgpu.run.spawn", description="Run a script on N local ranks "
                                     "(torchrun's local role), with mgpu.spawn's stop and exit-code behaviour.")
    parser.add_argument("-n", "--nprocs", type=int, required=True, help="local ranks")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.nprocs < 1:
        parser.error(f"--nprocs {args.nprocs}: must be >= 1")
    if not os.path.isfile(args.script):
        parser.error(f"{args.script}: no such script")
    from mgpu.run.spawn import _run_script as run_script  # by its module's name: picklable from `python -m`

    try:
        spawn(run_script, (args.script, args.args), args.nprocs, local=True)
    except SystemExit as done:
        return int(done.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
