"""Whether a resumed run may use the current config: the config saved with a checkpoint against the one now given.

`check_resume_compatible(saved, current)` returns a line per safe change (`train.epochs: 3 -> 5`) and raises
`ConfigError` naming every key a resume may not change (the keys outside `SAFE_TO_CHANGE`), so a resumed run cannot
silently change what it optimises; the one exception: `data.global_batch_size` set to the global batch the saved
run trained with (`_kept_global_batch`). `diff_configs` and `is_safe_to_change` are its parts. No torch.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any, Mapping

from mgpu.config.loading import MISSING, ConfigError, config_from_dict, config_to_dict, flatten_config
from mgpu.config.schema import SAFE_TO_CHANGE, Config

__all__ = ["check_resume_compatible", "diff_configs", "is_safe_to_change"]


def diff_configs(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """`(dotted key, old value, new value)` for every leaf that differs; MISSING where one side lacks it."""
    flat_old, flat_new = flatten_config(old), flatten_config(new)
    keys = list(flat_old) + [key for key in flat_new if key not in flat_old]
    changes = []
    for key in keys:
        a, b = flat_old.get(key, MISSING), flat_new.get(key, MISSING)
        if type(a) is not type(b) or a != b:  # True == 1 == 1.0, yet changing one to another is a change
            changes.append((key, a, b))
    return changes


def is_safe_to_change(key: str) -> bool:
    """Whether the dotted `key` may differ between a checkpoint's config and the run resuming it."""
    return any(fnmatchcase(key, pattern) for pattern in SAFE_TO_CHANGE)


def _fmt(value: Any) -> str:
    if value is None or isinstance(value, bool):
        text = {None: "null", True: "true", False: "false"}[value]
    else:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _normalized(data: Mapping[str, Any] | Config) -> dict[str, Any]:
    if isinstance(data, Config):
        return config_to_dict(data)
    try:  # fills defaults and canonical forms ('1e-3' -> 0.001), so that only real changes show
        return config_to_dict(config_from_dict(data))
    except ConfigError:  # e.g. a checkpoint from an older schema: compare as saved
        return dict(data)


def _kept_global_batch(saved: Mapping[str, Any], current: Mapping[str, Any], saved_world: int | None) -> int | None:
    """The global batch a run saved without data.global_batch_size trained with (data.batch_size x its ranks x
    train.grad_accum), when `current` sets data.global_batch_size to it (train.grad_accum then 1, data.batch_size
    the same): the steps stay the run's, only their split into micro-steps changes (what a resume on another
    world size advises). Without `saved_world` (before the job knows it) any whole multiple of the saved per-rank
    step passes here; the job checks the exact value. None: not such a change."""
    old, new = saved.get("data") or {}, current.get("data") or {}
    glob, batch = new.get("global_batch_size"), new.get("batch_size")
    accum = (saved.get("train") or {}).get("grad_accum", 1)
    if old.get("global_batch_size") is not None or glob is None or old.get("batch_size") != batch:
        return None
    if not (isinstance(batch, int) and isinstance(accum, int) and batch > 0 and accum > 0) or glob % (batch * accum):
        return None
    kept = batch * accum * saved_world if saved_world else glob
    return kept if kept == glob else None


def check_resume_compatible(saved: Mapping[str, Any] | Config, current: Mapping[str, Any] | Config,
                            saved_world: int | None = None) -> list[str]:
    """Lines like `train.epochs: 3 -> 5` for the safe changes; ConfigError listing every unsafe one. `saved_world`:
    the checkpoint's world size, which data.global_batch_size set on resume must match (see _kept_global_batch)."""
    old, new = _normalized(saved), _normalized(current)
    changes = diff_configs(old, new)
    kept = _kept_global_batch(old, new, saved_world)
    fixed = {"data.global_batch_size", "train.grad_accum"} if kept is not None else set()
    unsafe = [f"{key} ({_fmt(a)} -> {_fmt(b)})" for key, a, b in changes
              if not is_safe_to_change(key) and key not in fixed]
    if unsafe:
        hint = ""
        old_data, old_train = old.get("data") or {}, old.get("train") or {}
        if (saved_world and any(key == "data.global_batch_size" for key, _, _ in changes)
                and old_data.get("global_batch_size") is None and isinstance(old_data.get("batch_size"), int)):
            was = old_data["batch_size"] * old_train.get("grad_accum", 1) * saved_world
            hint = f" (to keep the saved run's global batch on another world size: data.global_batch_size={was})"
        raise ConfigError(f"config differs from the checkpoint's in keys that change the run: {', '.join(unsafe)}; "
                          f"restore them, or start a new run (run.name=...){hint}")
    return [f"{key}: {_fmt(a)} -> {_fmt(b)}" for key, a, b in changes]
