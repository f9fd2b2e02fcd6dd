"""The run's settings: typed dataclasses read from a YAML file plus `dotted.key=value` overrides.

`load_config("cfg.yaml", ["optim.lr=3e-4"])` returns a validated `Config`. Any mistake (unknown key,
wrong type, out-of-range value) fails at submission time with one line naming the dotted key, not
minutes later on a compute node. Whether a resume may use the current config is `mgpu.config.resume_compat`'s.
Nothing here imports torch: the submission path must start fast.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import re
import signal
import types
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence, Union, get_args, get_origin, get_type_hints

import yaml

from mgpu.config.schema import (SAFE_TO_CHANGE, CheckpointConfig, Config, DataConfig, DistributedConfig,
                                EvalConfig, LogConfig, OptimConfig, PreemptionConfig, RunConfig, ScheduleConfig,
                                StragglersConfig, TaskConfig, TrainConfig, WatchdogConfig)
from mgpu.errors import MgpuError
from mgpu.fsutil import read_bounded, write_atomic

__all__ = [
    "CONTROL", "MISSING", "SAFE_TO_CHANGE", "CheckpointConfig", "Config", "ConfigError", "DataConfig",
    "DistributedConfig", "EvalConfig", "LogConfig", "OptimConfig", "PreemptionConfig", "RunConfig",
    "ScheduleConfig", "StragglersConfig", "TaskConfig", "TrainConfig", "WatchdogConfig", "apply_overrides",
    "config_from_dict", "config_to_dict", "control_problem", "dump_config", "flatten_config", "grad_accum_for",
    "load_config", "save_config",
]


class ConfigError(MgpuError):
    """A config file or override that cannot be used; the message names the dotted key."""


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()
"""Stands for a value that is not there: a key one side of `resume_compat.diff_configs` lacks, a value `_scalar`
refuses."""

# PyYAML follows YAML 1.1, where `1e-3` (no dot) is a string; YAML 1.2 and every user read it as a float.
_EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$")


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-3` as a float and rejects duplicate keys (YAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key '{key_node.value}'", key_node.start_mark)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes strings like '1e-3', which `_Loader` would read back as floats."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT, list("-+.0123456789"))

_TARGET = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
_ALIASES = {
    "learning_rate": "optim.lr", "lr": "optim.lr", "wd": "optim.weight_decay", "optimizer": "optim.name",
    "scheduler": "schedule.name", "warmup": "schedule.warmup_steps", "bs": "data.batch_size",
    "workers": "data.num_workers", "max_epochs": "train.epochs", "num_epochs": "train.epochs",
    "gradient_accumulation_steps": "train.grad_accum", "accumulate_grad_batches": "train.grad_accum",
    "max_grad_norm": "train.clip_grad_norm", "grad_clip": "train.clip_grad_norm", "patience":
    "eval.early_stopping_patience", "amp": "train.precision", "mixed_precision": "train.precision",
}
_UNUSABLE_SIGNALS = {
    "USR1": "NCCL uses SIGUSR1 itself", "KILL": "SIGKILL cannot be caught", "STOP": "SIGSTOP cannot be caught",
    "TERM": "Slurm sends SIGTERM itself on scancel and preemption", "CHLD": "every exiting child process sends it",
    **dict.fromkeys(("SEGV", "BUS", "FPE", "ILL", "ABRT"), "it reports a crash"),
}


def _ge(low: float) -> Callable[[Any], str | None]:
    return lambda v: None if v >= low else f"must be >= {low}"


def _gt(low: float) -> Callable[[Any], str | None]:
    return lambda v: None if v > low else f"must be > {low}"


def _between(low: float, high: float, high_ok: bool) -> Callable[[Any], str | None]:
    bracket = "]" if high_ok else ")"
    return lambda v: None if low <= v <= high and (high_ok or v < high) else f"must be in [{low}, {high}{bracket}"


# Control characters (C0, DEL, C1), Unicode line/paragraph separators and lone surrogates (undecodable
# argv bytes): a newline in a value that reaches a shell or #SBATCH line ends that line.
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
# A directory name: not '.', '..' or hidden, no option-like leading '-', no separator, whitespace or control.
_RUN_NAME = re.compile(r"(?![.-])[^\s/\\\x00-\x1f\x7f-\x9f\ud800-\udfff]{1,200}")
MAX_INIT_TIMEOUT_S = 7 * 24 * 3600
MAX_WORKERS = 1024  # DataLoader workers per rank: no machine runs more (a rank's own cap: mgpu.data.loader.worker_cap)
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_VALUES = 100_000
_INT64 = 1 << 63


def control_problem(value: str) -> str | None:
    """What is wrong with `value` on one shell or #SBATCH line ('contains a newline', ...), or None."""
    found = CONTROL.search(value)
    if found is None:
        return None
    char = found.group()
    if "\ud800" <= char <= "\udfff":
        return "contains a byte that is not UTF-8"
    return "contains a newline" if char in "\n\r\u2028\u2029" else f"contains a control character ({char!r})"


def _path_rule(v: str) -> str | None:
    problem = control_problem(v)
    return f"must be one line without control characters ({problem})" if problem else None


_RULES: dict[str, Callable[[Any], str | None]] = {
    "task.target": lambda v: None if _TARGET.fullmatch(v) else "must look like 'package.module:ClassName'",
    "data.batch_size": _ge(1), "data.global_batch_size": _ge(1), "data.eval_batch_size": _ge(1),
    "data.num_workers": lambda v: _ge(0)(v) or (None if v <= MAX_WORKERS else
                                                f"must be at most {MAX_WORKERS} (DataLoader workers per rank)"),
    "optim.lr": _gt(0), "optim.weight_decay": _ge(0), "optim.momentum": _ge(0),
    "optim.betas": lambda v: None if len(v) == 2 and all(0 <= b < 1 for b in v) else "must be 2 numbers in [0, 1)",
    "schedule.warmup_steps": _ge(0), "schedule.min_lr_ratio": _between(0, 1, True),
    "train.epochs": _ge(1), "train.max_steps": _ge(1), "train.grad_accum": _ge(1), "train.clip_grad_norm": _gt(0),
    "train.seed": _between(0, 2**32, False), "train.ema_decay": _between(0, 1, False),
    "eval.every_steps": _ge(0), "eval.early_stopping_patience": _ge(1),
    "eval.min_delta": _ge(0), "eval.metric": lambda v: None if v else "must not be empty",
    "checkpoint.every_steps": _ge(0), "checkpoint.memory_every_steps": _ge(0), "checkpoint.keep_last": _ge(1), "log.every_steps": _ge(0),
    "run.name": lambda v: None if _RUN_NAME.fullmatch(v) else (
        "must be a directory name: 1-200 characters, no '/', '\\', whitespace or control characters, "
        "not starting with '.' or '-'"),
    "run.root": lambda v: _path_rule(v) if v else "must not be empty", "run.dir": _path_rule,
    # timedelta overflows near 1e14 s; no rendezvous should wait longer than a week
    "distributed.init_timeout_s": lambda v: None if 0 < v <= MAX_INIT_TIMEOUT_S else (
        f"must be in (0, {MAX_INIT_TIMEOUT_S}]"),
    "preemption.check_every_steps": _ge(1), "preemption.deadline_margin_s": _between(0, 86_400, True),
    "preemption.slurm_poll_s": _between(1, 3600, True),
    "log.wandb_project": lambda v: None if _RUN_NAME.fullmatch(v) else "must be a wandb project name (no '/')",
    "watchdog.step_multiple": _between(2, 10_000, True), "watchdog.floor_s": _between(1, 86_400, True),
    "watchdog.first_step_s": _between(1, 604_800, True), "watchdog.checkpoint_s": _between(1, 604_800, True),
    "watchdog.eval_s": _between(1, 604_800, True),
    "watchdog.collective_timeout_s": _between(10, 604_800, True),
    "stragglers.margin": lambda v: None if 1 < v <= 100 else (
        "must be in (1, 100]: a factor over the other ranks' median"), "stragglers.hold_steps": _ge(1),
    "stragglers.hold_s": _between(0, 86_400, True),
}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _scalar(hint: Any, value: Any) -> Any:
    """`value` as a `hint` (bool, int, float or str), or MISSING if it is not one."""
    if hint is bool or isinstance(value, bool):
        return value if hint is bool and isinstance(value, bool) else MISSING
    if hint is float and isinstance(value, (int, float, str)):
        try:
            number = float(value)
        except (ValueError, OverflowError):
            return MISSING
        return number if math.isfinite(number) else MISSING
    return value if hint in (int, str) and isinstance(value, hint) else MISSING


def _coerce(path: str, hint: Any, value: Any) -> Any:
    """`value` checked against the type `hint` (numeric strings become floats); ConfigError naming `path` if not."""
    origin, args = get_origin(hint), get_args(hint)
    nullable = origin in (Union, types.UnionType)
    if nullable:
        if value is None:
            return None
        hint = next(arg for arg in args if arg is not type(None))
        origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        raise ConfigError(f"{path}: expected one of {', '.join(map(repr, args))}, got {value!r}")
    if origin is list and isinstance(value, (list, tuple)):
        return [_coerce(f"{path}[{i}]", args[0], item) for i, item in enumerate(value)]
    if origin is dict and isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
        return copy.deepcopy(dict(value))
    if origin is None and (converted := _scalar(hint, value)) is not MISSING:
        return converted
    expected = {list: "a list", dict: "a mapping with string keys"}.get(origin, getattr(hint, "__name__", str(hint)))
    quote = " (quote it)" if hint is str and isinstance(value, (int, float)) else ""
    raise ConfigError(f"{path}: expected {expected}{' or null' if nullable else ''}, got {value!r}{quote}")


def _signal_name(value: str) -> str:
    """`'SIGUSR2'`, `'usr2'` -> `'USR2'`; ConfigError for a name that is no signal or one that cannot serve."""
    name = value.strip().upper().removeprefix("SIG")
    if f"SIG{name}" not in signal.Signals.__members__:
        raise ConfigError(f"preemption.signal: {value!r} is not a signal name: use e.g. 'USR2' "
                          f"(as in sbatch --signal=B:USR2@120)")
    name = signal.Signals[f"SIG{name}"].name.removeprefix("SIG")  # aliases (IOT, CLD) -> canonical names
    if name in _UNUSABLE_SIGNALS:
        raise ConfigError(f"preemption.signal: cannot be {value!r} ({_UNUSABLE_SIGNALS[name]}): use e.g. 'USR2'")
    return name


def _suggest(key: str, section: str | None) -> str | None:
    """The dotted key (or section) the user most likely meant by `key`, found under `section`."""
    norm = key.lower().replace("-", "_")
    sections = _hints(Config)
    leaves: dict[str, str] = {}
    for name, cls in sections.items():
        for leaf in _hints(cls):
            leaves.setdefault(leaf, f"{name}.{leaf}")
    if norm in _ALIASES or norm in leaves:
        return _ALIASES.get(norm) or leaves[norm]
    local = list(sections) if section is None else list(_hints(sections[section]))
    if close := difflib.get_close_matches(norm, local, n=1):
        return close[0] if section is None else f"{section}.{close[0]}"
    close = difflib.get_close_matches(norm, list(leaves), n=1)
    return leaves[close[0]] if close else None


def _unknown(key: str, section: str | None) -> ConfigError:
    path, what = (key, "section") if section is None else (f"{section}.{key}", "key")
    known = list(_hints(Config)) if section is None else list(_hints(_hints(Config)[section]))
    guess = _suggest(key, section)
    hint = f"did you mean '{guess}'?" if guess else f"known: {', '.join(known)}"
    return ConfigError(f"{path}: unknown {what} ({hint})")


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """A validated Config from nested mappings (as read from YAML); missing keys keep their defaults."""
    sections = _hints(Config)
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: expected a mapping of sections ({', '.join(sections)}), got {data!r}")
    for name in data:
        if name not in sections:
            raise _unknown(str(name), None)
    built = {}
    for name, cls in sections.items():
        raw = data.get(name)
        if raw is None:  # `train:` with nothing under it
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{name}: expected a mapping of keys, got {raw!r}")
        hints, values = _hints(cls), {}
        for key, value in raw.items():
            if key not in hints:
                raise _unknown(str(key), name)
            path = f"{name}.{key}"
            value = _coerce(path, hints[key], value)
            if isinstance(value, int) and not isinstance(value, bool) and not -_INT64 <= value < _INT64:
                raise ConfigError(f"{path}: must fit in 64 bits (|value| < 2**63), got {value}")
            if path == "preemption.signal":
                value = _signal_name(value)
            problem = _RULES[path](value) if path in _RULES and value is not None else None
            if problem:
                raise ConfigError(f"{path}: {problem}, got {value!r}")
            values[key] = value
        built[name] = cls(**values)
    cfg = Config(**built)
    glob = cfg.data.global_batch_size
    if glob is not None and cfg.train.grad_accum != 1:
        raise ConfigError(f"data.global_batch_size={glob} with train.grad_accum={cfg.train.grad_accum}: the "
                          f"accumulation is derived from the global batch and the world size; set one of them")
    if glob is not None and glob % cfg.data.batch_size:
        raise ConfigError(f"data.global_batch_size={glob} is not a multiple of data.batch_size="
                          f"{cfg.data.batch_size}: choose a global batch of whole per-rank batches")
    if cfg.train.parallel == "fsdp" and cfg.checkpoint.format == "single":
        raise ConfigError("train.parallel=fsdp with checkpoint.format=single: a single-file checkpoint cannot hold "
                          "a sharded model; set checkpoint.format=auto (or sharded)")
    if cfg.train.static_graph and cfg.train.grad_accum > 1:
        # torch 2.13's reducer asserts (expect_autograd_hooks_) on a no_sync micro-step in the first step of a
        # static graph: pytorch/pytorch#143580. Refused here rather than crashing on the first step.
        raise ConfigError(f"train.static_graph: true with train.grad_accum={cfg.train.grad_accum} fails in torch's DDP "
                          "(pytorch issue 143580): set train.static_graph=false or train.grad_accum=1")
    return cfg


def grad_accum_for(cfg: Config, world_size: int) -> int:
    """Micro-steps per optimizer step on `world_size` ranks: train.grad_accum, or under data.global_batch_size
    the one that makes batch_size * world_size * accumulation equal it (ConfigError when it does not divide)."""
    glob, batch = cfg.data.global_batch_size, cfg.data.batch_size
    if glob is None:
        return cfg.train.grad_accum
    if glob % (batch * world_size):
        raise ConfigError(f"data.global_batch_size={glob} is not data.batch_size={batch} x {world_size} ranks x a "
                          f"whole accumulation: run on a number of ranks that divides {glob // batch}, or change "
                          f"data.batch_size")
    accum = glob // (batch * world_size)
    if cfg.train.static_graph and accum > 1:  # the refusal above, for an accumulation known only now
        raise ConfigError(f"train.static_graph: true with an accumulation of {accum} (data.global_batch_size={glob} "
                          f"on {world_size} ranks) fails in torch's DDP (pytorch issue 143580): set "
                          f"train.static_graph=false")
    return accum


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dicts, lists and scalars: YAML-serialisable, and `config_from_dict` gives `cfg` back."""
    return dataclasses.asdict(cfg)


def _check_size(data: Any, where: str) -> None:
    """ConfigError if `data` holds more than MAX_CONFIG_VALUES values with its aliases expanded (as
    `dataclasses.asdict` and every dump expand them: a 'billion laughs' would hang there), or refers to itself."""
    count, stack = 0, [data]
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise ConfigError(f"{where}: more than {MAX_CONFIG_VALUES} values (aliases expanded, or one refers "
                              f"to itself); a config holds settings, not data")
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)


def _parse_yaml(text: str, where: str, lines: bool = True) -> Any:
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line = f":{mark.line + 1}" if mark is not None and lines else ""
        raise ConfigError(" ".join(f"{where}{line}: invalid YAML: {error.problem or error.context}".split())) from None
    except yaml.YAMLError as error:
        raise ConfigError(" ".join(f"{where}: invalid YAML: {error}".split())) from None
    except RecursionError:  # PyYAML's composer recurses once per nesting level
        raise ConfigError(f"{where}: invalid YAML: nested too deeply") from None
    except ValueError as error:  # an integer of more than 4300 digits, a date like 2024-13-01
        reason = str(error).split(";")[0]  # not Python's advice to raise its digit limit
        raise ConfigError(" ".join(f"{where}: invalid YAML value: {reason}".split())) from None
    _check_size(data, where)
    return data


def _shown(text: str, limit: int = 80) -> str:
    """`repr(text)`, cut to about `limit` characters: an error line stays readable."""
    return repr(text) if len(text) <= limit else repr(text[:limit - 3]) + "..."


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `data` with each `dotted.key=value` set; values are YAML (`3e-4`, `null`, `[0.9, 0.95]`)."""
    result = copy.deepcopy(dict(data))
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ConfigError(f"override {_shown(item)}: expected dotted.key=value, e.g. train.epochs=3 or "
                              "optim.lr=3e-4")
        value = _parse_yaml(text, f"override {_shown(item)}", lines=False)
        node = result
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {_shown(item)}: {'.'.join(parts[:depth + 1])} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return result


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """The Config in the YAML file at `path` (None: the defaults) with `overrides` applied."""
    data: Any = {}
    if path is not None:
        if problem := control_problem(str(path)):
            raise ConfigError(f"config file {str(path)!r}: the path {problem}; rename the file")
        path = Path(path)
        try:
            raw, is_pipe = read_bounded(path, MAX_CONFIG_BYTES)
            if len(raw) > MAX_CONFIG_BYTES:
                raise ConfigError(f"config file '{path}': larger than {MAX_CONFIG_BYTES >> 20} MiB; a config "
                                  f"holds settings, pass data by path (e.g. in task.args)")
            if is_pipe and not raw:
                raise ConfigError(f"config file '{path}': a pipe with nothing to read (no writer); give a file")
            text = raw.decode("utf-8")
        except FileNotFoundError:
            where = "" if path.is_absolute() else f" (looked for {path.absolute()})"
            raise ConfigError(f"config file '{path}' not found{where}") from None
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"config file '{path}' cannot be read: {error}") from None
        data = _parse_yaml(text, str(path))
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{path}': the top level must be a mapping of sections "
                              f"(task:, data:, train:, ...), got a {type(data).__name__}")
    return config_from_dict(apply_overrides(data, overrides))


def dump_config(cfg: Config) -> str:
    """`cfg` as YAML text that `load_config` reads back unchanged."""
    return yaml.dump(config_to_dict(cfg), Dumper=_Dumper, sort_keys=False, allow_unicode=True)


def save_config(cfg: Config, path: str | Path) -> Path:
    """Write `cfg` as YAML to `path` atomically: readers see the old file or the new one, never a partial one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, dump_config(cfg).encode())
    return path


def flatten_config(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{'a': {'b': 1}}` -> `{'a.b': 1}`."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
