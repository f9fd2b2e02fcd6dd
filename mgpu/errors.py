"""The one exception type users see, and the helper that turns it into a one-line exit."""

from __future__ import annotations

import sys
from typing import NoReturn

USAGE_EXIT_CODE = 2


class MgpuError(Exception):
    """Bad input or environment: the message is one actionable line, printed without a traceback."""


def exit_with(error: BaseException, prog: str = "mgpu") -> NoReturn:
    """Print `prog: error: <message>` on one line and exit with code 2 (as argparse does)."""
    message = " ".join(str(error).split())
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(USAGE_EXIT_CODE)
