"""Why a run of the resume check failed, for its report: a hang is blamed on the rank that stopped making progress
(the watchdog's verdict in the run's ledger, `hang`: not a rank that waited for it) with the line its loop stood at
(from its stacks, which the rank wrote into its log) and every rank's stacks kept where the report says; any other
failure shows the first failed rank's last lines. Pure file reading, no torch."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mgpu.record.ledger import read_ledger
from mgpu.stop.watchdog import HANG_EXIT_CODE

__all__ = ["Failed", "describe", "innermost", "last_lines"]

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


@dataclass
class Failed:
    """A failed segment: `line` says it in one line (which rank, why, where); `detail` its output's last lines."""
    line: str
    detail: str


def last_lines(check_dir: Path, codes: list[int], count: int = 6, rank: int | None = None) -> str:
    """The end of the output of `rank` (default: the first rank that failed, else rank 0)."""
    if rank is None:
        rank = next((r for r, c in enumerate(codes) if c not in (0, 3)), 0)
    path = check_dir / f"rank{rank}.out"
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return "\n".join(f"      rank {rank}| {line}" for line in text[-count:])


def innermost(log: str, script: Path | None) -> str | None:
    """Where the loop stood in the last stacks dumped into a rank's log (faulthandler's format): the innermost frame
    of the thread that runs `script` (the main thread), with the script's own line when that is another file."""
    marker = "dumping every thread's stack"
    pieces = log.split(marker)[1:]  # each dump's message, then its stacks (a later message may have none: said once)
    for piece in reversed(pieces):
        found = _main_frame(piece.splitlines(), script)
        if found is not None:
            return found
    return None


def _main_frame(lines: list[str], script: Path | None) -> str | None:
    blocks: list[list[tuple[str, str, str]]] = []
    for text in lines:
        if text.startswith(("Thread 0x", "Current thread 0x")):
            blocks.append([])
        elif blocks and (frame := _FRAME.match(text)):
            blocks[-1].append((frame["file"], frame["line"], frame["func"]))
    name = script.name if script is not None else None
    main = next((b for b in blocks if b and b[-1][2] == "<module>" and (name is None or Path(b[-1][0]).name == name)),
                None)
    if main is None:
        return None
    file, line, func = main[0]
    where = f"{file} line {line} (in {func})"
    own = next(((f, n, fn) for f, n, fn in main if name is not None and Path(f).name == name), None)
    if own is not None and own != main[0]:
        where += f", from {own[0]} line {own[1]} (in {own[2]})"
    return where


def describe(run_dir: Path, check_dir: Path, codes: list[int], script: Path | None,
             keep: Callable[[], Path]) -> Failed:
    """Why the segment whose ranks exited with `codes` failed. A hang: the ranks the watchdog blamed, where the
    first of them stood, and every rank's log (with its stacks) copied into the directory `keep()` makes."""
    if HANG_EXIT_CODE not in codes:
        rank = next((r for r, c in enumerate(codes) if c not in (0, 3)), 0)
        detail = last_lines(check_dir, codes, rank=rank)
        said = detail.splitlines()[-1].strip() if detail else ""
        return Failed(f"exit codes {codes}" + (f": {said}" if said else ""), detail)
    hangs = [e for e in read_ledger(run_dir / "events.jsonl") if e.get("event") == "hang"]
    event = hangs[-1] if hangs else {}
    stuck = [int(r) for r in event.get("ranks", [])]
    kept = keep()
    kept.mkdir(parents=True, exist_ok=True)
    for log in sorted((run_dir / "logs").glob("rank*.log")):
        shutil.copy(log, kept / log.name)
    if not stuck:
        return Failed(f"hung (exit codes {codes}; the watchdog could not tell which rank held the others up); every "
                      f"rank's stacks: {kept}", last_lines(check_dir, codes))
    rank = stuck[0]
    phase = event.get("phases", {}).get(str(rank))
    log = kept / f"rank{rank}.log"
    where = innermost(log.read_text(errors="replace"), script) if log.exists() else None
    others = sorted(set(range(len(codes))) - set(stuck))
    line = (f"hung: rank {', '.join(map(str, stuck))} stopped making progress"
            + (f" in step {event['steps'][str(rank)]}" if str(rank) in event.get("steps", {}) else "")
            + (f" (phase {phase})" if phase else "")
            + (f", rank {', '.join(map(str, others))} waiting for it" if others else "")
            + (f"; it was at {where}" if where else "")
            + f"; every rank's stacks: {kept}")
    return Failed(line, last_lines(check_dir, codes, rank=rank))
