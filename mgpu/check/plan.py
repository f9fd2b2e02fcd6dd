"""The runs `python -m mgpu.check.resume` makes and what it compares after each (see mgpu/check/resume.py for
the command): an unbroken run; one run stopped and resumed at each moment where resume bugs show (mid-epoch in the
first epoch, at an epoch's end and mid-epoch in a later one where the loop has more than one, one step after a save
while it is written); a resume on half the ranks. Every saved state compared by path (mgpu.check.state_diff), the
weights at every logged step (mgpu.record.goodput's fingerprints), each rank's batches (mgpu.check.batch_diff) and,
at the end, the objects the loop keeps outside `state` (mgpu.record.check_hooks), into one report."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mgpu.check.batch_diff import Batch, compare_batches, compare_samples, pieced_segments, read_batches
from mgpu.check.failures import describe
from mgpu.check.report import Comparison, verdict
from mgpu.check.runs import Run, Runner, Target, failed
from mgpu.check.state_diff import differences, flatten, hint, parameter_names
from mgpu.errors import MgpuError

__all__ = ["Stop", "check", "choose_stop", "choose_stops", "too_short"]


@dataclass
class Outcome:
    """One check's line: `ok` None for skipped."""
    name: str
    ok: bool | None
    text: str
    hint: str = ""


@dataclass(frozen=True)
class Stop:
    """A moment the check stops a run at: after step `step`, `where` that is (for the report)."""
    step: int
    where: str


def check(target: Target, args: argparse.Namespace, runner: Runner, scratch: Path) -> tuple[int, str]:
    """Run the checks; (exit code, report)."""
    world = args.nproc
    unbroken = Run("unbroken", scratch / "unbroken")
    codes = runner.segment(unbroken, world, args.steps)
    if failed(codes):
        why = describe(unbroken.run_dir, unbroken.segments[0], codes, target.script, lambda: runner.kept("unbroken"))
        raise MgpuError(f"the unbroken run failed ({why.line}); a resume can only be checked on a loop that runs")
    reference = {r: read_batches(unbroken.segments[0] / f"batches.rank{r}.jsonl") for r in range(world)}
    total = _last_step(unbroken, reference[0])
    if total < 2:
        raise MgpuError(too_short(total, *_recorded(unbroken.segments[0] / "batches.rank0.jsonl")))
    if args.stop_at is not None and args.stop_at >= total:
        raise MgpuError(f"--stop-at {args.stop_at}: the loop ran {total} steps; stop before its last")
    workers = _workers(unbroken.segments[0])
    chosen = set(args.checks.split(","))
    automatic = choose_stops(reference[0], total)
    first = Stop(args.stop_at, _where(reference[0], args.stop_at)) if args.stop_at else automatic[0]
    stops = ([first] if args.stop_at else automatic) if "stop" in chosen else []
    outcomes = []
    # One step after the loop's first save (the unbroken run's): the stop comes while that save is written in the
    # background (when the segment before made it). A stop already there is that stop too.
    during = next((s + 1 for s in _saved_steps(unbroken.run_dir) if s + 1 < total), None)
    if "save" in chosen and during is None:
        outcomes.append(Outcome("stop during a save", None, "skipped: the loop saved no checkpoint before its "
                                "last step (session.save every few steps gives one to stop during)"))
    elif "save" in chosen and during is not None:
        saving = f"while step {during - 1}'s save is written"
        same = [x for x in stops if x.step == during]
        stops = sorted([x for x in stops if x.step != during] + [
            Stop(during, f"{same[0].where}, {saving}" if same and same[0].where else saving)], key=lambda x: x.step)
    if stops:
        name = ("stopped at step " + ", ".join(f"{x.step} ({x.where})" if x.where else str(x.step) for x in stops)
                + (" and resumed each time" if len(stops) > 1 else " and resumed"))
        outcomes.append(_stop_and_resume(runner, Run("stopped", scratch / "stopped"), unbroken, reference, world,
                                         stops, args.steps, name))

    half = world // 2
    if "world" not in chosen:
        pass
    elif target.halved_args is None:
        skipped = ("needs an even --nproc" if world % 2 else
                   "the config has no data.global_batch_size (per-rank batches change the run with the world size)"
                   if target.config else "give --world-args with the arguments that keep the loop's global batch on "
                   "half the ranks (e.g. '--accumulate 2')")
        outcomes.append(Outcome("a world-size change" + (f" ({world} ranks resumed on {half})" if half else ""), None,
                                f"skipped: {skipped}"))
    else:
        resized = Run("resized", scratch / "resized")
        outcomes.append(_stop_and_resume(runner, resized, unbroken, reference, world, [first], args.steps,
                                         f"stopped at step {first.step} on {world} ranks, resumed on {half}",
                                         resume_world=half))
    head = (f"check_resume: {target.label} on {world} rank(s), {total} steps, "
            + (f"{workers} DataLoader worker(s) (the loop's own)" if workers else
               "no DataLoader workers (the loop uses none; a loop that does is checked with them)"))
    lines = [head]
    for outcome in outcomes:
        verdict = {True: "PASS", False: "DIFFERS", None: "skipped"}[outcome.ok]
        text = outcome.text if outcome.ok is not None else outcome.text.removeprefix("skipped: ")
        lines.append(f"  {outcome.name}: {verdict}: {text}")
        if outcome.hint:
            lines.append(f"    hint: {outcome.hint}")
    differs = any(o.ok is False for o in outcomes)
    lines.append("DIFFERS" if differs else "PASS")
    return (1 if differs else 0), "\n".join(lines)


def _where(batches: list[Batch], step: int) -> str:
    mine = [b for b in batches if b.step == step]
    return f"epoch {mine[-1].epoch}, position {mine[-1].position}" if mine else ""


def _mid_epoch(batches: list[Batch], total: int) -> tuple[list[int], list[int], dict[int, Batch]]:
    """(the steps that end inside an epoch, the steps that end one before the run's last step, each step's last
    batch), from rank 0's batch records."""
    last = {b.step: b for b in batches}
    nxt = {b.step: b for b in reversed(batches)}  # each step's first batch
    mid = [k for k in range(1, total) if k in last and k + 1 in nxt and nxt[k + 1].epoch == last[k].epoch]
    ends = [k for k in range(1, total) if k in last and k + 1 in nxt and nxt[k + 1].epoch != last[k].epoch]
    return mid, ends, last


def choose_stop(batches: list[Batch], total: int) -> int:
    """A mid-epoch step of the first epoch about a third of the way (not an epoch's last step); a third of the way
    without batches."""
    return choose_stops(batches, total)[0].step


def choose_stops(batches: list[Batch], total: int) -> list[Stop]:
    """Where the stop check stops: mid-epoch in the first epoch (about a third of the way), and where the loop has
    more than one epoch, at the first epoch's end and mid-epoch in a later one (about two thirds of the way): a
    bug that shows only from the second epoch on (an order drawn from a generator made at start) or at an epoch's
    end (a schedule stepped per epoch) is stopped on. Without batch records (the loop's own data: epochs unknown),
    a third and two thirds of the way."""
    mid, ends, last = _mid_epoch(batches, total)
    third, two_thirds = max(1, total // 3), max(1, 2 * total // 3)
    if not last:
        return [Stop(k, "") for k in sorted({third, two_thirds}) if k < total]
    opening = last[min(last)].epoch
    early = [k for k in mid if last[k].epoch == opening] or mid
    k1 = min(early, key=lambda k: (abs(k - third), k)) if early else third
    stops = [Stop(k1, _where(batches, k1))]
    later = [k for k in mid if last[k].epoch > last.get(k1, last[min(last)]).epoch]
    if ends and ends[0] > k1:
        stops.append(Stop(ends[0], f"the end of epoch {last[ends[0]].epoch}"))
    if later:
        k2 = min(later, key=lambda k: (abs(k - two_thirds), k))
        stops.append(Stop(k2, _where(batches, k2)))
    return stops


def too_short(total: int, batches: int, steps: int) -> str:
    """Why an unbroken run of `total` steps cannot be checked: rank 0 recorded `batches` batches read from the
    session's loaders and `steps` step ends (`should_stop()` calls). A loop that never asks `should_stop()` runs 0
    steps however much it trains: mgpu counts a step there (and agrees and saves a stop there)."""
    if steps == 0:
        read = f" (it read {batches} batch{'es' if batches != 1 else ''} from session.loader)" if batches else ""
        return (f"the loop ran 0 steps: it never asked session.should_stop(){read}; call it once per optimizer step, "
                f"after optimizer.step(): mgpu counts a step there, and a stop is agreed and saved there")
    return f"the loop ran {total} step(s): a resume check needs at least 2 (more data, or --steps)"


def _recorded(path: Path) -> tuple[int, int]:
    """(batches, step ends) a rank recorded (mgpu.record.check_hooks), counted from its file."""
    batches = steps = 0
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if "step" in record:
                steps += 1
            elif "samples" in record:
                batches += 1
    return batches, steps


def _last_step(run: Run, batches: list[Batch]) -> int:
    steps = _saved_steps(run.run_dir)
    return max([b.step for b in batches] + steps[-1:] + [0])


def _saved_steps(run_dir: Path) -> list[int]:
    from mgpu.record.ledger import read_ledger

    events = read_ledger(run_dir / "events.jsonl")
    return sorted({int(e["step"]) for e in events if e.get("event") == "checkpoint_saved" and "step" in e})


def _workers(check_dir: Path) -> int:
    path = check_dir / "batches.rank0.jsonl"
    if not path.exists():
        return 0
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "workers" in record:
            return int(record["workers"])
    return 0


def _stop_and_resume(runner: Runner, run: Run, unbroken: Run, reference: dict[int, list[Batch]], world: int,
                     stops: list[Stop], steps: int | None, name: str, resume_world: int | None = None) -> Outcome:
    """`run` stopped at each of `stops` and resumed after each (on `resume_world` ranks after the first), compared."""
    resumed_world = resume_world or world
    at = [s.step for s in stops]
    for index, until in enumerate([*at, steps]):
        size, halved = (world, False) if index == 0 else (resumed_world, resume_world is not None)
        codes = runner.segment(run, size, until, halved=halved)
        if failed(codes):
            which = ("the run" if index == 0 else f"the run resumed after step {at[index - 1]}") + (
                f" (stopping at {until})" if until is not None and index < len(at) else "")
            why = describe(run.run_dir, run.segments[index], codes, runner.target.script,
                           lambda: runner.kept(run.name))
            return Outcome(name, False, f"{which} failed: {why.line}\n{why.detail}",
                           _failure_hint(why.detail) if index else "")
    return compare_runs(unbroken, run, reference, stops, name, world, resumed_world)


def _failure_hint(detail: str) -> str:
    if "IndexError" in detail and "worker" in detail.lower():
        return ("a DataLoader worker failed on the resume: the stream's own state is not per worker; read its files "
                "through mgpu.data.stream.ShardedStream, or resume with num_workers=0")
    return ""


def compare_runs(unbroken: Run, run: Run, reference: dict[int, list[Batch]], stops: list[Stop], name: str,
                 world: int, resumed_world: int) -> Outcome:
    """The stopped-and-resumed run against the unbroken one: batches, every common saved step's state, logged weights,
    and (the same world size) where the objects the loop keeps outside `state` ended."""
    changed = resumed_world != world
    sizes = [world] + [resumed_world] * (len(run.segments) - 1)
    per_rank: dict[int, list[list[Batch]]] = {}
    for segment, size in zip(run.segments, sizes):
        for r in range(max(world, resumed_world)):
            per_rank.setdefault(r, []).append(read_batches(segment / f"batches.rank{r}.jsonl") if r < size else [])
    together = {r: pieced_segments(parts, [s.step for s in stops]) for r, parts in per_rank.items()}
    if changed:
        batches = compare_samples([b for r in reference.values() for b in r], [b for r in together.values() for b in r])
    else:
        batches = compare_batches(reference, together)
    steps_a, steps_b = _checkpoints(unbroken.run_dir), _checkpoints(run.run_dir)
    if not steps_a or not steps_b:
        return Outcome(name, False, "no checkpoint to compare: does the loop give session.load() its state?")
    found = Comparison(changed=changed, stops=stops, batches=batches, no_batches=not any(reference.values()),
                       outside=_outside(run), end_a=max(steps_a), end_b=max(steps_b),
                       reference_batches=sum(len(r) for r in reference.values()))
    skip = ("rng", "loader.per_rank", "ddp") if changed else ()
    # A stop's own checkpoint is taken where the loop stopped (right after should_stop), the unbroken run's of that
    # step wherever the loop saves (after an epoch's end code: its loader in the next epoch, its evaluation done):
    # the same moment of training, two moments of the loop. Compared everywhere else.
    for step in sorted(set(steps_a) & set(steps_b) - {s.step for s in stops}):
        a, b = flatten(_load(steps_a[step])), flatten(_load(steps_b[step]))
        found.common.append(step)
        found.has_scheduler = found.has_scheduler or any(p.startswith("scheduler.") for p in a)
        found.entries |= {p.split(".")[0] for p in a}
        exact = differences(a, b, skip=skip)
        if changed:  # floating weights and moments: reported, not compared; the rest exactly
            floats = [d for d in exact if _is_weight(d.path, a) and not d.path.endswith("num_batches_tracked")]
            if floats and step == found.end_a:
                worst = max(floats, key=lambda d: d.largest)
                found.notes.append(f"weights and moments differ by up to {worst.largest:.2g} ({worst.path}; not "
                                   "compared exactly: another world size sums gradients in another order and gives "
                                   "ranks other random streams)")
            exact = [d for d in exact if not _is_weight(d.path, a) or d.largest == float("inf")]
        if exact and found.first is None:
            found.first = (step, exact, parameter_names(a))
    if not changed:
        from mgpu.record.goodput import compare_fingerprints, fingerprints
        from mgpu.record.ledger import read_ledger

        prints = [fingerprints(read_ledger(r.run_dir / "events.jsonl")) for r in (unbroken, run)]
        logged = compare_fingerprints(*prints)
        found.logged_steps = len(logged.common)
        if logged.common and not logged.agree:
            found.first_logged = logged.first_difference
        found.ends = _ends_outside(unbroken), _ends_outside(run)
    found.stream_buffer = not batches.same and _said(unbroken, "shuffles through a buffer")
    return Outcome(name, *verdict(found, hint))


def _is_weight(path: str, flat: dict[str, Any]) -> bool:
    """A floating value that follows from the weights (weights, moments, a best metric): not exact across a
    world-size change. The loader, the schedule, the learning rates and the step counts are."""
    value: Any = flat.get(path)
    if path.endswith("num_batches_tracked"):
        return True  # a batch norm counts its forwards: accumulation on fewer ranks makes more
    floating = isinstance(value, float) or bool(hasattr(value, "is_floating_point") and value.is_floating_point())
    return floating and path.split(".")[0] not in ("loader", "scheduler", "rng") and \
        not path.startswith("optimizer.param_groups")


def _checkpoints(run_dir: Path) -> dict[int, Path]:
    found = {}
    for path in (run_dir / "checkpoints").glob("step_*"):
        if path.is_dir() and path.name.split("_")[-1].isdigit():
            found[int(path.name.split("_")[-1])] = path
    return found


def _load(path: Path) -> dict[str, Any]:
    from mgpu.state.single.store import CheckpointStore
    from mgpu.state.sharded.export import consolidate, is_sharded_checkpoint

    if is_sharded_checkpoint(path):
        whole = consolidate(path)
        if "optim" in whole and "optimizer" not in whole:  # keyed by parameter name: optimizer.state.<param>.exp_avg
            whole["optimizer"] = whole.pop("optim")
        return whole
    return CheckpointStore.load_dir(path).state


def _said(run: Run, phrase: str) -> bool:
    """Whether a rank of `run`'s first segment wrote `phrase` (a warning of mgpu's)."""
    return any(phrase in path.read_text(errors="replace") for path in run.segments[0].glob("rank*.out"))


def _outside(run: Run) -> dict[str, str]:
    found: dict[str, str] = {}
    for segment in run.segments:
        for path in segment.glob("outside.rank*.json"):
            try:
                found.update(json.loads(path.read_text()))
            except ValueError:
                pass
    return found


def _ends_outside(run: Run) -> dict[int, dict[str, str | None]]:
    """Rank -> the digests of the objects the loop kept outside `state`, at the end of `run`'s last segment."""
    found: dict[int, dict[str, str | None]] = {}
    for path in run.segments[-1].glob("outside_end.rank*.json"):
        try:
            found.setdefault(int(path.name.split(".")[1].removeprefix("rank")), {}).update(json.loads(path.read_text()))
        except ValueError:
            pass
    return found

