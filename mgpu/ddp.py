"""DistributedDataParallel for mgpu: the wrapper, and a resumed run that reduces as the unbroken one did.

DDP's reducer starts with one bucket in parameter registration order and, in the forward after its
first synced backward (its second, with `static_graph`), rebuilds its buckets in the order gradients
became ready (a 1 MiB first bucket, then 25 MiB ones). With 3+ ranks an all-reduce sums each element
in an order that depends on its offset in the bucket, so the step after a resume, reduced in the
initial layout where the unbroken run used the rebuilt one, differs in the last bits (seen at 3 and 4
gloo ranks on every model tried; 2 ranks are immune, a + b == b + a). ``ResumableDDP` makes
the resumed process record the same ready order with throw-away synced passes before its first step
(`replay_bucket_rebuild`: the model's forward on the first batch, a backward of the sum of its outputs),
then puts back everything they touched: the first real forward rebuilds exactly as the unbroken run
did. No flag for the user, nothing per step (Reducer::should_rebuild_buckets, reducer.cpp; the
evidence is in tests/test_faults.py).

Not covered: a model whose ready order depends on the data (control flow) records the order of the
resumed batch; side effects of a forward beyond buffers, gradients and RNG (counters in Python
attributes, hooks) are not undone.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["ResumableDDP", "passes_before_rebuild", "replay_bucket_rebuild", "sync_buffers", "wrap"]


class ResumableDDP(DistributedDataParallel):
    """DistributedDataParallel that, in a resumed process, reduces as the unbroken run's did.

    `replay_passes`: the synced passes the saved run had done (its optimizer steps; 0 for a new run).
    At the first forward with gradients enabled, the model's forward runs once more on the same inputs,
    with a backward of the sum of its outputs, and everything that touched is put back
    (`replay_bucket_rebuild`): the real forward then rebuilds the buckets exactly as the unbroken run
    did. The ready order is the model's graph's; it does not depend on the loss (unless the loss uses
    parameters outside the model's forward). Nothing happens on 1 or 2 ranks or for a new run.
    """

    def __init__(self, *args: Any, replay_passes: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replay_after(replay_passes)

    def replay_after(self, passes: int) -> None:
        """The saved run had done `passes` synced passes: replay its bucket rebuild at the first forward."""
        world = self.process_group.size() if self.process_group is not None else 1
        # With 2 ranks every layout sums alike (a + b): no replay, the model's forward is not called again.
        self._replay_passes = passes if world > 2 else 0

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._replay_passes and torch.is_grad_enabled():
            passes, self._replay_passes = self._replay_passes, 0
            replay_bucket_rebuild(self, passes, lambda ddp: _backward_of_outputs(
                DistributedDataParallel.forward(ddp, *inputs, **kwargs)))
        return super().forward(*inputs, **kwargs)


def _backward_of_outputs(output: Any) -> None:
    """Backward of the sum of every floating tensor in `output` (tensors, sequences, mappings, dataclasses)."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.requires_grad and value.is_floating_point():
                tensors.append(value.float().sum())
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif isinstance(value, Mapping):
            for item in value.values():
                walk(item)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for item in dataclasses.fields(value):
                walk(getattr(value, item.name))

    walk(output)
    if tensors:
        torch.stack(tensors).sum().backward()


def wrap(model: nn.Module, device: torch.device, find_unused_parameters: bool = False, static_graph: bool = False,
         replay_passes: int = 0) -> ResumableDDP:
    """`model` (already on `device`) in DDP, replaying the bucket rebuild when `replay_passes` > 0."""
    return ResumableDDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                        find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                        replay_passes=replay_passes)


def passes_before_rebuild(ddp: DistributedDataParallel) -> int:
    """Synced backward passes after which the reducer rebuilds its buckets (at the next forward); 0: never."""
    if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "_delay_all_reduce_all_params", False):
        return 0
    if ddp.static_graph:
        return 2  # the first iteration only counts hooks; the second records the order
    return 0 if ddp.find_unused_parameters else 1


def replay_bucket_rebuild(ddp: DistributedDataParallel, synced_passes_done: int,
                          forward_backward: Callable[[DistributedDataParallel], None]) -> int:
    """On every rank, right after DDP is built on resume and before the first real step: the passes the
    unbroken run's reducer had seen before its rebuild, their effects undone. Returns how many ran.

    `synced_passes_done`: synced backward passes of the saved run (one per optimizer step).
    `forward_backward(ddp)`: one forward through `ddp` and backward of the loss, as a real synced
    micro-step does it (same batch type, autocast and loss code); its gradients are thrown away.
    """
    passes = min(synced_passes_done, passes_before_rebuild(ddp))
    if passes == 0:
        return 0
    module = ddp.module
    params = list(module.parameters())
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    buffers = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
           torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    training = {m: m.training for m in module.modules()}
    flags = (ddp.require_forward_param_sync, ddp.require_backward_grad_sync)
    try:
        ddp.require_backward_grad_sync = True  # a no_sync pass records nothing
        for _ in range(passes):
            forward_backward(ddp)
    finally:
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                buffer.copy_(buffers[name])  # BatchNorm running stats, num_batches_tracked, ...
        for param, grad in zip(params, grads):
            param.grad = grad
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])  # dropout drew from it
        if rng[3] is not None:
            torch.cuda.set_rng_state_all(rng[3])
        for submodule, mode in training.items():
            submodule.training = mode
        ddp.require_forward_param_sync, ddp.require_backward_grad_sync = flags
    return passes


def sync_buffers(module: nn.Module) -> None:
    """Rank 0's buffers on every rank (a collective), as DDP's next forward would make them.

    Between forwards each rank keeps its own BatchNorm statistics; an evaluation of the plain module
    would then see different statistics on each rank, and other ones after a resume (every rank loads
    rank 0's). Evaluating with rank 0's changes no training step: DDP broadcasts them at each forward."""
    import torch.distributed as dist

    for buffer in module.buffers():
        dist.broadcast(buffer, src=0)
