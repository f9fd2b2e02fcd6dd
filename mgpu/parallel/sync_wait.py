"""How long this rank waits for the others in a DDP step: the part of its step that is not its own work.

In a synchronous step every rank ends at the same moment, so a slow rank shows in the others' waits, not in
anyone's step time. A DDP step has two places where a rank waits for the others:

- the buffer broadcast at the start of each forward (DDP's `_pre_forward`, with `broadcast_buffers` and
  buffers to send): from a forward pre-hook on the DDP module to one on the module it wraps;
- the gradient reduction at the end of the backward: from the moment this rank's autograd graph is done (all
  its gradients computed, every bucket's all-reduce launched) to the end of DDP's own end-of-backward callback,
  which waits for every bucket. A post-accumulate-grad hook on one parameter queues an engine callback at the
  backward's end (after the graph: the first mark), which queues a second one; callbacks run in the order they
  were queued, and DDP queues its own when its last bucket is ready, between the two (the second mark).

On a CPU rank the marks are the host's clock (gloo blocks the host while it waits). On a GPU they are CUDA events
on the device's default stream (NCCL waits on the device, not the host), resolved once they completed, at a later
`take()`: never a synchronisation; the events are kept and recorded again (a new CUDA event per mark cost a step of
4 ms on an H200 8 %: bench/rank_timing.py). Each mark is a few Python calls per forward and per backward.

Not measured: FSDP2's waits (spread over every unit's all-gather and reduce-scatter), and any collective a loop
runs itself; there a rank's wait reads 0 and its step time is its work (mgpu.stop.rank_timing).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["MAX_PENDING", "SyncWait"]

MAX_PENDING = 256
"""At most this many (start, end) event pairs wait to be resolved (a GPU that many synchronisations behind)."""


class SyncWait:
    """The seconds this rank waited in its DDPs' synchronisations since the last `take()`."""

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> None:
        self._cuda = device.type == "cuda"
        self._device = device
        self._clock = clock
        self._waited = 0.0
        self._pending: list[tuple[Any, Any]] = []  # CUDA: (start, end) events not resolved yet
        self._free: list[Any] = []  # CUDA: events resolved, to be recorded again
        self._forward: Any = None  # the current forward's first mark
        self._backward: Any = None  # the current backward's end-of-graph mark
        self._queued = False  # this backward's callbacks are queued

    def attach(self, ddp: nn.Module) -> None:
        """Measure `ddp`'s (a DistributedDataParallel) waits from now on."""
        inner = getattr(ddp, "module", None)
        if isinstance(inner, nn.Module):
            ddp.register_forward_pre_hook(self._before_buffers)
            inner.register_forward_pre_hook(self._after_buffers)
        param = next((p for p in ddp.parameters() if p.requires_grad), None)
        if param is not None:
            param.register_post_accumulate_grad_hook(self._gradient)

    def take(self) -> float:
        """Seconds waited since the last call (on a GPU: the waits whose events completed; the rest later)."""
        if self._pending:
            ready = 0  # events complete in the order they were recorded: the pending ones are a suffix
            while ready < len(self._pending) and self._pending[ready][1].query():
                start, end = self._pending[ready]
                self._waited += start.elapsed_time(end) / 1000.0
                self._free += (start, end)
                ready += 1
            del self._pending[:ready]
            if len(self._pending) > MAX_PENDING:  # a device this far behind: the oldest marks are given up
                del self._pending[:len(self._pending) - MAX_PENDING]
        waited, self._waited = self._waited, 0.0
        self._queued = False  # a backward that raised left its callbacks unrun: the next one queues its own
        return waited

    # ------------------------------------------------------------------ the marks
    def _mark(self) -> Any:
        if not self._cuda:
            return self._clock()
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.default_stream(self._device))
        return event

    def _add(self, start: Any, end: Any) -> None:
        if self._cuda:
            self._pending.append((start, end))
        else:
            self._waited += max(0.0, end - start)

    def _before_buffers(self, module: nn.Module, args: Any) -> None:
        self._forward = self._mark()

    def _after_buffers(self, module: nn.Module, args: Any) -> None:
        start, self._forward = self._forward, None
        if start is not None:  # None: the wrapped module called on its own (an evaluation of the plain module)
            self._add(start, self._mark())

    def _gradient(self, param: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._graph_done)

    def _graph_done(self) -> None:
        self._backward = self._mark()
        torch.autograd.Variable._execution_engine.queue_callback(self._reduced)

    def _reduced(self) -> None:
        start, self._backward, self._queued = self._backward, None, False
        if start is not None:
            self._add(start, self._mark())
