"""A run's `checkpoints/` directory, shared by both formats: its step directories, the `latest` and `best` pointers,
a complete step installed under its final name, the old ones pruned and a killed save's leftovers removed, and the
newest checkpoint that verifies found (a damaged one passed over for the one before, said in a line). The single-file
store (mgpu.state.single.store) writes into it; the sharded checkpointer installs, points and prunes through it.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from pathlib import Path

from mgpu.fsutil import fsync_path, write_durably
from mgpu.state.checkpoint_format import (BEST, FORMAT, LATEST, META_FILE, STEP_DIR, TMP_PREFIX, CheckpointError,
                                          InvalidCheckpoint, LoadedCheckpoint, active_claims, claim, claimed,
                                          describe_os_error, exchange_paths, one_line, refuse_newer, release,
                                          remove_path, tmp_name, verify_and_load)
from mgpu.state.files.removal import remove_later

log = logging.getLogger("mgpu.state.step_dirs")

PRUNED = "pruned-"
"""The label of a pruned step's temporary name (`.tmp-pruned-step_...`): deleted in the background wherever found."""


def _delete_claimed(path: Path) -> None:
    """Delete a claimed temporary path in the background (mgpu.state.files.removal); its claim ends with it."""
    remove_later(path, done=functools.partial(release, path))


class StepDirectories:
    """The checkpoints of one run in `directory`: the newest `keep_last` complete ones kept, plus `latest` and
    `best`."""

    def __init__(self, directory: Path, keep_last: int = 2) -> None:
        if keep_last < 1:
            raise CheckpointError(f"keep_last must be at least 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last

    def install(self, tmp: Path, final: Path) -> None:
        """Rename the complete `tmp` to `final`; a step saved again replaces its old directory."""
        try:
            os.rename(tmp, final)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            # Swapped, so that some complete copy of the step sits at `final` at every moment; the old
            # one ends up at `tmp`, removed with it.
            if not exchange_paths(tmp, final):
                # A crash between these renames leaves the step at neither name: a resume then falls
                # back to an older checkpoint (lost progress, never a torn state).
                with claimed(tmp.with_name(tmp.name + "-old")) as aside:
                    os.rename(final, aside)
                    try:
                        os.rename(tmp, final)
                    except OSError:
                        os.rename(aside, final)
                        raise
        fsync_path(self.directory, directory=True)

    def point(self, pointer: str, name: str) -> None:
        """Make `pointer` (`latest`, `best`) name the step directory `name`, durably and atomically."""
        with claimed(self.directory / tmp_name(pointer)) as tmp:
            write_durably(tmp, f"{name}\n".encode())
            os.replace(tmp, self.directory / pointer)
        fsync_path(self.directory, directory=True)

    def prune(self) -> None:
        """Remove the complete checkpoints beyond the newest `keep_last`, the `latest` and `best` ones kept: called
        once a save is durable and reported, outside the save's time. Each is renamed away here and deleted in the
        background (mgpu.state.files.removal): the caller does not wait for the filesystem to free its blocks. A
        failure is logged (the save stands; the next prune tries again)."""
        try:
            self._prune()
        except OSError as error:
            log.warning("could not prune old checkpoints in %s: %s", self.directory,
                        describe_os_error(error, self.directory))

    def _prune(self) -> None:
        complete = [path for _, path in self._step_dirs() if (path / META_FILE).is_file()]
        keep = {path.name for path in complete[:self.keep_last]}
        keep |= {name for name in (self.pointer(LATEST), self.pointer(BEST)) if name}
        for path in complete:
            if path.name not in keep:
                # Renamed away first: a kill mid-delete then leaves a stale .tmp-*, not a half step dir. Claimed
                # until deleted: a save's stale-file cleanup in another thread leaves it to the remover.
                trash = self.directory / tmp_name(f"{PRUNED}{path.name}")
                claim(trash)
                try:
                    os.rename(path, trash)
                except BaseException:
                    release(trash)
                    raise
                _delete_claimed(trash)
        self.remove_stale_tmp()

    def remove_stale_tmp(self) -> None:
        """Remove the temporary paths no save of this process is writing: a killed save's leftovers now (their space
        back before the save that calls this needs it), a pruned step an earlier process had no time to delete in
        the background (mgpu.state.files.removal: it was complete and superseded, the caller does not wait for it)."""
        # List first, then read the claims: a live temporary path is claimed before it is created.
        entries = [entry for entry in self.directory.iterdir() if entry.name.startswith(TMP_PREFIX)]
        active = active_claims()
        for entry in entries:
            if entry in active:
                continue
            if entry.name.startswith(TMP_PREFIX + PRUNED):
                claim(entry)
                _delete_claimed(entry)
            else:
                remove_path(entry)

    # ------------------------------------------------------------------ loading
    def latest(self) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies: the one `latest` names, then the others newest first.

        None if there is none at all; CheckpointError if there are some but none is valid, NewerFormat where a newer
        mgpu wrote one of them.
        """
        paths = [path for _, path in self._step_dirs()]
        if not paths:
            return None
        refuse_newer(paths, FORMAT)  # never passed over for an older one: the run would save over it
        pointed = self.pointer(LATEST)
        return self._first_valid(sorted(paths, key=lambda path: path.name != pointed))

    def best(self) -> LoadedCheckpoint | None:
        """The checkpoint `best` names (None if no save was marked best); CheckpointError if it is invalid."""
        name = self.pointer(BEST)
        return None if name is None else self._first_valid([self.directory / name])

    def latest_path(self) -> Path | None:
        """The directory the `latest` file names, unverified."""
        name = self.pointer(LATEST)
        return None if name is None else self.directory / name

    def list_steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""
        return sorted(step for step, path in self._step_dirs() if (path / META_FILE).is_file())

    @staticmethod
    def load_dir(path: Path, verify: bool = True) -> LoadedCheckpoint:
        """Load one checkpoint directory. `verify=False`: skip the checksum, for the ranks that load what rank 0
        has just verified (one verification per job, not one per rank)."""
        try:
            return verify_and_load(Path(path), verify=verify)
        except InvalidCheckpoint as e:
            raise CheckpointError(f"checkpoint {path} is invalid: {one_line(e)}") from None

    def _first_valid(self, paths: list[Path]) -> LoadedCheckpoint:
        skipped: list[tuple[Path, str]] = []
        for path in paths:
            try:
                return verify_and_load(path, tuple(skipped))
            except InvalidCheckpoint as e:
                reason = one_line(e)
                log.warning("skipping checkpoint %s: %s", path, reason)
                skipped.append((path, reason))
        raise CheckpointError(f"no valid checkpoint in {self.directory}: {len(skipped)} rejected, "
                              f"the first because {skipped[0][1]}")

    def _step_dirs(self) -> list[tuple[int, Path]]:
        """Every step_* directory, newest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.iterdir():
            match = STEP_DIR.fullmatch(entry.name)
            if match and entry.is_dir():
                found.append((int(match[1]), entry))
        return sorted(found, reverse=True)

    def pointer(self, pointer: str) -> str | None:
        """The step directory `pointer` (`latest`, `best`) names, if any."""
        try:
            name = (self.directory / pointer).read_text().strip()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            name = one_line(e)
        if STEP_DIR.fullmatch(name):
            return name
        log.warning("ignoring %s: not a step_XXXXXXXX name (%s)", self.directory / pointer, name)
        return None
