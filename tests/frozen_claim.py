"""A task whose import freezes rank 1 (SIGSTOP) where the run directory is claimed: the first collective after the
rendezvous, before any step (issue 46: rank 0 then waited there for distributed.init_timeout_s, its watchdog not
started yet). Imported only by the test that targets it (task.target=tests.frozen_claim:FrozenClaimTask)."""

from __future__ import annotations

import os
import signal
from typing import Any

import mgpu.run.runner

from tests.tasks import BlobTask

__all__ = ["FrozenClaimTask"]

if os.environ.get("RANK") == "1":
    _claim = mgpu.run.runner.claim

    def _frozen_claim(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGSTOP)  # a frozen process (a lost node looks the same to its peers)
        return _claim(*args, **kwargs)

    mgpu.run.runner.claim = _frozen_claim  # type: ignore[assignment]  # the test's frozen peer


class FrozenClaimTask(BlobTask):
    """BlobTask; the freeze is the module's (see above)."""
