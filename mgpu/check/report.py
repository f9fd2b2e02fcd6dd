"""One run's comparison with the unbroken run, as the resume check's report line (pure, no torch): what differs
first and after which stop it shows, the hint, and for a PASS what was compared and what could not be. Used by
mgpu.check.plan, which gathers the `Comparison`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from mgpu.check.batch_diff import BatchVerdict
from mgpu.check.state_diff import IGNORED, Difference, named

__all__ = ["Comparison", "verdict"]

Hint = Callable[..., str]


@dataclass
class Comparison:
    """What compare_runs found. `first`: the first saved step with a difference (its differences, causes first, and
    the optimizer moments' parameter names); `ends`: rank -> the digests of the objects kept outside `state` at the
    end of the unbroken run and of this one (None: another world size, not compared)."""
    changed: bool
    stops: list[Any]
    batches: BatchVerdict
    no_batches: bool
    outside: dict[str, str]
    end_a: int
    end_b: int
    reference_batches: int = 0
    common: list[int] = field(default_factory=list)
    entries: set[str] = field(default_factory=set)
    has_scheduler: bool = False
    first: tuple[int, list[Difference], dict[str, str]] | None = None
    first_logged: int | None = None
    logged_steps: int = 0
    notes: list[str] = field(default_factory=list)
    ends: tuple[dict[int, dict[str, str | None]], dict[int, dict[str, str | None]]] | None = None
    stream_buffer: bool = False


def _number(value: float) -> str:
    return "-" if value == float("inf") else f"{value:.3g}"


def _outside_at_end(c: Comparison) -> tuple[list[str], list[str], list[str]]:
    """(names kept outside `state` that end elsewhere than in the unbroken run, names that end alike, names whose
    state cannot be read: a DataLoader)."""
    if c.ends is None:
        return [], [], []
    a, b = c.ends
    changed, same, unread = set(), set(), set()
    for rank, digests in a.items():
        for name, digest in digests.items():
            other = b.get(rank, {}).get(name, "?")
            if digest is None or other is None:
                unread.add(name)
            elif other != "?" and other != digest:
                changed.add(name)
            elif other == digest:
                same.add(name)
    return sorted(changed), sorted(same - changed), sorted(unread)


def _named(names: list[str], outside: dict[str, str]) -> str:
    return ", ".join(f"`{n}` ({outside[n]})" if n in outside else f"`{n}`" for n in names)


def _after(c: Comparison) -> str:
    """"after the stop at step K (where): " for the stop just before the first step where a difference shows."""
    # A batch or a logged weight of step k follows a stop before k; a checkpoint of step k may be the stop's at k.
    seen = [s for s in (c.batches.first_step, c.first_logged) if s is not None]
    seen += [c.first[0] + 1] if c.first else []
    if len(c.stops) < 2 or not seen:
        return ""
    before = [s for s in c.stops if s.step < min(seen)]
    if not before:
        return ""
    stop = before[-1]
    return f"first seen after the stop at step {stop.step}{f' ({stop.where})' if stop.where else ''}: "


def verdict(c: Comparison, hint: Hint) -> tuple[bool, str, str]:
    """(passed, the report's text, the hint) for one stopped-and-resumed run."""
    changed_out, same_out, unread_out = _outside_at_end(c)
    found = c.first[1] if c.first else []

    def hint_for(batches_differ: bool, no_batches: bool) -> str:
        return hint(found, outside=c.outside, world_changed=c.changed, batches_differ=batches_differ,
                    has_scheduler=c.has_scheduler, no_batches=no_batches)

    if c.end_a != c.end_b and c.batches.same:
        return False, f"the resumed run ended at step {c.end_b}, the unbroken run at step {c.end_a}", (
            hint_for(False, True) if c.no_batches else
            "the loop's length depends on something a resume rebuilds (len(loader) with the world size, a counter "
            "not in `state`)")
    if not c.batches.same or c.first is not None or c.first_logged is not None or changed_out:
        text = hint_for(not c.batches.same, c.no_batches)
        if c.stream_buffer:
            text = ("the stream shuffles through a buffer its state_dict() does not hold (its loader said so at the "
                    "start): shuffle without a buffer (the shard order), or read the files through "
                    "mgpu.data.stream.ShardedStream, which rebuilds its buffer on a resume")
        logged = f"; the weights first differ at logged step {c.first_logged}" if c.first_logged is not None else ""
        if not c.batches.same:
            detail = f"the batches differ: {c.batches.first}"
            if c.batches.lost or c.batches.repeated:
                detail += f" ({c.batches.lost} sample(s) never trained, {c.batches.repeated} trained twice or more)"
            if c.end_a != c.end_b:
                detail += f"; the resumed run ended at step {c.end_b}, the unbroken run at step {c.end_a}"
            detail += logged
        elif c.first is not None:
            step, _, names = c.first
            d = found[0]
            more = f"; {len(found) - 1} more path(s) differ" if len(found) > 1 else ""
            detail = f"at step {step}: {named(d.path, names)}: {d.a} vs {d.b} (max difference {_number(d.largest)}){more}"
            if c.first_logged is not None and c.first_logged < step:
                detail = (f"the weights first differ at logged step {c.first_logged}; the first saved step that "
                          f"differs, {detail.removeprefix('at ')}")
            else:
                detail += logged
        elif c.first_logged is not None:
            detail = f"the saved states agree; the weights first differ at logged step {c.first_logged}"
        else:
            detail = "the saved states, the logged weights and the batches agree"
        if changed_out:
            detail += (f"; kept outside `state`, {_named(changed_out, c.outside)} ended elsewhere than in the "
                       "unbroken run")
            if c.batches.same and c.first is None and c.first_logged is None:
                them = "them" if len(changed_out) > 1 else "it"
                text = (f"{_named(changed_out, c.outside)}: the loop keeps {them} outside `state`, so a resume starts "
                        f"{them} over (an EMA or a teacher the training never reads, a generator, a best-metric "
                        f"tracker): put {them} in the state given to session.load() (an average of the weights: "
                        "mgpu.EMA)")
        return False, _after(c) + detail, text
    return True, "; ".join(_compared(c, same_out, unread_out)), ""


def _compared(c: Comparison, same_out: list[str], unread_out: list[str]) -> list[str]:
    """A PASS's parts: what was compared, and what could not be."""
    entries = ", ".join(sorted(c.entries - set(IGNORED)))
    steps = ", ".join(map(str, c.common))
    parts = [f"{len(c.common)} saved step(s) equal ({steps}; {entries})" if not c.changed else
             f"{len(c.common)} saved step(s) agree ({steps}; loader, schedule and step counts exactly)"]
    if not c.changed:
        parts.append(f"weights equal at {c.logged_steps} logged step(s)" if c.logged_steps else
                     "no weights logged between the saves (session.log)")
    if c.no_batches:
        parts.append("not compared: the batches (the loop's data does not come from session.loader)")
    else:
        parts.append(f"the same {c.reference_batches} batches on the ranks" if not c.changed else
                     f"all {c.batches.batches} samples trained once, as unbroken")
    if same_out:
        parts.append(f"kept outside `state` and equal at the end: {_named(same_out, c.outside)}")
    if unread_out:
        parts.append(f"not compared: {_named(unread_out, c.outside)} (kept outside `state`, its state unreadable)")
    return parts + c.notes
