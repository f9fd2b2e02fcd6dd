"""The runs `python -m mgpu.check.resume` makes and what it compares after each (see mgpu/check/resume.py for
the command): an unbroken run, a mid-epoch stop and resume, a stop while a save is written, a resume on half
the ranks; every saved state compared by path (mgpu.check.state_diff), the weights at every logged step
(mgpu.record.goodput's fingerprints) and each rank's batches (mgpu.check.batch_diff), into one report."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mgpu.check.batch_diff import Batch, compare_batches, compare_samples, pieced, read_batches
from mgpu.check.runs import Run, Runner, Target, failed, last_lines
from mgpu.errors import MgpuError
from mgpu.check.state_diff import Difference, differences, flatten, hint, named, parameter_names

__all__ = ["check", "choose_stop", "too_short"]


@dataclass
class Outcome:
    """One check's line: `ok` None for skipped."""
    name: str
    ok: bool | None
    text: str
    hint: str = ""


def check(target: Target, args: argparse.Namespace, runner: Runner, scratch: Path) -> tuple[int, str]:
    """Run the checks; (exit code, report)."""
    world = args.nproc
    unbroken = Run("unbroken", scratch / "unbroken")
    codes = runner.segment(unbroken, world, args.steps)
    if failed(codes):
        raise MgpuError(f"the unbroken run failed (exit codes {codes}): {last_lines(unbroken.segments[0], codes, 1)}; "
                        "a resume can only be checked on a loop that runs")
    reference = {r: read_batches(unbroken.segments[0] / f"batches.rank{r}.jsonl") for r in range(world)}
    total = _last_step(unbroken, reference[0])
    if total < 2:
        raise MgpuError(too_short(total, *_recorded(unbroken.segments[0] / "batches.rank0.jsonl")))
    stop = args.stop_at or choose_stop(reference[0], total)
    if stop >= total:
        raise MgpuError(f"--stop-at {stop}: the loop ran {total} steps; stop before its last")
    workers = _workers(unbroken.segments[0])
    outcomes = []

    chosen = set(args.checks.split(","))
    stopped = Run("stopped", scratch / "stopped")
    if "stop" in chosen:
        outcomes.append(_stop_and_resume(runner, stopped, unbroken, reference, world, stop, args.steps,
                                     f"stop at step {stop}{_where(reference[0], stop)} and resume"))

    saves = _saved_steps(unbroken.run_dir)
    during = next((s + 1 for s in saves if s + 1 < total and s + 1 != stop), None)
    if "save" not in chosen:
        pass
    elif during is None:
        outcomes.append(Outcome("stop during a save", None, "skipped: the loop saved no checkpoint before its "
                                "last step (session.save every few steps gives one to stop during)"))
    else:
        in_flight = Run("during-save", scratch / "during-save")
        outcomes.append(_stop_and_resume(runner, in_flight, unbroken, reference, world, during, args.steps,
                                         f"stop at step {during}, while step {during - 1}'s save is written"))

    half = world // 2
    if "world" not in chosen:
        pass
    elif target.halved_args is None:
        why = ("needs an even --nproc" if world % 2 else
               "the config has no data.global_batch_size (per-rank batches change the run with the world size)"
               if target.config else "give --world-args with the arguments that keep the loop's global batch on "
               "half the ranks (e.g. '--accumulate 2')")
        outcomes.append(Outcome(f"{world} ranks resumed on {half or 1}", None, f"skipped: {why}"))
    else:
        resized = Run("resized", scratch / "resized")
        outcomes.append(_stop_and_resume(runner, resized, unbroken, reference, world, stop, args.steps,
                                         f"stop at step {stop} on {world} ranks, resume on {half}",
                                         resume_world=half))
    head = (f"check_resume: {target.label} on {world} rank(s), {total} steps, "
            + (f"{workers} DataLoader worker(s) (the loop's own)" if workers else
               "no DataLoader workers (the loop uses none; a loop that does is checked with them)"))
    lines = [head]
    for outcome in outcomes:
        verdict = {True: "PASS", False: "DIFFERS", None: "skipped"}[outcome.ok]
        text = outcome.text if outcome.ok is not None else outcome.text.removeprefix("skipped: ")
        lines.append(f"  {outcome.name}: {verdict}: {text}" if outcome.ok is not None
                     else f"  {outcome.name}: skipped: {text}")
        if outcome.hint:
            lines.append(f"    hint: {outcome.hint}")
    differs = any(o.ok is False for o in outcomes)
    lines.append("DIFFERS" if differs else "PASS")
    return (1 if differs else 0), "\n".join(lines)


def _where(batches: list[Batch], step: int) -> str:
    mine = [b for b in batches if b.step == step]
    return f" (epoch {mine[-1].epoch}, position {mine[-1].position})" if mine else ""


def choose_stop(batches: list[Batch], total: int) -> int:
    """A mid-epoch step about a third of the way (not an epoch's last step); a third of the way without batches."""
    last = {b.step: b for b in batches}
    nxt = {b.step: b for b in reversed(batches)}  # each step's first batch
    candidates = [k for k in range(1, total) if k in last and k + 1 in nxt and nxt[k + 1].epoch == last[k].epoch]
    target = max(1, total // 3)
    return min(candidates, key=lambda k: (abs(k - target), k)) if candidates else target


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
                     stop: int, steps: int | None, name: str, resume_world: int | None = None) -> Outcome:
    codes = runner.segment(run, world, stop)
    if failed(codes):
        return Outcome(name, False, f"the stopped run failed (exit codes {codes})\n{last_lines(run.segments[0], codes)}")
    resumed_world = resume_world or world
    codes = runner.segment(run, resumed_world, steps, halved=resume_world is not None)
    if failed(codes):
        return Outcome(name, False, f"the resumed run failed (exit codes {codes})\n{last_lines(run.segments[1], codes)}",
                       _failure_hint(run.segments[1], codes, no_batches=not any(reference.values())))
    return compare_runs(unbroken, run, reference, stop, name, world, resumed_world)


def _failure_hint(check_dir: Path, codes: list[int], no_batches: bool) -> str:
    if no_batches:
        return hint([], outside={}, world_changed=False, batches_differ=False, has_scheduler=True, no_batches=True)
    text = last_lines(check_dir, codes, 40)
    if "IndexError" in text and "worker" in text.lower():
        return ("a DataLoader worker failed on the resume: the stream's own state is not per worker; read its files "
                "through mgpu.data.stream.ShardedStream, or resume with num_workers=0")
    return ""


def compare_runs(unbroken: Run, run: Run, reference: dict[int, list[Batch]], stop: int, name: str, world: int,
                 resumed_world: int) -> Outcome:
    """The resumed run against the unbroken one: batches, every common saved step's state, logged weights."""
    changed = resumed_world != world
    stopped = {r: read_batches(run.segments[0] / f"batches.rank{r}.jsonl") for r in range(world)}
    resumed = {r: read_batches(run.segments[1] / f"batches.rank{r}.jsonl") for r in range(resumed_world)}
    together = {r: pieced(stopped.get(r, []), resumed.get(r, []), stop) for r in range(max(world, resumed_world))}
    no_batches = not any(reference.values())
    if changed:
        batches = compare_samples([b for r in reference.values() for b in r], [b for r in together.values() for b in r])
    else:
        batches = compare_batches(reference, together)
    outside = _outside(run)
    steps_a, steps_b = _checkpoints(unbroken.run_dir), _checkpoints(run.run_dir)
    if not steps_a or not steps_b:
        return Outcome(name, False, "no checkpoint to compare: does the loop give session.load() its state?")
    end_a, end_b = max(steps_a), max(steps_b)
    common = sorted(set(steps_a) & set(steps_b))
    first: tuple[int, list[Difference], dict[str, str]] | None = None
    has_scheduler = False
    notes: list[str] = []
    skip = ("rng", "loader.per_rank", "ddp") if changed else ()
    for step in common:
        a, b = flatten(_load(steps_a[step])), flatten(_load(steps_b[step]))
        has_scheduler = has_scheduler or any(p.startswith("scheduler.") for p in a)
        exact = differences(a, b, skip=skip)
        if changed:  # floating weights and moments: reported, not compared; the rest exactly
            floats = [d for d in exact if _is_weight(d.path, a) and not d.path.endswith("num_batches_tracked")]
            if floats and step == end_a:
                worst = max(floats, key=lambda d: d.largest)
                notes.append(f"weights and moments differ by up to {worst.largest:.2g} ({worst.path}; not compared "
                             "exactly: another world size sums gradients in another order and gives ranks other "
                             "random streams)")
            exact = [d for d in exact if not _is_weight(d.path, a) or d.largest == float("inf")]
        if exact and first is None:
            first = (step, exact, parameter_names(a))
    text_parts = []
    if end_a != end_b and batches.same:
        return Outcome(name, False, f"the resumed run ended at step {end_b}, the unbroken run at step {end_a}",
                       hint([], outside=outside, world_changed=changed, batches_differ=False, has_scheduler=True,
                            no_batches=True) if no_batches else
                       "the loop's length depends on something a resume rebuilds (len(loader) with the world size, "
                       "a counter not in `state`)")
    logged, first_logged = "", None
    if not changed:
        from mgpu.record.goodput import compare_fingerprints, fingerprints
        from mgpu.record.ledger import read_ledger

        prints = [fingerprints(read_ledger(r.run_dir / "events.jsonl")) for r in (unbroken, run)]
        verdict = compare_fingerprints(*prints)
        if verdict.common and not verdict.agree:
            first_logged = verdict.first_difference
            logged = f"; the weights first differ at logged step {first_logged}"
        elif verdict.common:
            text_parts.append(f"weights equal at {len(verdict.common)} logged step(s)")
    if not batches.same or first is not None or logged:
        hint_text = hint(first[1] if first else [], outside=outside, world_changed=changed,
                         batches_differ=not batches.same, has_scheduler=has_scheduler, no_batches=no_batches)
        if not batches.same and _said(unbroken, "shuffles through a buffer"):
            hint_text = ("the stream shuffles through a buffer its state_dict() does not hold (its loader said so at "
                         "the start): shuffle without a buffer (the shard order), or read the files through "
                         "mgpu.data.stream.ShardedStream, which rebuilds its buffer on a resume")
        if not batches.same:
            detail = f"the batches differ: {batches.first}"
            if batches.lost or batches.repeated:
                detail += f" ({batches.lost} sample(s) never trained, {batches.repeated} trained twice or more)"
            if end_a != end_b:
                detail += f"; the resumed run ended at step {end_b}, the unbroken run at step {end_a}"
        elif first is not None:
            step, found, names = first
            d = found[0]
            more = f"; {len(found) - 1} more path(s) differ" if len(found) > 1 else ""
            detail = (f"at step {step}: {named(d.path, names)}: {d.a} vs {d.b} (max difference "
                      f"{_number(d.largest)}){more}")
            if first_logged is not None and first_logged < step:
                detail = (f"the weights first differ at logged step {first_logged}; at the first saved "
                          f"step both runs kept, {detail.removeprefix('at ')}")
                logged = ""
        else:
            detail = "the saved states agree"
        return Outcome(name, False, detail + logged, hint_text)
    text_parts.insert(0, f"{len(common)} saved step(s) equal ({', '.join(map(str, common))})" if not changed else
                      f"{len(common)} saved step(s) agree ({', '.join(map(str, common))}; loader, schedule and "
                      "step counts exactly)")
    text_parts.append(f"the same {sum(len(r) for r in reference.values())} batches on the ranks"
                      if not changed else f"all {batches.batches} samples trained once, as unbroken")
    if no_batches:
        text_parts.append("no batch recorded (the loop's data does not come from session.loader)")
    return Outcome(name, True, "; ".join(text_parts + notes))


def _number(value: float) -> str:
    return "-" if value == float("inf") else f"{value:.3g}"


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
    from mgpu.state.checkpoint import CheckpointStore
    from mgpu.state.sharded_export import consolidate, is_sharded_checkpoint

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
