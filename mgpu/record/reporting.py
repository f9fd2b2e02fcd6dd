"""What rank 0 shows: TensorBoard scalars and texts, wandb (optional), a progress bar on a TTY, plain lines
in batch logs; and the log a task writes its own scalars and texts to.

On resume the TensorBoard writer reopens the same directory with `purge_step` = the first step
after the checkpoint, so events written after that checkpoint by the preempted run are dropped
by every TensorBoard reader and the curves never overlap. wandb (`log.wandb: true`, `pip install
mgpu[wandb]`) gets the run's identity as its run id, with resume="allow": every requeue of a run, and a
resubmission of the same run, continues the same wandb run; it logs from the resumed step on.

Closing waits at most CLOSE_WITHIN_S for TensorBoard's flush and wandb's finish together (a stop must end
within Slurm's KillWait); what overruns is left to a daemon thread, said in one line.

A disk that refuses TensorBoard's writes (full, failing) costs the curve those points, never the
run: the writer's error (raised at its next call, from its thread) is logged once and the writer
is reopened, into a new event file, at a log interval at least REOPEN_AFTER_S later.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping, TextIO

__all__ = ["Reporter", "TaskLog", "format_metrics", "wandb_run_id"]
TEXTS_PER_EVALUATION = 20  # lines of one text tag kept per evaluation (a task may log one per sample)

log = logging.getLogger("mgpu.train")
REOPEN_AFTER_S = 30.0  # a full disk stays full for a while: one new (empty) event file per try
CLOSE_WITHIN_S = 2.0
"""The most `Reporter.close` waits for TensorBoard and wandb together (a stop's exit within 3 s of its
checkpoint, bench/stop_teardown.py)."""


def format_metrics(metrics: Mapping[str, float]) -> str:
    parts = []
    for key, value in metrics.items():
        if key.endswith("lr"):
            parts.append(f"{key} {value:.3e}")
        elif key.endswith(("samples_per_s", "tokens_per_s")):
            parts.append(f"{key} {value:,.0f}")
        else:
            parts.append(f"{key} {value:.4g}")
    return "  ".join(parts)


def _quiet_tensorboard_writer_errors() -> None:
    """TensorBoard's writer thread dies on an OSError (a full disk) and Python prints its traceback; the
    Reporter says it in one line at the next call instead (`_tb`). Other threads' errors are printed as before."""
    previous = threading.excepthook
    if getattr(previous, "_mgpu", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__module__.startswith("tensorboard."):
            return
        previous(args)

    hook._mgpu = True  # type: ignore[attr-defined]  # a marker on our own hook function
    threading.excepthook = hook


class Reporter:
    """Rank 0's outputs; every method is a no-op elsewhere (`enabled=False`)."""

    def __init__(self, enabled: bool, tb_dir: Path | None, total_steps: int, resume_step: int,
                 progress_bar: str = "auto", stream: TextIO | None = None, wandb: dict[str, Any] | None = None
                 ) -> None:
        """`wandb`: wandb.init's arguments (id, project, dir, config), or None for no wandb."""
        self.enabled = enabled
        self._texts: dict[str, list[str]] = {}
        self.wandb: Any = None
        if enabled and wandb is not None:
            import wandb as wandb_lib

            self.wandb = wandb_lib.init(resume="allow", **wandb)
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self.bar = enabled and (progress_bar == "on" or (progress_bar == "auto" and self.stream.isatty()))
        self.writer: Any = None
        self.tb_dir = tb_dir if enabled else None
        self._tb_failed, self._reopen_at = False, 0.0
        if self.tb_dir is not None:
            _quiet_tensorboard_writer_errors()
            # purge_step: readers drop events at or after it that an earlier (preempted) run wrote.
            self._tb(lambda: self._open(resume_step + 1 if resume_step else None))
        self._last_bar = 0.0

    def _open(self, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.tb_dir), purge_step=purge_step)

    def _tb(self, action: Any) -> None:
        """Run a TensorBoard call; an OSError drops the writer (reopened by a later `scalars`), said once."""
        try:
            action()
        except OSError as error:
            if not self._tb_failed:
                log.warning("TensorBoard: cannot write to %s (%s); its curves miss points until it can, training "
                            "goes on", self.tb_dir, error.strerror or error)
            self._tb_failed, self._reopen_at = True, time.monotonic() + REOPEN_AFTER_S
            broken, self.writer = self.writer, None
            if broken is not None:
                try:
                    broken.close()
                except OSError:
                    pass

    def hparams(self, flat_config: Mapping[str, Any], config_text: str) -> None:
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams

        def write() -> None:
            values = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flat_config.items()}
            for summary in hparams(values, {"eval/best": 0.0}):
                self.writer.file_writer.add_summary(summary)
            self.writer.add_text("config", "```yaml\n" + config_text + "\n```", 0)

        self._tb(write)

    def scalars(self, step: int, metrics: Mapping[str, float], prefix: str) -> None:
        if self.wandb is not None:
            self.wandb.log({f"{prefix}/{key}": value for key, value in metrics.items()}, step=step)
        if self.tb_dir is None:
            return
        if self.writer is None and time.monotonic() >= self._reopen_at:
            self._tb(self._open)

        def write() -> None:
            for key, value in metrics.items():
                self.writer.add_scalar(f"{prefix}/{key}", value, step)
            # On disk at every log interval: a killed run's curve is not lost up to its last log line.
            self.writer.flush()

        if self.writer is not None:
            self._tb(write)

    def text(self, tag: str, text: str) -> None:
        """Keep a line of text for `tag` (the first TEXTS_PER_EVALUATION until `flush_texts`)."""
        if self.enabled:
            lines = self._texts.setdefault(tag, [])
            if len(lines) < TEXTS_PER_EVALUATION:
                lines.append(text)

    def flush_texts(self, step: int) -> None:
        """Write the kept texts at `step` (TensorBoard's text plugin; a wandb table)."""
        for tag, lines in self._texts.items():
            if self.writer is not None:
                self._tb(lambda: self.writer.add_text(tag, "\n\n".join(lines), step))
            if self.wandb is not None:
                import wandb as wandb_lib

                self.wandb.log({tag: wandb_lib.Table(columns=["text"], data=[[line] for line in lines])}, step=step)
        self._texts.clear()

    def line(self, text: str) -> None:
        """A plain log line (ends any progress bar line first)."""
        if not self.enabled:
            return
        if self.bar:
            self.stream.write("\r\033[K")
        log.info(text)

    def progress(self, step: int, epoch: int, metrics: Mapping[str, float]) -> None:
        """Redraw the TTY bar (at most 10 times a second)."""
        if not self.bar or time.monotonic() - self._last_bar < 0.1:
            return
        self._last_bar = time.monotonic()
        done = step / max(1, self.total_steps)
        filled = int(30 * done)
        loss = metrics.get("loss")
        tail = f" loss {loss:.4f}" if loss is not None else ""
        self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {step}/{self.total_steps} "
                          f"epoch {epoch}{tail}\033[K")
        self.stream.flush()

    def close(self, within_s: float = CLOSE_WITHIN_S) -> None:
        """Close TensorBoard's writer and finish the wandb run, waiting at most `within_s` for both together:
        a stop's checkpoint is durable already, and the job must exit before Slurm's KillWait runs out. What
        is not done by then goes on in a daemon thread while the process ends, said in one line."""
        if self.bar:
            self.stream.write("\n")
        deadline = time.monotonic() + within_s
        writer, self.writer, self.tb_dir = self.writer, None, None
        if writer is not None:
            _bounded(writer.close, deadline, "TensorBoard's close", "its last points may be missing")
        run, self.wandb = self.wandb, None
        if run is not None:
            _bounded(run.finish, deadline, "wandb's finish",
                     "what was logged is in the run's wandb directory (`wandb sync` uploads what is missing)")


def _bounded(action: Any, deadline: float, what: str, consequence: str) -> None:
    """Run `action` in a daemon thread and wait for it until `deadline` (time.monotonic()); past it, go on."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            action()
        except Exception as error:  # a logger's failure at the end costs its data, never the stop
            errors.append(error)

    thread = threading.Thread(target=run, name=f"mgpu-close ({what})", daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(max(0.0, deadline - started))
    if thread.is_alive():
        log.warning("%s did not end within %.1f s; the run ends without waiting for it: %s", what,
                    time.monotonic() - started, consequence)
    elif errors:
        log.warning("%s failed (%s: %s): %s", what, type(errors[0]).__name__, errors[0], consequence)


def wandb_run_id(run_dir: Path) -> str:
    """The wandb run id of an mgpu run: its directory's name and a digest of its absolute path (the run's
    identity: the same for every requeue and resubmission, another for another run of the same name)."""
    import hashlib
    import re

    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:10]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '-', run_dir.name)[:50]}-{digest}"


class TaskLog:
    """What a task writes to the run's loggers (rank 0; a no-op on the others): `scalar(name, value)` at the
    current step (`train/<name>`), `text(name, text)` (kept for the evaluation in progress, written with its
    metrics; at most TEXTS_PER_EVALUATION lines per name)."""

    def __init__(self, reporter: Reporter, step: Any) -> None:
        self.reporter, self._step = reporter, step

    def scalar(self, name: str, value: float) -> None:
        self.reporter.scalars(self._step(), {name: float(value)}, "train")

    def text(self, name: str, text: str) -> None:
        self.reporter.text(name, text)
