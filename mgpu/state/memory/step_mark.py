"""The last step a rank completed, kept at every step's end so that a survivor can save it when a peer dies or hangs
during the next step (mgpu.state.memory.snapshots.MemorySnapshots.last_words).

Under DDP every rank holds the replicated state, and nothing of it changes between a step's end and the next step's
optimizer step except what is cheap to copy. So at every step's end (`Session.should_stop`) a rank *marks* the step
(`StepMarks.mark`): it copies the small objects of the loop's state (a scheduler's, a scaler's, the loader's and the
trainer's progress state_dicts, the loop's plain values: what the next step's batch fetch, forward or evaluation may
change) and notes that no optimizer has stepped since (a post-hook on each optimizer). The parameters and the
optimizers' states are not copied: they are the step's until an optimizer steps. Module buffers that a forward
changes (batch norm's statistics) are copied at the next step's first forward, right after DDP has broadcast rank
0's (`buffers_synced`): every rank then holds rank 0's of the marked step, which is what a checkpoint of it holds and
what a restarted rank 0 needs; rank 0 copies none there where its buffer record (mgpu.state.memory.buffer_record)
holds them from the mark, the very ones DDP broadcasts, and reads them back for a save. A rank's generators are
re-seeded at every step's end from (seed, rank, step) (mgpu.state.rng.seed_step): its RNG at the mark is derived, not
kept, for itself and for a rank that was lost.

`state()` is then the marked step's state as a memory snapshot holds it (mgpu.state.memory.content.rank_state), or
None with the reason: no mark yet, an optimizer stepped since (the failure came after this rank's optimizer step:
its parameters are no longer the mark's), a DDP comm hook (its state is per rank and gathering it is a collective).
`Shareable`: whether any rank can resume from it (its content is every rank's but for the derived RNG: no per-rank
object in the state) and whether its buffers are rank 0's (a restarted rank 0 may use it). Costs: microseconds a
step for the copies of small objects, one clone of the buffers a step where DDP syncs them (on the other ranks than 0;
rank 0's record instead), bench/failure_overhead.py.
"""

from __future__ import annotations

import copy
import logging
import pickle
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any, Callable, Mapping

__all__ = ["Shareable", "StepMarks"]

log = logging.getLogger("mgpu.train")


@dataclass(frozen=True)
class Shareable:
    """What another rank may take from a snapshot: `any_rank`, its content (all but the derived RNG) is every
    rank's; `rank0_buffers`, its module buffers are rank 0's (a restarted rank 0 resumes from it too)."""

    any_rank: bool
    rank0_buffers: bool


class StepMarks:
    """One rank's marks of its steps (see the module's docstring). `objects()`: the loop's state (the mapping given
    to `Session.load`); `ddps()`: the DDP modules the session wrapped (their buffers and bucket layouts)."""

    def __init__(self, objects: Callable[[], Mapping[str, Any]], ddps: Callable[[], list[Any]], rank: int,
                 world_size: int, seed: int, version: str | None) -> None:
        import torch

        self.objects, self.ddps, self.rank, self.world_size = objects, ddps, rank, world_size
        self.seed, self.version = seed, version
        self.step: int | None = None
        self.small: dict[str, Any] = {}
        self.stepped = False
        """An optimizer of the state stepped since the mark."""
        self.buffers: dict[int, dict[str, Any]] = {}
        """Per DDP (by id): its module's buffers as synced at the first forward after the mark."""
        self._hooks: list[Any] = []
        self._hooked: set[int] = set()
        self._ddps: list[Any] | None = None
        self._planned_record: Any = None
        self._plan: dict[str, tuple[Any, int, Any, list[tuple[str, Any, str]] | None]] = {}
        """Per object of the state: (the object, how it is copied, what is copied, its buffers for the record)."""
        self._pickled: dict[str, tuple[bytes, Any]] = {}
        """Per small object: its bytes at the last mark and the copy made of them."""
        self._field_names: dict[type, tuple[str, ...]] = {}
        self._not_plain: set[str] = set()
        """The small objects that were not plain data at a mark: pickled from then on without trying."""
        self._places: dict[int, list[tuple[str, Any, str]]] = {}
        self._optimizer_type = torch.optim.Optimizer
        self._module_type = torch.nn.Module
        from mgpu.state.train_state import unwrapped

        self._unwrapped = unwrapped
        self.lock: Any = None
        """Held while a survivor's save is said (mgpu.run.session_state.last_words: once, from either thread)."""
        self.said = False
        self.record: Any = None
        """Rank 0's: its buffers at every step's end (mgpu.state.memory.buffer_record.BufferRecord; None: not kept)."""
        self._recorded: int | None = None
        """The mark whose buffers `record` holds, written at the mark (rank 0 on a CPU): no copy at the forward."""

    def _hook_ddps(self, ddps: list[Any]) -> None:
        """A pre-hook on each DDP's module, once each (looked at again only when the DDPs or the record are others
        than at the last mark: this runs at every step); the plan made anew (an object's buffers may be a new DDP's)."""
        self._ddps, self._planned_record = ddps, self.record
        self._plan.clear()
        for ddp in ddps:
            if id(ddp) not in self._hooked:
                self._hooked.add(id(ddp))
                self._places[id(ddp)] = places = _buffer_places(ddp.module)
                if places:  # a model without buffers needs no copy
                    self._hooks.append(ddp.module.register_forward_pre_hook(self._synced(ddp, places)))

    def _planned(self, value: Any) -> tuple[Any, int, Any, list[tuple[str, Any, str]] | None]:
        """How an object of the state is copied at a mark (kept while the object is the same one: its kind does
        not change); a post-hook on an optimizer, once."""
        target = self._unwrapped(value)
        where = None
        if self.record is not None and self._ddps:
            where = next((self._places.get(id(ddp)) for ddp in self._ddps if ddp.module is target), None) or None
        if callable(getattr(value, "rank_state_dict", None)):
            return value, _RANK_STATE, value, where
        if isinstance(target, self._optimizer_type):
            if id(target) not in self._hooked:
                self._hooked.add(id(target))
                self._hooks.append(target.register_step_post_hook(self._optimizer_stepped))
            return value, _KEPT, target, where
        if isinstance(target, self._module_type):
            return value, _KEPT, target, where  # the step's own until an optimizer steps
        if hasattr(target, "state_dict"):
            return value, _STATE_DICT, target, where
        if is_dataclass(target) and not isinstance(target, type):
            return value, _FIELDS, target, where
        return value, _VALUE, value, where

    def _optimizer_stepped(self, *args: Any) -> None:
        self.stepped = True

    def _synced(self, ddp: Any, places: list[tuple[str, Any, str]]) -> Callable[..., None]:
        def take(module: Any, args: Any) -> None:
            # The inner module's first forward after the mark runs after DDP's buffer broadcast: rank 0's buffers
            # (rank 0's own, which its record holds already where it was written at the mark).
            if self.step is not None and id(ddp) not in self.buffers and self._recorded != self.step:
                # buffers need no detach: never in a graph
                self.buffers[id(ddp)] = {key: getattr(owner, attr).clone() for key, owner, attr in places}

        return take

    def mark(self, step: int) -> None:
        """Step `step` ended on this rank (every rank at the same step): copy what the next step may change."""
        objects, ddps = self.objects(), self.ddps()
        if ddps != self._ddps or self.record is not self._planned_record:
            self._hook_ddps(ddps)
        plan = self._plan
        if len(plan) > len(objects):  # an object gone from the state: not kept alive by its plan
            for name in [name for name in plan if name not in objects]:
                del plan[name]
        small: dict[str, Any] = {}
        own_buffers: dict[str, dict[str, Any]] = {}
        for name, value in objects.items():
            planned = plan.get(name)
            if planned is None or planned[0] is not value:
                planned = plan[name] = self._planned(value)
            _, how, target, where = planned
            if where:
                own_buffers[name] = {key: getattr(owner, attr) for key, owner, attr in where}
            if how == _KEPT:
                continue
            if how == _STATE_DICT:
                small[name] = self._copy(name, target.state_dict())
            elif how == _RANK_STATE:
                small[name] = {"rank_state": self._copy(name, target.rank_state_dict())}
            elif how == _FIELDS:
                small[name] = self._copy(name, _fields(target, self._field_names))
            else:
                small[name] = self._copy(name, value)
        self.step, self.small, self.stepped, self.buffers = step, small, False, {}
        if own_buffers:  # rank 0's, for a restart of rank 0 before the next broadcast, and for `state()`
            self._recorded = step if self.record.offer(step, own_buffers) else None

    def _copy(self, name: str, value: Any) -> Any:
        """A deep copy of `value` as it is now: pickled (C code: a state dict's copy took most of a mark's time with
        copy.deepcopy), and unpickled only where its bytes differ from the last mark's (the copy made then is kept:
        nothing changes it); copy.deepcopy where it does not pickle. Type-exact: 1, 1.0 and True pickle apart.
        Plain data (`_plain`: a loader's position, a scheduler's state) is copied as it is, in fewer calls."""
        if name not in self._not_plain:
            copied = _plain(value)
            if copied is not _NOT_PLAIN:
                return copied
            self._not_plain.add(name)
        try:
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001  # what pickle refuses (a lambda, a lock): deepcopy's rules, as before
            self._pickled.pop(name, None)
            return copy.deepcopy(value)
        kept = self._pickled.get(name)
        if kept is None or kept[0] != data:
            kept = self._pickled[name] = (data, pickle.loads(data))
        return kept[1]

    def state(self) -> tuple[dict[str, Any] | None, Shareable | None, str]:
        """(the marked step's state as a snapshot holds it, who may take it, ""), or (None, None, why not)."""
        from mgpu.parallel.ddp import bucket_layout
        from mgpu.state.memory.content import STEP, _local
        from mgpu.state.rng import step_rng_state
        from mgpu.state.train_state import FORMAT, unwrapped

        if self.step is None:
            return None, None, "no step has ended yet"
        if self.stepped:
            return None, None, f"an optimizer stepped after step {self.step} ended (its parameters are the next step's)"
        ddps = self.ddps()
        if any(getattr(ddp, "_comm_hooks", None) for ddp in ddps):
            return None, None, "a DDP comm hook's state is per rank (gathering it is a collective)"
        if any(getattr(value, "_applied", False) is True for value in self.objects().values()):
            return None, None, "an EMA's weights are in the model for an evaluation (mgpu.EMA.applied)"
        rng: list[Any] = [None] * self.world_size
        rng[self.rank] = step_rng_state(self.seed, self.rank, self.step)
        state: dict[str, Any] = {"format": FORMAT, "rng": rng, "world_size": self.world_size,
                                 "code_version": self.version, STEP: self.step}
        per_rank = False
        synced = {id(ddp.module): self.buffers.get(id(ddp)) for ddp in ddps}
        # Rank 0's buffers at the mark, read back from its record (what DDP broadcasts at the next forward).
        recorded = self.record.read(self.step) if self._recorded == self.step and self.record is not None else {}
        for name, value in self.objects().items():
            target = unwrapped(value)
            if name in self.small:
                saved = self.small[name]
                if isinstance(saved, dict) and "rank_state" in saved and len(saved) == 1:
                    per_rank = True
                    entries: list[Any] = [None] * self.world_size
                    entries[self.rank] = saved["rank_state"]
                    state[name] = {"per_rank": entries}
                else:
                    state[name] = saved
            elif isinstance(target, self._module_type):
                module_state = dict(_local(target.state_dict()))
                module_state.update(synced.get(id(target)) or recorded.get(name) or {})
                state[name] = module_state
            else:
                state[name] = _local(target.state_dict())
        layouts = [bucket_layout(ddp) for ddp in ddps]  # no collective without a comm hook
        if any(layout is not None for layout in layouts):
            state["ddp"] = layouts
        buffered = [ddp for ddp in ddps if self._places.get(id(ddp))]
        rank0 = self.rank == 0 or all(self.buffers.get(id(ddp)) is not None and getattr(ddp, "broadcast_buffers", True)
                                      for ddp in buffered)
        return state, Shareable(any_rank=not per_rank, rank0_buffers=rank0), ""

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._hooked.clear()
        self._ddps = None
        self._plan.clear()
        self._pickled.clear()
        self._not_plain.clear()


_KEPT, _STATE_DICT, _RANK_STATE, _FIELDS, _VALUE = range(5)
"""How a mark copies an object: not at all (a module, an optimizer), its state_dict, its rank_state_dict, its fields
(a dataclass), the object itself."""
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
"""Immutable: a copy may share them (their exact type: a subclass may be mutable)."""
_NOT_PLAIN = object()


def _plain(value: Any) -> Any:
    """A copy of `value` where it is plain data: an atom, a list, tuple or dict of atoms, or a dict whose values are
    those (keys atoms); `_NOT_PLAIN` where it is not. Exact: the atoms are shared, the containers new, of their
    exact type."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is dict:
        copied = {}
        for key, item in value.items():
            if type(key) not in _ATOMS:
                return _NOT_PLAIN
            if type(item) not in _ATOMS and (item := _flat(item)) is _NOT_PLAIN:
                return _NOT_PLAIN
            copied[key] = item
        return copied
    return _flat(value)


def _flat(value: Any) -> Any:
    """A copy of a list, tuple or dict of atoms (`_plain`'s inner level), else `_NOT_PLAIN`."""
    kind = type(value)
    if kind is list or kind is tuple:
        for item in value:
            if type(item) not in _ATOMS:
                return _NOT_PLAIN
        return list(value) if kind is list else value
    if kind is dict:
        for key, item in value.items():
            if type(key) not in _ATOMS or type(item) not in _ATOMS:
                return _NOT_PLAIN
        return dict(value)
    if kind in _ATOMS:
        return value
    return _NOT_PLAIN


def _fields(target: Any, names: dict[type, tuple[str, ...]]) -> dict[str, Any]:
    """A dataclass's fields as a dict, as `dataclasses.asdict` gives them (which deep-copies every value: the copy
    is `StepMarks._copy`'s); asdict itself where a field holds a dataclass (it makes that a dict too). `names`: the
    field names per dataclass, filled here (a class's fields do not change)."""
    kind = type(target)
    if (own := names.get(kind)) is None:
        own = names[kind] = tuple(field.name for field in fields(target))
    values = {name: getattr(target, name) for name in own}
    for value in values.values():
        if type(value) not in _ATOMS and is_dataclass(value):
            return asdict(target)
    return values


def _buffer_places(module: Any) -> list[tuple[str, Any, str]]:
    """A module's persistent buffers (what its state_dict, so a checkpoint, holds): (state_dict key, the submodule
    that owns it, its attribute name), read afresh at each copy (a buffer reassigned is still found)."""
    places = []
    for prefix, owner in module.named_modules():
        for attr, value in owner._buffers.items():
            if value is not None and attr not in owner._non_persistent_buffers_set:
                places.append((f"{prefix}.{attr}" if prefix else attr, owner, attr))
    return places
