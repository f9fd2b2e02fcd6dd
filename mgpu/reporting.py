"""What rank 0 shows: TensorBoard scalars, a progress bar on a TTY, plain lines in batch logs.

On resume the TensorBoard writer reopens the same directory with `purge_step` = the first step
after the checkpoint, so events written after that checkpoint by the preempted run are dropped
by every TensorBoard reader and the curves never overlap.

A disk that refuses TensorBoard's writes (full, failing) costs the curve those points, never the
run: the writer's error (raised at its next call, from its thread) is logged once and the writer
is reopened, into a new event file, at a log interval at least REOPEN_AFTER_S later.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Mapping, TextIO

__all__ = ["Reporter", "format_metrics"]

log = logging.getLogger("mgpu.train")
REOPEN_AFTER_S = 30.0  # a full disk stays full for a while: one new (empty) event file per try


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


class Reporter:
    """Rank 0's outputs; every method is a no-op elsewhere (`enabled=False`)."""

    def __init__(self, enabled: bool, tb_dir: Path | None, total_steps: int, resume_step: int,
                 progress_bar: str = "auto", stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self.bar = enabled and (progress_bar == "on" or (progress_bar == "auto" and self.stream.isatty()))
        self.writer: Any = None
        self.tb_dir = tb_dir if enabled else None
        self._tb_failed, self._reopen_at = False, 0.0
        if self.tb_dir is not None:
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

    def close(self) -> None:
        if self.bar:
            self.stream.write("\n")
        if self.writer is not None:
            self._tb(self.writer.close)
        self.tb_dir = None
