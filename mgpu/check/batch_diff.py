"""The batches each rank trained on, as `mgpu.record.check_hooks` recorded them, compared between an unbroken run and a
stopped-and-resumed one (pure, no torch): the first batch that differs, by rank, step, epoch and position, and
the samples the resumed run never trained or trained twice. Used by `python -m mgpu.check.resume`."""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Batch", "BatchVerdict", "compare_batches", "compare_samples", "read_batches", "pieced", "pieced_segments"]


@dataclass(frozen=True)
class Batch:
    """One batch a rank trained on: in optimizer step `step`, ending at `position` of `epoch`."""
    step: int
    epoch: int
    position: int
    samples: tuple[str, ...]
    ids: tuple[int, ...] | None


@dataclass
class BatchVerdict:
    """What differs (empty `first`: the same batches): the first differing batch, and over the whole run the
    samples lost (in the unbroken run, not in the resumed one) and repeated (trained more often)."""
    first: str
    lost: int
    repeated: int
    batches: int
    first_step: int | None = None  # the step of the first batch that differs (None: none, or not by step)

    @property
    def same(self) -> bool:
        return not self.first and not self.lost and not self.repeated


def read_batches(path: Path) -> list[Batch]:
    """A rank's records: each batch with the step it ended in (the step marker after it); batches after the
    last marker (read but not stepped on: a stop) are left out."""
    if not path.exists():
        return []
    pending: list[dict[str, Any]] = []
    batches: list[Batch] = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a killed process
        if "step" in record:
            batches += [Batch(int(record["step"]), r["epoch"], r["position"], tuple(r["samples"]),
                              None if r.get("ids") is None else tuple(r["ids"])) for r in pending]
            pending = []
        else:
            pending.append(record)
    return batches


def pieced(stopped: list[Batch], resumed: list[Batch], stop_step: int) -> list[Batch]:
    """What a stopped-and-resumed rank trained on: the stopped run's batches up to its stop, then the resumed run's."""
    return pieced_segments([stopped, resumed], [stop_step])


def pieced_segments(segments: list[list[Batch]], stops: list[int]) -> list[Batch]:
    """What a rank stopped at each of `stops` and resumed after each trained on: segment i's batches up to stop i,
    the last segment's all."""
    out: list[Batch] = []
    for index, batches in enumerate(segments):
        out += [b for b in batches if index >= len(stops) or b.step <= stops[index]]
    return out


def _where(batch: Batch) -> str:
    return f"step {batch.step} (epoch {batch.epoch}, position {batch.position})"


def compare_batches(unbroken: dict[int, list[Batch]], resumed: dict[int, list[Batch]]) -> BatchVerdict:
    """Rank by rank, batch by batch (the same world size)."""
    first, first_step = "", None
    for rank in sorted(unbroken):
        a, b = unbroken[rank], resumed.get(rank, [])
        for x, y in zip(a, b):
            if x.samples != y.samples:
                first, first_step = f"rank {rank}'s batch at {_where(x)}: other samples than the unbroken run's", x.step
                break
        else:
            if len(a) != len(b):
                longer, which = (a, "unbroken") if len(a) > len(b) else (b, "resumed")
                extra = longer[min(len(a), len(b))]
                first = f"rank {rank}: the {which} run trained {abs(len(a) - len(b))} more batch(es), from {_where(extra)}"
                first_step = extra.step
        if first:
            break
    verdict = compare_samples([x for r in unbroken.values() for x in r], [y for r in resumed.values() for y in r])
    verdict.first, verdict.first_step = first, first_step
    return verdict


def compare_samples(unbroken: list[Batch], resumed: list[Batch]) -> BatchVerdict:
    """The samples of each epoch as a multiset over all ranks (for runs on different world sizes)."""
    def counts(batches: list[Batch]) -> collections.Counter[tuple[int, str]]:
        return collections.Counter((b.epoch, s) for b in batches for s in b.samples)

    a, b = counts(unbroken), counts(resumed)
    lost, repeated = sum((a - b).values()), sum((b - a).values())
    first = ""
    if lost or repeated:
        epochs = sorted({e for e, _ in (a - b) + (b - a)})
        first = f"epoch {epochs[0]}: {lost} sample(s) of the unbroken run never trained, {repeated} trained more often"
    return BatchVerdict(first, lost, repeated, sum(len(x.samples) for x in unbroken))
