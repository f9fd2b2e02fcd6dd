"""One line of the batch script: a value that reaches an `#SBATCH` or shell line (a resource, an override, the
folder, the sweep, the resume command) is refused, in one line naming its flag, if a control character would end
that line. No torch.
"""

from __future__ import annotations

from mgpu.config.loading import control_problem
from mgpu.errors import MgpuError

__all__ = ["check_line"]


def check_line(flag: str, value: str) -> None:
    """MgpuError if `value` holds a control character: it would end the #SBATCH or shell line it is on.

    Every value that reaches the batch script goes through here: the resources, the overrides, the
    folder, the sweep and the resume command (each of submit.py's arguments), so a newline never
    splits a line of the script (`MGPU_RESUME_COMMAND='...'` spanning two lines would run the second)."""
    if problem := control_problem(value):
        raise MgpuError(f"{flag} {value!r}: {problem}; give it on one line")
