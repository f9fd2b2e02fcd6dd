"""An exponential moving average (EMA) of a model's weights that is exact under DDP and FSDP2, for the trainer
(`train.ema_decay`) and a loop of one's own:

    model = session.wrap(Net(), parallel="fsdp")        # or DDP, or one rank
    ema = mgpu.EMA(model, decay=0.999)                  # after wrap: its copy is sharded like the model
    state = session.load({"model": model, "ema": ema, ...})   # saved and restored with the state
    ...optimizer.step(); ema.update()                   # every optimizer step
    with ema.applied():                                 # the model holds the EMA's weights inside the block
        evaluate(model)

What users know from timm's ModelEmaV3, torch's AveragedModel(get_ema_multi_avg_fn) and Lightning's EMA callbacks:
`ema = decay * ema + (1 - decay) * weights` by `lerp_` (AveragedModel's op), floating buffers (BatchNorm statistics)
averaged and the others copied (timm's), the first copy the model's weights at construction.

- **Sharded like its model.** Under FSDP2 each averaged tensor is a DTensor with its parameter's placements: every
  rank holds its own shard and updates it from its parameter's local shard (no all-gather, no collective for the
  weights); a sharded checkpoint saves it through DCP as it saves the model, and it reshards onto any world size.
  Under DDP (and on one rank) it is a plain copy, replicated, saved once.
- **The same on every rank.** Buffers are per rank after a forward (each rank's BatchNorm statistics of its own
  batch; DDP and mgpu's FSDP2 hook make the next forward start from rank 0's): the EMA takes rank 0's, one
  broadcast per update for a model with buffers on several ranks (one per dtype), so its copies never diverge.
- **No copy of the architecture.** `copy.deepcopy` of an FSDP2 model fails (torch refuses it), so the average lives
  in a mirror of the model's module tree that holds tensors only (the same names: its state_dict is the model's
  under `module.`, plus the count `n_averaged`, as AveragedModel's). It is evaluated or exported through the model:
  `applied()` swaps the model's weights with the average in place (a tensor's worth of extra memory at a time), as
  Lightning's EMA callbacks swap them for validation. `mgpu.load_model(run, net, ema=True)` loads it into a plain
  module of the architecture.

Bit-identical across stops: the update is elementwise, so the EMA follows the model's weights exactly, whatever
the sharding; saved and restored with the state it resumes as the model does.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from mgpu.errors import MgpuError

__all__ = ["EMA", "ema_weights"]

PREFIX = "module."
"""Where the averaged weights are in an EMA's state_dict (AveragedModel's and timm's layout)."""
COUNTER = "n_averaged"


class _Mirror(nn.Module):
    """A node of the model's module tree that holds the EMA's tensors under the model's names; no forward."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise MgpuError("an EMA holds its model's averaged weights, not a module to run: evaluate the model inside "
                        "`with ema.applied():` (the model then holds the EMA's weights)")


def _class(module: str, name: str) -> Any:
    """A torch class if its module is imported (a DTensor or an FSDP2 module exists only then): importing
    torch.distributed.fsdp costs a start about a second."""
    return getattr(sys.modules.get(module), name, None)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of its storage); any other tensor as it is."""
    dtensor = _class("torch.distributed.tensor", "DTensor")
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor) else tensor


def _reshard(model: nn.Module) -> None:
    """FSDP2's units back to their sharded parameters (a forward without its backward leaves a unit unsharded: its
    module attributes are then the gathered copies, not the parameters the optimizer steps)."""
    fsdp = _class("torch.distributed.fsdp", "FSDPModule")
    for module in model.modules() if fsdp is not None else ():
        if isinstance(module, fsdp):
            module.reshard()


def _unwrapped(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class EMA(nn.Module):
    """An exponential moving average of `model`'s parameters and persistent buffers (see the module's docstring).
    Make it after `session.wrap(model, ...)` (under FSDP2 it must: wrap replaces the parameters) and before
    `session.load()`; put it in the state; call `update()` after every optimizer step; evaluate the model inside
    `with ema.applied():`. *Collective* on several ranks for a model not wrapped yet (its copy starts from rank 0's
    weights, which DDP's wrap gives the model)."""

    def __init__(self, model: nn.Module, decay: float = 0.999) -> None:
        super().__init__()
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0 \
                or math.isnan(decay):
            raise MgpuError(f"EMA(decay={decay!r}): a number in [0, 1) (0.999 averages over about 1000 steps)")
        if not isinstance(model, nn.Module):
            raise MgpuError(f"EMA() takes the model (a torch.nn.Module), got a {type(model).__name__}")
        if isinstance(model, EMA):
            raise MgpuError("EMA(an EMA): give it the model it averages")
        source = _unwrapped(model)
        _reshard(source)
        self.decay = float(decay)
        self.__dict__["_source"] = source  # not a submodule: the EMA holds the model's average, not the model
        self.__dict__["_applied"] = False
        self.module = _Mirror()
        nodes: dict[str, nn.Module] = {"": self.module}

        def node(path: str) -> nn.Module:
            if path not in nodes:
                parent, _, leaf = path.rpartition(".")
                nodes[path] = _Mirror()
                node(parent).add_module(leaf, nodes[path])
            return nodes[path]

        copies: dict[int, Any] = {}  # a tensor of the model's -> its average (tied ones share it)
        self._params: list[tuple[torch.Tensor, torch.Tensor]] = []  # (average, the parameter), each once
        with torch.no_grad():
            for name, param in source.named_parameters(remove_duplicate=False):
                owner, _, leaf = name.rpartition(".")
                if id(param) not in copies:
                    copies[id(param)] = nn.Parameter(param.detach().clone(), requires_grad=False)
                    self._params.append((copies[id(param)], param))
                node(owner).register_parameter(leaf, copies[id(param)])
            self._buffers_of: list[tuple[torch.Tensor, nn.Module, str]] = []  # (average, its module, its name)
            for path, module in source.named_modules(remove_duplicate=False):
                for leaf, buffer in module.named_buffers(recurse=False):
                    if buffer is None or leaf in module._non_persistent_buffers_set:
                        continue
                    if id(buffer) not in copies:
                        copies[id(buffer)] = buffer.detach().clone()
                        self._buffers_of.append((copies[id(buffer)], module, leaf))
                    node(path).register_buffer(leaf, copies[id(buffer)])
            if _distributed() and source is model and not any(_local(a) is not a for a, _ in self._params):
                # A plain model on several ranks, not wrapped yet: each rank's own init (seed + rank). DDP's wrap
                # will give the model rank 0's weights; the average starts from them too.
                mine = [a for a, _ in self._params] + [a for a, _, _ in self._buffers_of]
                for average, value in zip(mine, _from_rank0(mine)):
                    average.copy_(value)
        self._ids = self._source_ids()
        device = next((b.device for b, _ in self._params), torch.device("cpu"))
        self.register_buffer(COUNTER, torch.zeros((), dtype=torch.int64, device=device))

    # ------------------------------------------------------------------ the average
    @property
    def source(self) -> nn.Module:
        """The model this EMA averages (DDP's inner module)."""
        source: nn.Module = self.__dict__["_source"]  # set in __init__: not a submodule
        return source

    def _source_ids(self) -> tuple[int, ...]:
        return tuple(id(p) for p in self.source.parameters())

    def check_source(self) -> None:
        """MgpuError (one line) when the model's parameters are no longer those the EMA was made of: made before
        `session.wrap(model, parallel="fsdp")`, which replaces them with sharded ones, it would average weights
        that no longer train."""
        if self._source_ids() == self._ids:
            return
        _reshard(self.source)
        if self._source_ids() != self._ids:
            raise MgpuError("mgpu.EMA: the model's parameters are not those the EMA was made of (made before "
                            "session.wrap(model, parallel='fsdp'), which replaces them with sharded ones?): make "
                            "the EMA after wrap, from the model wrap returned")

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: average = decay * average + (1 - decay) * weights, each rank on its own shard
        (FSDP2) or copy. *Collective* on several ranks when the model has buffers (rank 0's are averaged)."""
        if self.__dict__["_applied"]:
            raise MgpuError("EMA.update() inside `with ema.applied():` (the model holds the EMA's weights there): "
                            "update after the block")
        self.check_source()
        weight = 1.0 - self.decay
        by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for average, param in self._params:
            mine, theirs = by_dtype.setdefault(average.dtype, ([], []))
            mine.append(_local(average))
            theirs.append(_local(param.detach()))
        for mine, theirs in by_dtype.values():
            if mine[0].is_floating_point():
                torch._foreach_lerp_(mine, theirs, weight)
            else:
                torch._foreach_copy_(mine, theirs)
        for average, value in zip([a for a, _, _ in self._buffers_of], self._rank0_buffers()):
            if average.is_floating_point():
                average.lerp_(value.to(average.dtype), weight)
            else:
                average.copy_(value)
        self.get_buffer(COUNTER).add_(1)

    def _rank0_buffers(self) -> list[torch.Tensor]:
        """The model's buffers as rank 0 has them (its own on one rank): one broadcast per dtype."""
        live = [getattr(module, leaf).detach() for _, module, leaf in self._buffers_of]
        return _from_rank0(live) if live and _distributed() else live

    @property
    def updates(self) -> int:
        """Updates made (restored with the state)."""
        return int(self.get_buffer(COUNTER).item())

    # ------------------------------------------------------------------ using it
    @contextlib.contextmanager
    def applied(self) -> Iterator[nn.Module]:
        """The model holds the EMA's weights (parameters and buffers) inside the block, its own again after it,
        bit for bit: evaluate or export the model there. The weights are swapped in place, one tensor at a time;
        an FSDP2 model is resharded on both sides, so no gathered copy of either outlives the block. Yields the
        model. Do not train or save inside the block."""
        if self.__dict__["_applied"]:
            raise MgpuError("`with ema.applied():` inside another: the model holds the EMA's weights already")
        self.check_source()
        self._swap()
        self.__dict__["_applied"] = True
        try:
            yield self.source
        finally:
            _reshard(self.source)
            self._swap()
            self.__dict__["_applied"] = False

    @torch.no_grad()
    def _swap(self) -> None:
        pairs = [(_local(a), _local(p.detach())) for a, p in self._params]
        pairs += [(a, getattr(module, leaf).detach()) for a, module, leaf in self._buffers_of]
        for average, live in pairs:
            held = live.clone()
            live.copy_(average)
            average.copy_(held)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_applied"):
            raise MgpuError("a save inside `with ema.applied():` (the model and the EMA hold each other's weights "
                            "there): save after the block")
        return super().state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"decay={self.decay}"


def _from_rank0(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """*Collective.* Rank 0's values of `tensors` (plain, the same shapes on every rank), one broadcast per dtype
    and device; new tensors, `tensors` left as they are."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.device), []).append(index)
    for indices in groups.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        dist.broadcast(flat, src=0)
        offset = 0
        for i in indices:
            count = tensors[i].numel()
            out[i] = flat[offset:offset + count].view_as(tensors[i])
            offset += count
    return out


def ema_weights(state: dict[str, Any]) -> dict[str, Any]:
    """An EMA's saved state_dict as its model's (the `module.` prefix off, the counter left out): what loads into a
    plain module of the architecture (mgpu.load_model(..., ema=True))."""
    if not any(key.startswith(PREFIX) for key in state):
        raise MgpuError(f"not an EMA's state (no {PREFIX!r} keys: it has {sorted(state)[:4]}...)")
    return {key[len(PREFIX):]: value for key, value in state.items() if key.startswith(PREFIX)}
