"""The timeout ladder as the ledger holds it (mgpu.stop.ladder computes it; the `started` and `first_step` events
record it): the newest of an attempt, and the lines the session's log and `jobs/status.py` show. Pure; no torch.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = ["ladder_lines", "newest_ladder", "seconds"]


def seconds(value: float) -> str:
    """A bound as the ladder prints it: `0.21 s`, `650 s`."""
    return f"{value:.3g} s" if value < 10 else f"{value:.0f} s"


def newest_ladder(events: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The ladder of the newest of `events` that records one (an attempt's first step, else its start)."""
    return next((e["ladder"] for e in reversed(events) if e.get("event") in ("first_step", "started")
                 and isinstance(e.get("ladder"), dict)), None)


def ladder_lines(record: Mapping[str, Any], problems: bool = True) -> list[str]:
    """The ladder, inner to outer, a rung a line, then (`problems`) each order it breaks."""
    lines = ["timeouts    inner to outer, each ending before the next (docs/allowances.md, the ladder):"]
    for title, key in (("", "hang"), ("a stop, from Slurm's first signal:", "stop")):
        rows = record.get(key)
        if title:
            lines.append(f"  {title}")
        for row in rows if isinstance(rows, list) else []:
            try:
                name, bound, why = row
                shown = "?" if bound is None else seconds(float(bound))
            except (TypeError, ValueError):
                continue
            lines.append(f"  {str(name):<21}{shown:>8}  {why}")
    broken = record.get("problems") if problems else None
    for problem in broken if isinstance(broken, list) else []:
        lines.append(f"  order broken: {problem}")
    return lines
