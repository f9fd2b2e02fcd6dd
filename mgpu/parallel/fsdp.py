"""FSDP2 (`fully_shard`) for mgpu's trainer and for a loop of one's own: sharding a model, and the few places
where a loop written for DDP must do something else with sharded parameters (DTensors).

    model = session.wrap(Net(), parallel="fsdp")   # instead of session.wrap(Net()): the one line that changes
    optimizer = torch.optim.AdamW(model.parameters())   # after sharding: over the sharded parameters

Default sharding: every top-level child that has parameters is its own FSDP unit (a ModuleList's or
ModuleDict's members in its place: GPT's blocks), then the root (torchtitan's per-block layout). A task shards its own way with `Task.shard`.
Every rank starts from rank 0's weights and buffers, as DDP's wrap does (broadcast before sharding): the initial
model is the same on any world size, whatever the init (orthogonal, per-rank loaded weights) and however each
rank was seeded. Buffers (BatchNorm statistics) are not sharded: as DDP does, every forward starts from rank 0's,
so that every rank evaluates and checkpoints the same ones.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from mgpu.errors import MgpuError

__all__ = ["default_units", "diverged_replicas", "has_shards", "is_sharded", "local_grads", "no_sync", "plain", "refuse_stale_optimizers",
           "refuse_to_wrap", "shard", "sharded_checkpoints", "weights_fingerprint"]

ShardHook = Callable[[nn.Module, Any], "nn.Module | None"]


def _fully_shard() -> Any:
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def is_sharded(module: nn.Module) -> bool:
    """Whether `module` was sharded with fully_shard (FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def has_shards(module: nn.Module) -> bool:
    """Whether `module` holds a DTensor parameter (sharded with FSDP2, or an mgpu.EMA sharded like its model): its
    weights' fingerprint is then a collective."""
    dtensor = _dtensor_class()
    return dtensor is not None and any(isinstance(param, dtensor) for param in module.parameters())


def _dtensor_class() -> Any:
    """DTensor, where its module is imported (a DTensor exists only then: no import of it for a DDP run)."""
    import sys

    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


SMALL_UNIT = 1 / 8
"""A child with fewer parameters than this fraction of the largest unit's stays with the root: its own unit would
cost three collectives a step (its all-gathers in forward and backward, its reduce-scatter) for a negligible share of
the memory (a final LayerNorm, a small position embedding). Latency-bound collectives showed it: on 2 CPU ranks
(gloo), GPT's position embedding and final LayerNorm as units of their own made the step 1.4x a hand-written loop
that shards only the blocks, and the same layout as that loop's made it equal (bench/gpu/side_by_side.py)."""


def default_units(model: nn.Module) -> list[nn.Module]:
    """The default layout's FSDP units below the root: every child with parameters; a container child (a
    ModuleList or ModuleDict: no forward of its own, which fully_shard refuses) gives its children instead,
    so GPT's `blocks` list becomes one unit per block. A child that shares a parameter with another (tied
    embedding and output weights) stays with the root: a parameter belongs to one unit. So does a child smaller
    than SMALL_UNIT of the largest unit."""
    def candidates(module: nn.Module) -> list[nn.Module]:
        found: list[nn.Module] = []
        for child in module.children():
            if not any(True for _ in child.parameters()):
                continue
            if type(child).forward is nn.Module.forward:  # a container: nothing calls it, its members run
                found += candidates(child)
            else:
                found.append(child)
        return found

    units = candidates(model)
    owners: dict[int, int] = {}
    for unit in units:
        for param in unit.parameters():
            owners[id(param)] = owners.get(id(param), 0) + 1
    units = [unit for unit in units if all(owners[id(param)] == 1 for param in unit.parameters())]
    sizes = [sum(param.numel() for param in unit.parameters()) for unit in units]
    largest = max(sizes, default=0)
    return [unit for unit, size in zip(units, sizes) if size >= SMALL_UNIT * largest]


def shard(model: nn.Module, device: torch.device, hook: ShardHook | None = None) -> nn.Module:
    """`model` (on `device`) sharded over every rank with FSDP2. `hook(model, mesh)`: the task's own layout
    (fully_shard what it wants, mixed precision, reshard_after_forward); it must leave the root sharded, or
    return None for the default."""
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = _fully_shard()
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = init_device_mesh(device.type, (world,))
    model = model.to(device)
    if world > 1:
        broadcast_weights(model)
    done = hook(model, mesh) if hook is not None else None
    if done is None:
        for unit in default_units(model):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = done
    if not is_sharded(model):
        raise ValueError("the shard hook must fully_shard the root module (or return None for the default)")
    if world > 1 and any(True for _ in model.buffers()):
        model.register_forward_pre_hook(_broadcast_buffers)
    return model


def broadcast_weights(model: nn.Module) -> None:
    """*Collective.* Rank 0's parameters and buffers into every rank's `model` (not sharded yet), as DDP's wrap
    broadcasts them: each rank was seeded seed + rank, and sharding each rank's own init would make the
    initial model a patchwork of every rank's (rows 0-63 from rank 0, 64-127 from rank 1)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def refuse_to_wrap(model: nn.Module, parallel: str, wrapped: bool, checkpoint_format: str) -> None:
    """MgpuError, one line, for a model `Session.wrap(model, parallel=...)` must not wrap: one it wrapped already
    (`wrapped`), a DDP or FSDP2 module (they do not nest), an unknown `parallel`, and under fsdp a model without
    parameters or single-file checkpoints (which cannot hold a sharded model)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, nn.Module):
        raise MgpuError(f"Session.wrap() takes a torch.nn.Module, got a {type(model).__name__}")
    if isinstance(model, DistributedDataParallel) or wrapped:  # on one rank as on many
        raise MgpuError("Session.wrap(): this model is wrapped already (DDP inside DDP on several ranks): "
                        "wrap the plain module, once")
    if any(is_sharded(module) for module in model.modules()):
        raise MgpuError("Session.wrap(): this model is sharded with FSDP2 already (DDP and FSDP2 do not nest, and "
                        "a model is sharded once): wrap the plain module, once, with the parallel you want")
    if parallel not in ("ddp", "fsdp"):
        raise MgpuError(f"Session.wrap(parallel={parallel!r}): use 'ddp' or 'fsdp'")
    if parallel == "fsdp" and not any(True for _ in model.parameters()):
        raise MgpuError(f"Session.wrap(parallel='fsdp'): the {type(model).__name__} has no parameters, nothing to "
                        f"shard: wrap it without parallel='fsdp'")
    if parallel == "fsdp" and checkpoint_format == "single":
        raise MgpuError("Session.wrap(parallel='fsdp') with checkpoint.format=single: a single-file checkpoint "
                        "cannot hold a sharded model; set checkpoint.format to auto or sharded")


def refuse_stale_optimizers(objects: Mapping[str, Any]) -> None:
    """MgpuError, one line, when an optimizer of `objects` holds parameters that are not those of the modules in
    `objects` now: built before `wrap(parallel='fsdp')`, it holds the parameters sharding replaced (it would train
    nothing, and a sharded checkpoint cannot name them)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    # A forward without its backward (a metric's check at start) leaves an FSDP2 root unsharded, its module
    # attributes the unsharded parameters: back to the sharded ones, which an optimizer built after wrap holds.
    for value in objects.values():
        for module in value.modules() if isinstance(value, nn.Module) else ():
            if isinstance(module, FSDPModule):
                module.reshard()
    owned = {id(param) for value in objects.values() if isinstance(value, nn.Module)
             for param in (value.module if isinstance(value, DistributedDataParallel) else value).parameters()}
    for name, value in objects.items():
        if not isinstance(value, torch.optim.Optimizer):
            continue
        foreign = sum(1 for group in value.param_groups for param in group["params"] if id(param) not in owned)
        if foreign:
            raise MgpuError(f"state[{name!r}] optimizes {foreign} parameter(s) that are not the state's models' "
                            f"parameters now (an optimizer built before session.wrap(model, parallel='fsdp'), which "
                            f"replaces them with sharded ones, trains nothing): build the optimizer after wrap, over "
                            f"the wrapped model's parameters, and put every model it trains in the state")


def sharded_checkpoints(checkpoint_format: str, parallel: str, sharded_model: bool) -> bool:
    """Whether a run's checkpoints are sharded: `checkpoint.format` sharded, or auto and an FSDP2 model
    (`train.parallel` fsdp, or a model a session sharded)."""
    return checkpoint_format == "sharded" or (checkpoint_format == "auto" and (sharded_model or parallel == "fsdp"))


def _broadcast_buffers(module: nn.Module, args: Any) -> None:
    # As DDP's broadcast_buffers: rank 0's BatchNorm statistics at every forward (FSDP2 leaves them per rank).
    if torch.is_grad_enabled() and module.training:
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally (no reduction) in this block: DDP's `no_sync`, FSDP2's
    `set_requires_gradient_sync(False)`; nothing for a plain module."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield


def plain(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value as a plain tensor (a collective for a sharded one); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def local_grads(model: nn.Module) -> list[torch.Tensor]:
    """This rank's gradient tensors (a DTensor's local shard): scaling them all by one factor, the same on
    every rank, scales the whole gradient."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]


FINGERPRINT_PREFIX = "bits:"
"""Marks the exact fingerprint (below) apart from the hex-float one of ledgers written before it: never equal."""
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The int64 sum of `tensor`'s elements read as integers of their size (their bit patterns): no copy."""
    return tensor.view(_BITS[tensor.element_size()]).sum(dtype=torch.int64)


def weights_fingerprint(model: nn.Module) -> str:
    """A cheap digest of the weights, the same for the same weights however they are sharded: the sums of every
    parameter's bit patterns (as integers: exact, so any order of summation, hence any sharding, gives the same),
    weighted by the parameter's position, modulo 2^64. A sharded parameter is summed over its local shard and the
    shards' sums meet in one all-reduce per device mesh: no all-gather and no float64 copy of any weight. A
    collective when `model` is sharded: call it on every rank."""
    from torch.distributed.tensor import DTensor, Shard

    params = [param.detach() for param in model.parameters()]
    if not params:
        return f"{FINGERPRINT_PREFIX}{0:016x}"
    with torch.no_grad():
        sums: list[torch.Tensor] = []
        meshes: dict[int, tuple[Any, list[int]]] = {}  # a mesh's id -> (the mesh, its sharded parameters' indices)
        for index, param in enumerate(params):
            if isinstance(param, DTensor) and all(isinstance(p, Shard) for p in param.placements):
                sums.append(_bits_sum(param.to_local()))  # the shards partition the elements: their sums add up
                meshes.setdefault(id(param.device_mesh), (param.device_mesh, []))[1].append(index)
            else:  # a plain tensor, or one replicated somewhere (HSDP): its full value on every rank
                sums.append(_bits_sum(plain(param)))
        device = sums[0].device
        vector = torch.stack([s.to(device) for s in sums])
        for mesh, indices in meshes.values():
            chosen = torch.tensor(indices, device=device)
            partial = torch.zeros_like(vector).index_copy_(0, chosen, vector[chosen])
            for dim in range(mesh.ndim):
                torch.distributed.all_reduce(partial, group=mesh.get_group(dim))
            vector = vector.index_copy(0, chosen, partial[chosen])
        values = vector.tolist()
    total = sum((index + 1) * value for index, value in enumerate(values)) % (1 << 64)
    return f"{FINGERPRINT_PREFIX}{total:016x}"


def diverged_replicas(modules: Mapping[str, nn.Module]) -> str | None:
    """*Collective* (one all-gather of a number per module). Why a checkpoint cannot keep one copy of a module's
    replicated tensors (its parameters that are not DTensors: a DDP model's, a plain module's): the first module of
    `modules` whose copies differ between ranks, by the exact fingerprint above, and which ranks differ from rank
    0's (None: every module agrees, or one rank). The same answer on every rank."""
    dtensor = _dtensor_class() or type(None)
    if not dist.is_initialized() or dist.get_world_size() == 1 or not modules:
        return None
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
              else torch.device("cpu"))
    sums = []
    with torch.no_grad():
        for module in modules.values():
            plain_ = [param.detach() for param in module.parameters() if not isinstance(param, dtensor)]
            total = torch.zeros((), dtype=torch.int64, device=device)
            for index, param in enumerate(plain_):
                total += (index + 1) * _bits_sum(param).to(device)
            sums.append(total)
        mine = torch.stack(sums)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
    rows = torch.stack(every).cpu()
    for column, name in enumerate(modules):
        differ = [rank for rank in range(1, len(every)) if rows[rank, column] != rows[0, column]]
        if differ:
            return (f"state[{name!r}]: its weights differ between ranks (rank(s) {differ} are not rank 0's) and a "
                    f"checkpoint keeps one copy of a module that is not sharded: make it the same on every rank (built "
                    f"from rank 0's weights after session.wrap, updated from values every rank has; each rank's "
                    f"generators are seeded seed + rank), or keep an average of the weights with mgpu.EMA(model), "
                    f"sharded like its model")
    return None
