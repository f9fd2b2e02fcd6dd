"""DistributedDataParallel for mgpu: the wrapper, and a resumed run that reduces as the unbroken one did.

DDP's reducer starts with one bucket in reversed parameter registration order and, in the forward after
its first synced backward (its third forward, with `static_graph`), rebuilds its buckets in the order
gradients became ready (a 1 MiB first bucket, then 25 MiB ones). With 3+ ranks an all-reduce sums each
element in an order that depends on its offset in the bucket, so a resumed process, reduced in the
initial layout where the unbroken run used the rebuilt one, differs in the last bits (seen at 3 and 4
gloo ranks on every model tried; 2 ranks are immune, a + b == b + a).

`ResumableDDP` records the layout instead of recomputing it: it notes the order in which gradients
became ready in its first synced backward (hooks removed after it) and derives the buckets as the
reducer's rebuild does (`_compute_bucket_assignment_by_size` on that order; a test checks it against the
reducer's own record). `bucket_layout(ddp)` returns that layout as plain data for the checkpoint, with
the state of a registered comm hook (PowerSGD's error feedback, per rank, gathered to the writer only); a resumed process builds its
reducer with the saved buckets (`ResumableDDP(..., bucket_layout=...)` or `resume_layout`), so its
first step reduces in the unbroken run's order. The model's forward never runs an extra time.

Not covered: a model whose ready order depends on the data (control flow): the resumed reducer's own
rebuild, after its first backward, follows the resumed batch's order (said in the log).
"""

from __future__ import annotations

import contextlib
import logging
import gc
import os
import weakref
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["ResumableDDP", "SessionDDPs", "bucket_layout", "passes_before_rebuild", "release_ddps", "sync_buffers",
           "wrap"]

log = logging.getLogger("mgpu.train")


def passes_before_rebuild(ddp: DistributedDataParallel) -> int:
    """Synced backward passes after which the reducer rebuilds its buckets (at the next forward); 0: never."""
    if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "_delay_all_reduce_all_params", False):
        return 0
    if ddp.static_graph:
        return 2  # the first iteration only counts hooks; the second records the order
    return 0 if ddp.find_unused_parameters else 1


class ResumableDDP(DistributedDataParallel):
    """DistributedDataParallel whose bucket layout can be saved (`bucket_layout`) and given back to a
    resumed process (`bucket_layout=` here, or `resume_layout` before the first forward): it then reduces
    in the same order as the unbroken run. Costs nothing per step: hooks on the parameters only until the
    first synced backward has been seen."""

    def __init__(self, *args: Any, bucket_layout: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._params: list[torch.Tensor] = self._build_params_for_reducer()[0]  # the reducer's variables, in its index order
        self._rebuild_after = passes_before_rebuild(self)
        self._passes = 0  # synced forwards in this process
        self._order: list[int] = []  # reducer indices, in the order their gradients became ready
        self._recording = False
        self._layout: dict[str, Any] | None = None  # what bucket_layout() saves: this process's, else the loaded
        self._saved_passes = 0  # the saved run's synced passes (capped at the rebuild's)
        self._pending: dict[str, Any] | None = None  # a loaded layout to install at a later pass (static_graph)
        self._install_at = 0
        self._hook_states: list[Any] | None = None  # this rank's saved comm hook states, until registered
        self._ready_hooks = [p.register_post_accumulate_grad_hook(self._make_ready_hook(i))
                             for i, p in enumerate(self._params)] if self._rebuild_after else []
        if bucket_layout is not None:
            self.resume_layout(bucket_layout)

    # ------------------------------------------------------------------ recording the ready order
    def _make_ready_hook(self, index: int) -> Any:
        owner = weakref.ref(self)  # the hooks live on the parameters, which the module holds

        def ready(param: torch.Tensor) -> None:
            ddp = owner()
            if ddp is not None and ddp._recording:
                ddp._order.append(index)
        return ready

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            if self._recording:  # the recorded pass's backward is over
                self._finish_recording()
            self._passes += 1
            if self._pending is not None and self._passes == self._install_at:
                self._install(self._pending)
                self._pending = None
            if self._passes == 1 and self._ready_hooks:
                self._order, self._recording = [], True
        elif self._recording:
            self._finish_recording()
        return super().forward(*inputs, **kwargs)

    def _finish_recording(self) -> None:
        self._recording = False
        for handle in self._ready_hooks:
            handle.remove()
        self._ready_hooks = []
        if len(self._order) != len(self._params):  # unused parameters: the reducer would have failed; keep none
            return
        mine = _assign_buckets(self, self._order)
        loaded = self._layout
        if loaded is not None and loaded["buckets"] != mine["buckets"]:
            log.warning("the model's gradients became ready in another order than in the saved run (control flow "
                        "that depends on the data?): from the next step on DDP reduces in another order, which "
                        "changes the last bits of every step after the resume")
        self._layout = mine

    @property
    def synced_passes(self) -> int:
        """Synced passes of the run (the saved run's and this process's), capped at the rebuild's."""
        return min(self._rebuild_after, self._saved_passes + self._passes)

    # ------------------------------------------------------------------ resuming with a saved layout
    def resume_layout(self, layout: dict[str, Any]) -> None:
        """Build the reducer with `layout` (from `bucket_layout` of the saved run), before the first forward,
        so that this process reduces as the saved run would have from its next step; and keep the saved
        comm hook states for the hook registered (before or after this call)."""
        if self._passes:
            raise RuntimeError("ResumableDDP.resume_layout(): call it before the first forward")
        buckets = layout.get("buckets")
        flat = sorted(i for bucket in buckets or [] for i in bucket)
        if buckets is None:
            pass  # saved before its first synced backward: DDP's own initial layout, as then
        elif flat != list(range(len(self._params))):
            log.warning("the checkpoint's DDP bucket layout is for another model (%d parameters, this one has %d): "
                        "DDP builds its own; the steps after the resume may differ in the last bits",
                        len(flat), len(self._params))
        elif self._rebuild_after:
            self._layout = {"buckets": buckets, "limits": layout["limits"]}
            self._saved_passes = min(self._rebuild_after, int(layout.get("passes", self._rebuild_after)))
            # The saved run had rebuilt (or would at its next forward): this reducer starts with those buckets.
            # Under static_graph a run saved after one pass rebuilt one pass later: the layout goes in then.
            missing = self._rebuild_after - self._saved_passes
            self._install_at = missing + 1 if missing else 0
            if self._install_at == 0:
                self._install(layout)
            else:
                self._pending = layout
        hooks = layout.get("hooks") or []
        rank = dist.get_rank(self.process_group)
        if hooks and len(hooks) != dist.get_world_size(self.process_group):
            log.warning("the comm hook's state was saved on %d ranks, this run has %d: the hook starts afresh",
                        len(hooks), dist.get_world_size(self.process_group))
        elif hooks:
            self._hook_states = list(hooks[rank])
            for position, (_, state) in enumerate(self._comm_hooks):
                self._load_hook_state(position, state)

    def _install(self, layout: dict[str, Any]) -> None:
        """A new reducer over the same parameters, with `layout`'s buckets (as DDP's own __setstate__ builds
        one), the static graph flag, and the comm hooks already registered."""
        buckets, limits = layout["buckets"], layout["limits"]
        parameters, expect_sparse = self._build_params_for_reducer()
        names = self._build_debug_param_to_name_mapping(parameters)
        self.__dict__.pop("logger", None)  # the logger holds the old reducer; its hooks go with it
        self.__dict__.pop("reducer", None)
        with _initial_buckets(buckets, limits):
            self._ddp_init_helper(parameters, expect_sparse, names, self.static_graph)
        if self.static_graph:
            self.reducer._set_static_graph()
            if self.logger is not None:
                self.logger._set_static_graph()
            self._static_graph_delay_allreduce_enqueued = False  # a new reducer: its first iteration again
        for hook, state in self._comm_hooks:
            dist._register_comm_hook(self.reducer, state, hook)

    # ------------------------------------------------------------------ comm hooks with state
    def register_comm_hook(self, state: object, hook: Any) -> None:
        super().register_comm_hook(state, hook)
        self._load_hook_state(len(self._comm_hooks) - 1, state)

    def _load_hook_state(self, position: int, state: object) -> None:
        if self._hook_states is None or position >= len(self._hook_states) or self._hook_states[position] is None:
            return
        saved = self._hook_states[position]
        self._hook_states[position] = None  # loaded once
        if hasattr(state, "load_state_dict"):
            state.load_state_dict(saved)
        else:
            with _quiet_powersgd():
                values = {key: _from_plain(value) for key, value in saved.items()}
                state.__setstate__(values)  # type: ignore[attr-defined]  # an object whose class defines __setstate__ (checked when saved)


def _hook_state(state: object) -> Any:
    """A comm hook state as plain data a checkpoint holds (None: nothing to keep)."""
    if state is None:
        return None
    if hasattr(state, "state_dict") and hasattr(state, "load_state_dict"):
        return state.state_dict()
    getstate = getattr(type(state), "__getstate__", None)
    if getstate is not None and getstate is not getattr(object, "__getstate__", None) and hasattr(state, "__setstate__"):
        with _quiet_powersgd():
            return {key: _to_plain(value) for key, value in getstate(state).items()}
    raise TypeError(f"the comm hook's state ({type(state).__name__}) cannot be checkpointed: give it "
                    f"state_dict()/load_state_dict(), or register the hook with a state of None")


def bucket_layout(ddp: nn.Module) -> dict[str, Any] | None:
    """*Collective* (it gathers every rank's comm hook state to the group's rank 0, the checkpoint's writer).
    What a resumed process needs to reduce as `ddp` does, as plain data for a checkpoint: `buckets` (reducer
    indices per bucket, in reduction order), `limits` (their size limits), `passes` (synced passes seen, capped
    at the rebuild's) and, on rank 0, `hooks` (per rank, each registered comm hook's state: the checkpoint holds
    every rank's once, each rank resumes its own; the other ranks hold only their own, never world x it). None
    when there is nothing to keep yet (no synced backward, DDP never rebuilds, or not a ResumableDDP)."""
    if not isinstance(ddp, ResumableDDP):
        return None
    if ddp._recording:  # saved right after the recorded pass (a stop at step 1): its backward is over
        ddp._finish_recording()
    hooks: list[Any] = []
    if ddp._comm_hooks:
        mine = [_hook_state(state) for _, state in ddp._comm_hooks]
        writer = dist.get_rank(ddp.process_group) == 0
        gathered: list[Any] | None = [None] * dist.get_world_size(ddp.process_group) if writer else None
        dist.gather_object(mine, gathered, group=ddp.process_group, group_dst=0)
        hooks = gathered or []
    if ddp._layout is None:
        return {"buckets": None, "limits": None, "passes": 0, "hooks": hooks} if hooks else None
    return {"buckets": ddp._layout["buckets"], "limits": ddp._layout["limits"], "passes": ddp.synced_passes,
            "hooks": hooks}


def _assign_buckets(ddp: ResumableDDP, order: list[int]) -> dict[str, Any]:
    """The buckets the reducer's rebuild makes from `order` (Reducer::rebuild_buckets, reducer.cpp): a first
    bucket of first_bucket_bytes_cap, then bucket_bytes_cap ones (or the explicit per-bucket caps)."""
    params = ddp._build_params_for_reducer()
    expect_sparse = params[1]
    config = getattr(ddp, "_bucket_config", None)
    limits = list(config.compute_bucket_size_limits(ddp.static_graph, ddp.find_unused_parameters)[1]) if config else []
    if not limits:
        first = config.first_bucket_bytes_cap if config is not None else dist._DEFAULT_FIRST_BUCKET_BYTES
        limits = [first, ddp.bucket_bytes_cap]
    order = list(order)
    last_small = os.environ.get("DDP_SET_LAST_BUCKET_CAP", "N/A") == "1"
    if last_small:
        order.reverse()
    assign = dist._compute_bucket_assignment_by_size
    buckets, sizes = assign([ddp._params[i] for i in order], limits, expect_sparse, order)
    buckets, sizes = [list(b) for b in buckets], list(sizes)
    if last_small:
        buckets.reverse()
        sizes.reverse()
    return {"buckets": buckets, "limits": sizes}


BUCKET_ASSIGNMENT = "_compute_bucket_assignment_by_size"
"""The torch.distributed private that DDP's constructor asks for its initial buckets (torch 2.x)."""


@contextlib.contextmanager
def _initial_buckets(buckets: list[list[int]], limits: list[int]) -> Iterator[None]:
    """DDP's __init__ helper computes its initial buckets with torch.distributed's private BUCKET_ASSIGNMENT and
    reverses them: answer with the saved buckets, reversed, so that the reducer gets them as they were. Torch has
    no public way to give a reducer its buckets (the Reducer's own constructor is private too), so the answer is
    replaced for the constructor's duration alone, here and nowhere else. Should a torch release rename the
    function, or stop asking it, this raises rather than let the resumed run reduce in another order unnoticed."""
    original = getattr(dist, BUCKET_ASSIGNMENT, None)
    if original is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.distributed.{BUCKET_ASSIGNMENT}, which "
                           f"mgpu.parallel.ddp answers to give a resumed DDP its saved gradient buckets: mgpu needs updating "
                           f"for this torch")
    asked: list[bool] = []

    def saved(*args: Any, **kwargs: Any) -> tuple[list[list[int]], list[int]]:
        asked.append(True)
        return [list(b) for b in reversed(buckets)], list(reversed(limits))

    setattr(dist, BUCKET_ASSIGNMENT, saved)
    try:
        yield
    finally:
        setattr(dist, BUCKET_ASSIGNMENT, original)
    if not asked:
        raise RuntimeError(f"DDP's constructor (torch {torch.__version__}) did not ask torch.distributed."
                           f"{BUCKET_ASSIGNMENT} for its buckets: mgpu.parallel.ddp cannot give a resumed DDP its saved "
                           f"gradient buckets; mgpu needs updating for this torch")


@contextlib.contextmanager
def _quiet_powersgd() -> Iterator[None]:
    """PowerSGDState warns about its process group at every (un)pickling: a checkpoint is not a pickle."""
    logger = logging.getLogger("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _to_plain(value: Any) -> Any:
    """`value` as torch.load(weights_only=True) reads it: a numpy RandomState as its state in tensors."""
    if isinstance(value, np.random.RandomState):
        name, keys, pos, has_gauss, cached = value.get_state()
        return {"__numpy_random_state__": name, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return value


def _from_plain(value: Any) -> Any:
    if isinstance(value, dict) and "__numpy_random_state__" in value:
        rng = np.random.RandomState()
        rng.set_state((value["__numpy_random_state__"], value["keys"].numpy().astype(np.uint32), value["pos"],
                       value["has_gauss"], value["cached_gaussian"]))
        return rng
    return value


def wrap(model: nn.Module, device: torch.device, find_unused_parameters: bool = False, static_graph: bool = False,
         bucket_layout: dict[str, Any] | None = None) -> ResumableDDP:
    """`model` (already on `device`) in DDP, with the saved run's `bucket_layout` on a resume."""
    return ResumableDDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                        find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                        bucket_layout=bucket_layout)


def sync_buffers(module: nn.Module) -> None:
    """Rank 0's buffers on every rank (a collective), as DDP's next forward would make them.

    Between forwards each rank keeps its own BatchNorm statistics; an evaluation of the plain module
    would then see different statistics on each rank, and other ones after a resume (every rank loads
    rank 0's). Evaluating with rank 0's changes no training step: DDP broadcasts them at each forward."""
    for buffer in module.buffers():
        dist.broadcast(buffer, src=0)


def release_ddps(ddps: Iterable[weakref.ref[Any]]) -> None:
    """DDP's reducer must go while the group is alive: destroyed after it, its destructor joins a gloo
    thread that waits for the GIL the destructor holds (an intermittent hang at exit). Dropped here; a full
    garbage collection (0.2 s of CPU with torch loaded, seconds on a loaded node, in a stop's way to the
    exit) runs only where one outlives its last reference here: something else refers to it (a reference
    cycle would keep it past the teardown). Weak references tell, not reference counts (which differ between
    Python versions)."""
    held: list[Any] = []
    for ref in ddps:
        ddp = ref()
        if ddp is not None:
            held += [ddp.__dict__.pop("logger", None), ddp.__dict__.pop("reducer", None)]
    alive = [weakref.ref(obj) for obj in held if obj is not None]
    held.clear()  # the loggers first, then the reducers: destroyed now, while the group exists, unless held elsewhere
    if any(ref() is not None for ref in alive):
        gc.collect()


class SessionDDPs:
    """A session's DDPs (in wrap order) and their bucket layouts: saved beside the state under "ddp", given
    back to the resumed DDPs, whichever comes first, the wrap or the load. Weak references: a model the loop
    drops is not kept alive."""

    def __init__(self) -> None:
        self._ddps: list[weakref.ref[ResumableDDP]] = []
        self._layouts: list[dict[str, Any] | None] = []  # the checkpoint's, one per wrapped model

    def wrap(self, model: nn.Module, device: torch.device, find_unused_parameters: bool,
             static_graph: bool) -> ResumableDDP:
        """`model` (on `device`) in DDP; on a resume loaded already, with its saved buckets."""
        ddp = wrap(model, device, find_unused_parameters, static_graph)
        self._ddps.append(weakref.ref(ddp))
        self._resume(len(self._ddps) - 1)
        return ddp

    def resume(self, layouts: list[dict[str, Any] | None] | None) -> None:
        """The checkpoint's layouts (its "ddp" entry): the DDPs wrapped before the resume get theirs now."""
        self._layouts = list(layouts or [])
        for index in range(len(self._ddps)):
            self._resume(index)

    def _resume(self, index: int) -> None:
        ddp = self._ddps[index]()
        if ddp is not None and index < len(self._layouts) and self._layouts[index] is not None:
            ddp.resume_layout(self._layouts[index])  # type: ignore[arg-type]  # not None: checked above

    def live(self) -> list[ResumableDDP]:
        """The DDPs wrapped and still alive, in the order wrapped."""
        return [ddp for ref in self._ddps if (ddp := ref()) is not None]

    def gather(self, gather_state: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
        """*Collective.* `gather_state()` (the state on rank 0, None elsewhere) with every DDP's bucket layout
        (and comm hook state) under "ddp"."""
        layouts = [bucket_layout(ddp) if (ddp := ref()) is not None else None  # a collective, on every rank
                   for ref in self._ddps]
        state = gather_state()
        if state is not None and any(layout is not None for layout in layouts):
            state["ddp"] = layouts
        return state

    def release(self) -> None:
        """Drop the DDPs' reducers while the group is alive (`release_ddps`)."""
        release_ddps(self._ddps)
