"""The doctor's probe: what runs inside its Slurm jobs, one task per node. No torch, only the standard library
and two pure mgpu modules (the node list grammar, the rendezvous port).

    python mgpu/submit/doctor_probe.py preempt DIR [--max-s S]   # records signals until killed (SIGTERM ignored)
    python mgpu/submit/doctor_probe.py env DIR [--max-s S]       # the job's environment, then waits for --signal

Every task appends JSON lines to `DIR/<mode>-r<restart>-t<task>.log`: `{"t": unix time, "ev": ..., ...}`.
`preempt` also rewrites `DIR/preempt-r<restart>-t<task>.beat` every 0.1 s: the last beat before SIGKILL
tells when the kill came. A requeued job's next run (SLURM_RESTART_COUNT > 0) logs `start` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run by path inside the job: the repository is three folders up
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from mgpu.cluster.environment import derive_master_port  # noqa: E402
from mgpu.cluster.hostlist import expand_hostlist  # noqa: E402

SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGCONT", "SIGINT", "SIGHUP", "SIGXCPU")
RENDEZVOUS_S = 20.0
SHARED_FS_S = 30.0
AFTER_TERM_S = 30.0  # a requeue sends TERM, and KILL after KillWait: outlive neither by much

_fd = -1
_received: list[tuple[str, float]] = []


def log(event: str, **fields: Any) -> None:
    """One line in one os.write on an O_APPEND descriptor: complete lines even from a signal handler that
    interrupts another write (a buffered file object would raise 'reentrant call' there)."""
    os.write(_fd, (json.dumps({"t": round(time.time(), 4), "ev": event, **fields}) + "\n").encode())


def _on_signal(number: int, frame: Any) -> None:
    # The doctor measures when each signal arrives, so the handler logs at once, not from the main loop:
    # a SIGKILL may follow within milliseconds. It also sets the flag the main loop reads.
    name = signal.Signals(number).name
    _received.append((name, time.time()))
    log("signal", sig=name)


def _install() -> None:
    for name in SIGNALS:
        signal.signal(getattr(signal, name), _on_signal)


def _seen(name: str) -> bool:
    return any(sig == name for sig, _ in _received)


def _resolve(hosts: list[str]) -> None:
    for host in hosts:
        try:
            addrs = sorted({info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
            log("resolve", host=host, addrs=addrs)
        except OSError as error:
            log("resolve", host=host, error=str(error))


def _rendezvous(rank: int, hosts: list[str], job_id: str) -> None:
    """Rank 0 listens on the port mgpu would use for this job; every other rank connects to the first node."""
    port, deadline = derive_master_port(job_id), time.monotonic() + RENDEZVOUS_S
    if rank == 0:
        try:
            with socket.create_server(("", port)) as server:
                server.settimeout(1.0)
                accepted = 0
                while accepted < len(hosts) - 1 and time.monotonic() < deadline:
                    try:
                        conn, peer = server.accept()
                    except socket.timeout:
                        continue
                    conn.close()
                    accepted += 1
                log("listen", port=port, accepted=accepted)
        except OSError as error:
            log("listen", port=port, error=str(error))
        return
    last = ""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((hosts[0], port), timeout=2.0):
                log("connect", host=hosts[0], port=port)
                return
        except OSError as error:
            last = str(error)
            time.sleep(0.3)
    log("connect", host=hosts[0], port=port, error=last or "timed out")


def _shared_fs(rank: int, directory: Path, job_id: str) -> None:
    """Rank 0 writes a file, fsyncs it and renames it into place (as a checkpoint's pointer is); the others
    wait for it to appear with the right content."""
    final = directory / f"shared-{job_id}"
    if rank == 0:
        tmp = directory / f".shared-{job_id}.tmp"
        written = time.time()
        with open(tmp, "w", encoding="utf-8") as file:
            file.write(f"{job_id} {written}\n")
            file.flush()
            os.fsync(file.fileno())
        os.rename(tmp, final)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        log("renamed", path=str(final), written=written)
        return
    deadline = time.monotonic() + SHARED_FS_S
    while time.monotonic() < deadline:
        try:
            text = final.read_text(encoding="utf-8")
        except OSError:
            text = ""
        if text.startswith(f"{job_id} ") and text.endswith("\n"):
            log("seen", path=str(final), written=float(text.split()[1]))
            return
        time.sleep(0.05)
    log("seen", path=str(final), error=f"not there after {SHARED_FS_S:.0f} s")


def _requeue(job_id: str) -> None:
    path = shutil.which("scontrol")
    if path is None:
        log("requeue", error="no scontrol on PATH")
        return
    try:
        # Its own session, so that a TERM to the job's process group spares it; Slurm's process tracking can still
        # signal it (a descendant of the task) before it exits: rc < 0, and the job's next run tells (doctor).
        proc = subprocess.run([path, "requeue", job_id], capture_output=True, text=True, timeout=30,
                              start_new_session=True)
        log("requeue", rc=proc.returncode, out=(proc.stdout + proc.stderr).strip()[:300])
    except (OSError, subprocess.TimeoutExpired) as error:
        log("requeue", error=str(error))


def main(argv: list[str] | None = None) -> int:
    global _fd
    parser = argparse.ArgumentParser(prog="doctor_probe")
    parser.add_argument("mode", choices=("preempt", "env"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--max-s", type=float, default=300.0, help="exit after this long whatever happens")
    args = parser.parse_args(argv)
    env = os.environ
    restart = int(env.get("SLURM_RESTART_COUNT") or 0)
    rank = int(env.get("SLURM_PROCID") or 0)
    job_id = env.get("SLURM_JOB_ID", "0")
    prefix = args.dir / f"{args.mode}-r{restart}-t{rank}"
    _fd = os.open(f"{prefix}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _install()
    log("start", host=socket.gethostname(), node=env.get("SLURMD_NODENAME"), restart=restart, rank=rank,
        job=job_id, nodelist=env.get("SLURM_JOB_NODELIST"), pid=os.getpid(), scontrol=shutil.which("scontrol"))
    if restart > 0:
        return 0
    deadline = time.monotonic() + args.max_s
    if args.mode == "preempt":
        beat = os.open(f"{prefix}.beat", os.O_WRONLY | os.O_CREAT, 0o644)
        while time.monotonic() < deadline:  # SIGTERM is recorded, not obeyed: only SIGKILL ends this
            os.pwrite(beat, f"{time.time():<20.4f}".encode(), 0)
            time.sleep(0.1)
        log("gave_up", after_s=args.max_s)
        return 0
    hosts = expand_hostlist(env.get("SLURM_JOB_NODELIST", socket.gethostname()))
    _resolve(hosts)
    if len(hosts) > 1:
        _rendezvous(rank, hosts, job_id)
        _shared_fs(rank, args.dir, job_id)
    log("ready")
    while time.monotonic() < deadline and not (_seen("SIGUSR2") or _seen("SIGTERM")):
        time.sleep(0.05)
    if _seen("SIGUSR2") and not _seen("SIGTERM") and rank == 0:
        _requeue(job_id)
    term_by = time.monotonic() + AFTER_TERM_S
    while not _seen("SIGTERM") and time.monotonic() < min(term_by, deadline):
        time.sleep(0.05)
    log("exit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
