"""A picture of a run from its ledger: `plot_timeline(events, "run.png")`. Needs matplotlib (the `plot` extra).

Top: every second of the run in its category (mgpu.record.goodput's intervals: queued, starting, training,
recomputing, stopping, restarting), the stops by kind as vertical lines, checkpoints and evaluations
as marks. Bottom, on the same time axis: the training loss of every progress event (the trainer's, or a loop's
`session.log(loss=...)`) and the evaluations' first metric. matplotlib is imported here only, through its object API (no pyplot, no global state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from mgpu.record.goodput import SacctRun, Segment, segments, timeline

__all__ = ["COLORS", "loss_curves", "plot_timeline"]

COLORS = {"queued": "#bdbdbd", "starting": "#9ecae1", "training": "#31a354", "recomputing": "#de2d26",
          "stopping": "#fd8d3c", "restarting": "#9e9ac8"}
STOP_COLORS = {"preempted": "#e6550d", "requeued_by_slurm": "#a63603", "time_limit": "#3182bd",
               "user_signal": "#6baed6", "hang": "#7a0177", "failure": "#cb181d", "failed_not_retried": "#67000d",
               "killed": "#000000", "cancelled": "#636363", "interrupted": "#969696"}


def _unit(span_s: float) -> tuple[float, str]:
    if span_s > 2 * 86400:
        return 86400.0, "days"
    if span_s > 3 * 3600:
        return 3600.0, "hours"
    if span_s > 180:
        return 60.0, "minutes"
    return 1.0, "seconds"


def loss_curves(segs: Sequence[Segment]) -> list[list[tuple[float, float]]]:
    """The training loss of every `progress` event (the trainer's, or a loop's `session.log(loss=...)`) as
    (time, loss), one curve per segment that logged one."""
    curves = [[(e["time"], e["metrics"]["loss"]) for e in seg.events if e["event"] == "progress"
               and isinstance(e.get("metrics"), dict) and isinstance(e["metrics"].get("loss"), (int, float))
               and not isinstance(e["metrics"]["loss"], bool)] for seg in segs]
    return [curve for curve in curves if curve]


def plot_timeline(events: Sequence[Mapping[str, Any]], path: str | Path, runs: Sequence[SacctRun] = (),
                  title: str = "", now: float | None = None) -> Path:
    """Draw the run into a PNG at `path` (its directory must exist); returns the path."""
    from matplotlib.artist import Artist
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    segs = segments(events)
    intervals = timeline(segs, runs, now)
    times = [iv.start for iv in intervals] + [iv.end for iv in intervals] + [e["time"] for e in events]
    t0 = min(times) if times else 0.0
    scale, unit = _unit((max(times) - t0) if times else 0.0)
    x = lambda t: (t - t0) / scale  # noqa: E731

    fig = Figure(figsize=(11, 5.5), dpi=100)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 1.4]})
    for kind, color in COLORS.items():
        spans = [(x(iv.start), (iv.end - iv.start) / scale) for iv in intervals if iv.kind == kind]
        if spans:
            top.broken_barh(spans, (2.6, 0.8), facecolors=color, edgecolor="none")
    saves = [x(e["time"]) for e in events if e["event"] == "checkpoint_saved"]
    evals = [x(e["time"]) for e in events if e["event"] == "evaluated"]
    top.plot(saves, [1.7] * len(saves), "|", color="#252525", markersize=10)
    top.plot(evals, [0.8] * len(evals), "D", color="#3182bd", markersize=4)
    kinds_seen: dict[str, str] = {}
    for seg in segs:
        if seg.kind in ("finished", "early_stopped", "running"):
            continue
        color = STOP_COLORS.get(seg.kind, "#525252")
        when = x(seg.stop_time if seg.stop_time is not None else seg.end)
        for ax in (top, bottom):
            ax.axvline(when, color=color, linewidth=1.2, linestyle="--")
        kinds_seen[seg.kind] = color
    top.set_yticks([0.8, 1.7, 3.0], ["evaluations", "checkpoints", "time"])
    top.set_ylim(0.3, 3.7)
    handles: list[Artist] = [Patch(facecolor=c, label=k) for k, c in COLORS.items() if any(iv.kind == k for iv in intervals)]
    handles += [Line2D([], [], color=c, linestyle="--", label=f"stop: {k}") for k, c in kinds_seen.items()]
    top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    top.set_title(title or "run timeline", fontsize=10)

    for curve in loss_curves(segs):  # one line per segment: no line across the gap of a stop
        bottom.plot([x(t) for t, _ in curve], [loss for _, loss in curve], ".-", color="#31a354", markersize=3,
                    linewidth=1)
    bottom.set_ylabel("training loss")
    evaluated = [e for e in events if e["event"] == "evaluated" and isinstance(e.get("metrics"), dict) and e["metrics"]]
    if evaluated:
        name = next(iter(evaluated[-1]["metrics"]))
        points = [(x(e["time"]), e["metrics"][name]) for e in evaluated
                  if isinstance(e["metrics"].get(name), (int, float))]
        twin = bottom.twinx()
        twin.plot([p[0] for p in points], [p[1] for p in points], "D-", color="#3182bd", markersize=5,
                  linewidth=1, label=f"eval {name}")
        twin.set_ylabel(f"eval {name}")
    bottom.set_xlabel(f"{unit} since the first event" + (" (or submit)" if runs else ""))
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    return out
