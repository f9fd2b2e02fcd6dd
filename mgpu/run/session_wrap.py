"""A Session's `wrap`: the choice between DDP and FSDP2 and its refusals (mgpu.parallel.fsdp.refuse_to_wrap), a model
on this rank's device, in the session's DDPs (mgpu.parallel.ddp.SessionDDPs: their saved buckets) or sharded
(mgpu.parallel.fsdp.shard), and the watchdog's beat as each step's first forward starts. `mgpu.run.session.Session` calls
this; nothing else should. No torch at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from mgpu.errors import MgpuError
from mgpu.run.session_base import SessionBase

if TYPE_CHECKING:
    from torch import nn


__all__ = ["wrap"]


def wrap(session: SessionBase, model: nn.Module, find_unused_parameters: bool, static_graph: bool, parallel: str,
         shard_hook: Callable[[Any, Any], Any] | None) -> nn.Module:
    """`Session.wrap`: `model` in DDP (several ranks), sharded (`parallel="fsdp"`) or as it is (one rank)."""
    from mgpu.parallel.fsdp import refuse_to_wrap

    refuse_to_wrap(model, parallel, model in session._wrapped, session.cfg.checkpoint.format)
    if parallel == "fsdp":  # [fsdp hook] see mgpu.parallel.fsdp
        from mgpu.parallel.fsdp import shard

        if session._checkpointer is not None and not session.sharded:
            raise MgpuError("Session.wrap(parallel='fsdp') after load() or save(): shard the model first (its "
                            "checkpoints are sharded)")
        session._fsdp = True
        return watched(session, shard(model, session.device, shard_hook))
    model = model.to(session.device)
    if session.world_size == 1:
        session._wrapped.add(model)
        return model
    assert session._ddps is not None
    ddp = session._ddps.wrap(model, session.device, find_unused_parameters, static_graph)  # [mgpu.parallel.ddp bucket layout]
    session._wrapped.add(ddp)
    if session._sync_wait is not None:
        session._sync_wait.attach(ddp)  # its waits for the other ranks are not this rank's compute
    return watched(session, ddp)


def watched(session: SessionBase, model: nn.Module) -> nn.Module:
    """Entering the model's forward (of the next step), this rank waits for the others: a watchdog beat. A
    loop that beats nothing else starts its step here; a step's first forward starts it, not each one."""
    watchdog = session.watchdog
    if watchdog is not None:
        def beat(module: Any, args: Any) -> None:
            following = session.step + 1
            session.beat("model", following if watchdog.step != following else None)
        model.register_forward_pre_hook(beat)
    return model
