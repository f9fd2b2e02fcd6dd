"""Typed YAML config: loading, overrides, one-line errors, saving, and resume compatibility."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mgpu.config.loading import (
    MISSING,
    Config,
    ConfigError,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    dump_config,
    grad_accum_for,
    load_config,
    save_config,
)
from mgpu.config.resume_compat import check_resume_compatible, diff_configs, is_safe_to_change
from mgpu.errors import MgpuError

ROOT = Path(__file__).resolve().parent.parent

FULL_YAML = """\
task:
  target: mypkg.tasks:ResNetTask
  args: {depth: 18, widths: [64, 128], name: resnet, lr_hint: 1e-3}
data: {batch_size: 64, eval_batch_size: 128, num_workers: 4, shuffle: false}
optim: {name: sgd, lr: 1e-1, weight_decay: 5e-4, betas: [0.8, 0.9], momentum: 0.95, zero: true}
schedule: {name: cosine, warmup_steps: 500, min_lr_ratio: 0.1}
train:
  epochs: 90
  max_steps: 100000
  grad_accum: 2
  clip_grad_norm: 1.0
  precision: bf16
  seed: 7
  sync_batchnorm: true
  find_unused_parameters: true
  static_graph: false
eval: {every_steps: 1000, metric: top1, mode: max, early_stopping_patience: 5, min_delta: 0.001}
checkpoint: {every_steps: 2000, keep_last: 3, keep_best: false, async_save: false}
log: {every_steps: 50, tensorboard: false, progress_bar: "off"}
run: {name: resnet18, root: /scratch/runs, dir: null}
distributed: {init_timeout_s: 600, backend: nccl}
preemption: {signal: SIGUSR2, check_every_steps: 10}
"""


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults() -> None:
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.task.target == "jobs.tasks.mnist:MnistTask" and cfg.task.args == {}
    assert cfg.optim.lr == 1e-3 and cfg.optim.betas == [0.9, 0.999]
    assert cfg.preemption.signal == "USR2" and cfg.train.max_steps is None
    assert Config().optim.betas is not Config().optim.betas  # no shared mutable defaults


def test_full_file_round_trips(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, FULL_YAML))
    assert cfg.task.args == {"depth": 18, "widths": [64, 128], "name": "resnet", "lr_hint": 1e-3}
    assert cfg.optim.lr == 0.1 and cfg.optim.weight_decay == 5e-4 and cfg.distributed.init_timeout_s == 600.0
    assert cfg.eval.mode == "max" and cfg.log.progress_bar == "off" and cfg.preemption.signal == "USR2"
    as_dict = config_to_dict(cfg)
    assert config_from_dict(as_dict) == cfg
    assert load_config(write(tmp_path, dump_config(cfg), "dumped.yaml")) == cfg


def test_empty_file_and_empty_section_give_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == Config()
    assert load_config(write(tmp_path, "train:\nlog:\n")) == Config()


@pytest.mark.parametrize("data, key, expected", [
    ({"optim": {"lr": "1e-3"}}, "optim.lr", 1e-3),  # what PyYAML's YAML 1.1 gives for `lr: 1e-3`
    ({"optim": {"lr": 2}}, "optim.lr", 2.0),
    ({"optim": {"betas": [0, "0.95"]}}, "optim.betas", [0.0, 0.95]),
    ({"train": {"clip_grad_norm": None}}, "train.clip_grad_norm", None),
    ({"preemption": {"signal": "sigurg"}}, "preemption.signal", "URG"),
    ({"preemption": {"signal": "HUP"}}, "preemption.signal", "HUP"),
])
def test_values_are_converted(data: dict[str, Any], key: str, expected: Any) -> None:
    section, name = key.split(".")
    value = getattr(getattr(config_from_dict(data), section), name)
    assert value == expected and type(value) is type(expected)


def test_exponent_floats_load_as_floats(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "optim:\n  lr: 1e-3\ntask:\n  args: {eps: 1e-8, tag: '1e-8'}\n"))
    assert cfg.optim.lr == 1e-3
    assert cfg.task.args == {"eps": 1e-8, "tag": "1e-8"}
    assert load_config(write(tmp_path, dump_config(cfg), "again.yaml")).task.args["tag"] == "1e-8"


@pytest.mark.parametrize("override, key, expected", [
    ("optim.lr=3e-4", "optim.lr", 3e-4),
    ("train.epochs=5", "train.epochs", 5),
    ("train.max_steps=null", "train.max_steps", None),
    ("train.max_steps=100", "train.max_steps", 100),
    ("optim.betas=[0.9,0.95]", "optim.betas", [0.9, 0.95]),
    ("data.shuffle=false", "data.shuffle", False),
    ("train.precision=fp16", "train.precision", "fp16"),
    ("run.name='2024'", "run.name", "2024"),
    ("run.dir=/tmp/a=b", "run.dir", "/tmp/a=b"),
    ("task.target=pkg.mod:Task", "task.target", "pkg.mod:Task"),
])
def test_overrides(tmp_path: Path, override: str, expected: Any, key: str) -> None:
    path = write(tmp_path, "train:\n  max_steps: 50\n")
    section, name = key.split(".")
    assert getattr(getattr(load_config(path, [override]), section), name) == expected


def test_overrides_of_free_form_task_args() -> None:
    cfg = load_config(None, ["task.args.n=5", "task.args.model.depth=3", "task.args.lr=1e-4"])
    assert cfg.task.args == {"n": 5, "model": {"depth": 3}, "lr": 1e-4}


def test_apply_overrides_leaves_its_input_alone() -> None:
    data = {"train": {"epochs": 1}}
    assert apply_overrides(data, ["train.epochs=2", "optim.lr=0.1"]) == {"train": {"epochs": 2}, "optim": {"lr": 0.1}}
    assert data == {"train": {"epochs": 1}}


def test_later_overrides_win() -> None:
    assert load_config(None, ["train.epochs=2", "train.epochs=3"]).train.epochs == 3


BAD_OVERRIDES = [
    ("train.learning_rate=0.1", "train.learning_rate", "did you mean 'optim.lr'?"),
    ("train.epoch=3", "train.epoch", "did you mean 'train.epochs'?"),
    ("train.batch_size=8", "train.batch_size", "did you mean 'data.batch_size'?"),
    ("train.xyzzy=1", "train.xyzzy", "unknown key"),
    ("trian.epochs=3", "trian", "unknown section (did you mean 'train'?)"),
    ("optim.lr=abc", "optim.lr", "expected float, got 'abc'"),
    ("optim.lr=nan", "optim.lr", "expected float"),
    ("optim.lr=.inf", "optim.lr", "expected float"),
    ("optim.lr=true", "optim.lr", "expected float, got True"),
    ("data.batch_size=2.5", "data.batch_size", "expected int, got 2.5"),
    ("data.batch_size='8'", "data.batch_size", "expected int, got '8'"),
    ("data.batch_size=true", "data.batch_size", "expected int, got True"),
    ("data.shuffle=1", "data.shuffle", "expected bool, got 1"),
    ("run.name=2024", "run.name", "expected str, got 2024"),
    ("optim.betas=0.9", "optim.betas", "expected a list"),
    ("optim.betas=[0.9]", "optim.betas", "must be 2 numbers in [0, 1)"),
    ("optim.betas=[0.9,1.0]", "optim.betas", "must be 2 numbers in [0, 1)"),
    ("optim.betas=[0.9,x]", "optim.betas[1]", "expected float, got 'x'"),
    ("task.args=[1,2]", "task.args", "expected a mapping"),
    ("eval.mode=minimum", "eval.mode", "expected one of 'min', 'max', got 'minimum'"),
    ("optim.name=lamb", "optim.name", "expected one of 'adam', 'adamw', 'sgd'"),
    ("train.max_steps=x", "train.max_steps", "expected int or null"),
    ("data.batch_size=-4", "data.batch_size", "must be >= 1, got -4"),
    ("train.grad_accum=0", "train.grad_accum", "must be >= 1"),
    ("train.epochs=0", "train.epochs", "must be >= 1"),
    ("train.max_steps=0", "train.max_steps", "must be >= 1"),
    ("optim.lr=0", "optim.lr", "must be > 0"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last", "must be >= 1"),
    ("eval.every_steps=-1", "eval.every_steps", "must be >= 0"),
    ("data.num_workers=-1", "data.num_workers", "must be >= 0"),
    ("preemption.check_every_steps=0", "preemption.check_every_steps", "must be >= 1"),
    ("task.target=jobs.tasks.mnist.MnistTask", "task.target", "package.module:ClassName"),
    ("task.target=jobs/tasks:Mnist", "task.target", "package.module:ClassName"),
    ("preemption.signal=USR1", "preemption.signal", "NCCL"),
    ("preemption.signal=SIGKILL", "preemption.signal", "cannot be caught"),
    ("preemption.signal=STOP", "preemption.signal", "cannot be caught"),
    ("preemption.signal=NOPE", "preemption.signal", "not a signal name"),
    ("train=5", "train", "expected a mapping"),
    ("train.epochs", "train.epochs", "expected dotted.key=value"),
    ("train..epochs=1", "train..epochs", "expected dotted.key=value"),
    ("optim.betas=[0.9,", "optim.betas", "invalid YAML"),
    # run.name is a directory name (and the default Slurm job name): nothing that leaves or breaks the line
    ("run.name=a/b", "run.name", "must be a directory name"),
    ("run.name=..", "run.name", "not starting with '.'"),
    ("run.name=.hidden", "run.name", "must be a directory name"),
    ("run.name=-rf", "run.name", "not starting with '.' or '-'"),
    ("run.name='a b'", "run.name", "whitespace"),
    ("run.name='a\tb'", "run.name", "control characters"),
    (r'run.name="a\ntouch x"', "run.name", "must be a directory name"),  # YAML's escape: a real newline
    (r'run.name="a\u2028b"', "run.name", "must be a directory name"),
    ("run.name=a\\b", "run.name", "must be a directory name"),
    ("run.name=" + "x" * 201, "run.name", "1-200 characters"),
    ("run.name=''", "run.name", "must be a directory name"),
    (r'run.root="/tmp/a\nb"', "run.root", "control characters"),
    (r'run.dir="/tmp/a\rb"', "run.dir", "control characters"),
    ("run.root=''", "run.root", "must not be empty"),
    ("distributed.init_timeout_s=1e300", "distributed.init_timeout_s", "must be in (0, 604800]"),
    ("distributed.init_timeout_s=604801", "distributed.init_timeout_s", "must be in (0, 604800]"),
    ("distributed.init_timeout_s=0", "distributed.init_timeout_s", "must be in (0, 604800]"),
    ("train.epochs=" + "9" * 30, "train.epochs", "must fit in 64 bits"),
    ("train.max_steps=-" + "9" * 30, "train.max_steps", "must fit in 64 bits"),
    ("task.args.n=" + "9" * 5000, "task.args.n", "Exceeds the limit (4300 digits)"),
    ("task.args.x=" + "[" * 3000 + "]" * 3000, "task.args.x", "nested too deeply"),
    ("run.name=2024-13-01", "run.name", "invalid YAML value: month must be in 1..12"),
    ("data.batch_size=1e999", "data.batch_size", "expected int, got inf"),
    ("optim.lr=1e999", "optim.lr", "expected float"),
    # issue 46: 100000 (or 2**63 - 1) DataLoader workers forked until the machine ran out of memory and processes
    ("data.num_workers=100000", "data.num_workers", "must be at most 1024 (DataLoader workers per rank)"),
    ("data.num_workers=9223372036854775807", "data.num_workers", "must be at most 1024"),
]


@pytest.mark.parametrize("override, path, message", BAD_OVERRIDES)
def test_bad_overrides_fail_in_one_line(override: str, path: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    text = str(info.value)
    assert "\n" not in text and path in text and message in text, text
    assert len(text) < 400, text  # a 5000-character override is shown cut
    assert isinstance(info.value, MgpuError)


@pytest.mark.parametrize("global_batch, batch, world, accum", [
    (None, 4, 3, 1),  # unset: train.grad_accum (1 by default) on any world size
    (64, 8, 8, 1), (64, 8, 4, 2), (64, 8, 2, 4), (64, 8, 1, 8),  # halving the ranks doubles the accumulation
    (48, 4, 3, 4), (48, 4, 12, 1),  # a world size that is not a power of two
])
def test_the_accumulation_is_derived_from_the_global_batch(global_batch: int | None, batch: int, world: int,
                                                          accum: int) -> None:
    cfg = load_config(None, [f"data.global_batch_size={'null' if global_batch is None else global_batch}",
                             f"data.batch_size={batch}"])
    assert grad_accum_for(cfg, world) == accum
    if global_batch is not None:  # the global batch is the same on every world size that divides it
        assert batch * world * accum == global_batch
    assert grad_accum_for(load_config(None, ["train.grad_accum=3"]), world) == 3  # unset: the configured one


@pytest.mark.parametrize("overrides, world, message", [
    (["data.global_batch_size=64", "data.batch_size=8"], 3,
     "data.global_batch_size=64 is not data.batch_size=8 x 3 ranks x a whole accumulation: run on a number of "
     "ranks that divides 8, or change data.batch_size"),
    (["data.global_batch_size=64", "data.batch_size=8"], 16, "run on a number of ranks that divides 8"),  # < 1 step
    (["data.global_batch_size=64", "data.batch_size=8", "train.static_graph=true"], 4,
     "train.static_graph: true with an accumulation of 2 (data.global_batch_size=64 on 4 ranks)"),
])
def test_a_global_batch_the_world_does_not_divide_is_one_line(overrides: list[str], world: int, message: str) -> None:
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as info:
        grad_accum_for(cfg, world)
    assert "\n" not in str(info.value) and message in str(info.value), str(info.value)


@pytest.mark.parametrize("overrides, message", [
    (["data.global_batch_size=64", "train.grad_accum=2"],
     "data.global_batch_size=64 with train.grad_accum=2: the accumulation is derived from the global batch and the "
     "world size; set one of them"),
    (["data.global_batch_size=60", "data.batch_size=8"],
     "data.global_batch_size=60 is not a multiple of data.batch_size=8"),
    (["data.global_batch_size=0"], "data.global_batch_size: must be >= 1, got 0"),
])
def test_a_global_batch_no_world_fits_is_refused_at_load(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


@pytest.mark.parametrize("text, message", [
    ("train:\n  learning_rate: 0.1\n", "train.learning_rate: unknown key (did you mean 'optim.lr'?)"),
    ("trian:\n  epochs: 3\n", "trian: unknown section (did you mean 'train'?)"),
    ("optim:\n  lr: abc\n", "optim.lr: expected float, got 'abc'"),
    ("train:\n  epochs: [1\n", "cfg.yaml:3: invalid YAML"),
    ("train:\n  epochs: 2\n   seed: 1\n", "cfg.yaml:3: invalid YAML"),
    ("train:\n  epochs: 2\ntrain:\n  seed: 1\n", "cfg.yaml:3: invalid YAML: duplicate key 'train'"),
    ("- train\n- optim\n", "top level must be a mapping of sections"),
    ("just a string\n", "top level must be a mapping of sections"),
])
def test_bad_files_fail_in_one_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert "\n" not in str(info.value) and message in str(info.value), str(info.value)


LAUGHS = "task:\n  args:\n    a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"    {b}: &{b} [{', '.join([f'*{a}'] * 10)}]\n" for a, b in zip("abcdefg", "bcdefgh"))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("content, message", [
    (LAUGHS, "more than 100000 values"),  # 10**8 once expanded: would hang in dataclasses.asdict
    ("task:\n  args:\n    a: &a [*a]\n", "refers to itself"),
    ("task:\n  args:\n    x: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),
    ("run:\n  name: 2024-13-01\n", "month must be in 1..12"),
    ("task:\n  args:\n    blob: '" + "x" * (1 << 20) + "'\n", "larger than 1 MiB"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "cannot be read"),  # binary: not UTF-8
    ("train:\n  epochs: 1\x00\n", "invalid YAML"),  # UTF-8 but a NUL byte
])
def test_hostile_files_fail_in_one_line(tmp_path: Path, content: str | bytes, message: str) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert "\n" not in text and message in text and len(text) < 400, text


def test_paths_that_are_no_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read: .*Is a directory"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="larger than 1 MiB"):
        load_config("/dev/zero")  # endless: read in bounded time all the same
    with pytest.raises(ConfigError, match="the path contains a newline; rename the file"):
        load_config(tmp_path / "a\nb.yaml")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^config file '.*nope\.yaml' not found$"):
        load_config(tmp_path / "nope.yaml")


def test_config_from_dict_rejects_a_non_mapping() -> None:
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        config_from_dict([1, 2])  # type: ignore[arg-type]


def test_save_config_is_atomic_and_reads_back(tmp_path: Path) -> None:
    cfg = load_config(None, ["optim.lr=3e-4", "task.args.n=5", "task.args.label=a b"])
    target = tmp_path / "run" / "config.yaml"
    target.parent.mkdir()
    target.write_text("old: contents\n")
    assert save_config(cfg, target) == target
    assert load_config(target) == cfg
    assert sorted(p.name for p in target.parent.iterdir()) == ["config.yaml"]  # no temporary left behind
    assert (target.stat().st_mode & 0o777) == 0o644


def test_save_config_leaves_the_old_file_when_writing_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "config.yaml"
    save_config(Config(), target)
    before = target.read_text()

    def fail(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError):
        save_config(load_config(None, ["train.epochs=9"]), target)
    assert target.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_diff_configs_flattens_nested_keys() -> None:
    old = config_to_dict(load_config(None, ["task.args.n=1", "task.args.m.k=2"]))
    new = config_to_dict(load_config(None, ["task.args.n=1", "task.args.m.k=3", "task.args.x=0", "optim.lr=0.5"]))
    assert diff_configs(old, new) == [("task.args.m.k", 2, 3), ("optim.lr", 0.001, 0.5), ("task.args.x", MISSING, 0)]
    assert diff_configs(old, old) == []
    assert diff_configs({"a": {"b": True}}, {"a": {"b": 1}}) == [("a.b", True, 1)]


def test_safe_to_change_patterns() -> None:
    assert is_safe_to_change("log.every_steps") and is_safe_to_change("run.dir")
    assert is_safe_to_change("train.epochs") and is_safe_to_change("preemption.signal")
    assert not is_safe_to_change("train.seed") and not is_safe_to_change("task.args.n")
    assert is_safe_to_change("optim.lr") and is_safe_to_change("optim.weight_decay")  # applied on resume, recorded
    assert not is_safe_to_change("optim.momentum") and not is_safe_to_change("data.batch_size")


def test_resume_with_safe_changes_returns_lines() -> None:
    saved = config_to_dict(load_config(None, ["train.epochs=3"]))
    current = load_config(None, ["train.epochs=5", "log.every_steps=1", "run.dir=/scratch/r", "data.num_workers=8"])
    assert check_resume_compatible(saved, config_to_dict(current)) == [
        "data.num_workers: 0 -> 8", "train.epochs: 3 -> 5", "log.every_steps: 10 -> 1", "run.dir: null -> '/scratch/r'",
    ]
    assert check_resume_compatible(saved, saved) == []


def test_resume_compares_canonical_values() -> None:
    saved = {"optim": {"lr": "1e-3"}, "preemption": {"signal": "SIGUSR2"}}  # defaults, written differently
    assert check_resume_compatible(saved, Config()) == []


@pytest.mark.parametrize("overrides, listed", [
    (["optim.momentum=0.5", "data.batch_size=64", "train.epochs=9", "optim.lr=0.002"],
     "data.batch_size (32 -> 64), optim.momentum (0.9 -> 0.5);"),  # in the config's section order; lr may change
    (["task.args.n=6"], "task.args.n (5 -> 6);"),
    (["task.args.extra=1"], "task.args.extra (<missing> -> 1);"),
    (["train.seed=1", "train.grad_accum=2", "train.precision=fp32", "schedule.name=cosine"],
     "schedule.name ('constant' -> 'cosine'), train.grad_accum (1 -> 2), train.precision ('auto' -> 'fp32'), "
     "train.seed (0 -> 1);"),
])
def test_resume_with_unsafe_changes_fails_in_one_line(overrides: list[str], listed: str) -> None:
    saved = config_to_dict(load_config(None, ["task.args.n=5"]))
    current = config_to_dict(load_config(None, ["task.args.n=5", *overrides]))
    with pytest.raises(ConfigError) as info:
        check_resume_compatible(saved, current)
    text = str(info.value)
    assert "\n" not in text and "train.epochs" not in text
    assert text.startswith("config differs from the checkpoint's in keys that change the run: " + listed), text
    assert text.endswith("restore them, or start a new run (run.name=...)")


def test_importing_config_does_not_import_torch() -> None:
    code = "import mgpu.config.loading, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_fsdp_with_single_file_checkpoints_is_refused_at_load() -> None:
    """A single-file checkpoint cannot hold a sharded model: refused with the config, not at the first save."""
    with pytest.raises(ConfigError, match=re.escape("train.parallel=fsdp with checkpoint.format=single: a single-file "
                                                    "checkpoint cannot hold a sharded model; set checkpoint.format=auto")):
        load_config(None, ["train.parallel=fsdp", "checkpoint.format=single"])
    assert load_config(None, ["train.parallel=fsdp", "checkpoint.format=sharded"]).checkpoint.format == "sharded"


def test_the_saved_runs_global_batch_may_be_kept_on_another_world_size() -> None:
    """The resume's advice after a world-size change (data.global_batch_size = the saved run's global batch) can be
    followed: that key set from null to batch x saved ranks x accumulation (train.grad_accum then 1) is accepted;
    another value, or a changed per-rank batch, is refused naming the value to set."""
    saved = config_to_dict(load_config(None, ["data.batch_size=8", "train.grad_accum=2"]))
    kept = config_to_dict(load_config(None, ["data.batch_size=8", "data.global_batch_size=32"]))
    assert check_resume_compatible(saved, kept, saved_world=2) == [
        "data.global_batch_size: null -> 32", "train.grad_accum: 2 -> 1"]
    assert check_resume_compatible(saved, kept) != []  # before the job knows the saved world: a whole multiple passes
    with pytest.raises(ConfigError, match=re.escape(
            "keys that change the run: data.global_batch_size (null -> 32), train.grad_accum (2 -> 1); restore them, "
            "or start a new run (run.name=...) (to keep the saved run's global batch on another world size: "
            "data.global_batch_size=64)")):
        check_resume_compatible(saved, kept, saved_world=4)
    halved = config_to_dict(load_config(None, ["data.batch_size=4", "data.global_batch_size=32"]))
    with pytest.raises(ConfigError, match=r"data.batch_size \(8 -> 4\)"):
        check_resume_compatible(saved, halved, saved_world=2)
