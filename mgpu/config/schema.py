"""The config's schema: one documented dataclass per section, and the keys that may change on resume.

Loading, validation and overrides live in `mgpu.config.loading`, which re-exports everything here.
Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "SAFE_TO_CHANGE", "CheckpointConfig", "Config", "DataConfig", "DistributedConfig", "EvalConfig", "LogConfig",
    "OptimConfig", "PreemptionConfig", "RunConfig", "ScheduleConfig", "StragglersConfig", "TaskConfig", "TrainConfig",
    "WatchdogConfig",
]


@dataclass
class TaskConfig:
    """What to train."""

    target: str = "jobs.tasks.mnist:MnistTask"
    """Import path `package.module:ClassName` of the Task to train."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the Task's constructor (free-form)."""


@dataclass
class DataConfig:
    """How batches are drawn."""

    batch_size: int = 32
    """Samples per rank per micro-step; the global batch is batch_size * world_size * train.grad_accum (or
    data.global_batch_size)."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all ranks, kept on any world size: the accumulation is derived
    (global_batch_size / (batch_size * world_size), which must divide; train.grad_accum stays 1), so a resume
    on fewer ranks accumulates more and trains on the same samples per step in the same order (null: the global
    batch follows the world size). A run saved with null may resume with it set to the global batch it trained
    with (data.batch_size x its ranks x train.grad_accum; train.grad_accum then 1): the same run on another world
    size."""
    eval_batch_size: int | None = None
    """Samples per rank per evaluation step (null: batch_size)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: load in the training process)."""
    worker_start_method: Literal["default", "fork", "spawn", "forkserver"] = "default"
    """How the workers start: `default` is Python's (fork on Linux before Python 3.14, or what the process set with
    multiprocessing.set_start_method); `forkserver` forks them from a clean server process, which rules out CPython
    gh-112275's hang of a forked worker (CPython 3.10 and 3.11 before 3.11.8) at the cost of a slower first start
    (docs/data.md); `spawn` starts each from a new interpreter (slowest). The dataset must be picklable for both."""
    shuffle: bool = True
    """Reshuffle the training set every epoch (the same order on every rank count for a given seed)."""


@dataclass
class OptimConfig:
    """The optimizer."""

    name: Literal["adam", "adamw", "sgd"] = "adamw"
    """Which torch.optim optimizer."""
    lr: float = 1e-3
    """Peak learning rate (after warmup)."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for adamw)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam's two moment decay rates, each in [0, 1)."""
    momentum: float = 0.9
    """SGD momentum (sgd only)."""
    zero: bool = False
    """Shard the optimizer state across ranks (ZeroRedundancyOptimizer)."""


@dataclass
class ScheduleConfig:
    """The learning-rate schedule, in optimizer steps."""

    name: Literal["constant", "cosine", "linear"] = "constant"
    """Shape of the decay after warmup."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to optim.lr."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of optim.lr (cosine and linear)."""


@dataclass
class TrainConfig:
    """The training loop."""

    epochs: int = 1
    """Passes over the training set."""
    max_steps: int | None = None
    """Stop after this many optimizer steps, even before `epochs` are done (null: no limit)."""
    grad_accum: int = 1
    """Micro-steps (forward/backward) per optimizer step (derived instead under data.global_batch_size)."""
    clip_grad_norm: float | None = None
    """Clip the global gradient norm to this value (null: no clipping)."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """auto: bf16 on a GPU that supports it, fp32 on CPU."""
    seed: int = 0
    """Seed of every random generator (each rank derives its own from it)."""
    sync_batchnorm: bool = False
    """Convert BatchNorm layers to SyncBatchNorm (statistics over the global batch)."""
    find_unused_parameters: bool = False
    """DDP's find_unused_parameters: needed when some parameters get no gradient in a step."""
    static_graph: bool = False
    """DDP's static_graph: the set of used parameters is the same every step."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """How the model is spread over the ranks: ddp (a whole copy on every rank, gradients all-reduced) or fsdp
    (FSDP2's fully_shard: parameters, gradients and optimizer state sharded; each top-level child block, then
    the root, which keeps tied and small children, unless the task's `shard` says otherwise). fsdp checkpoints
    are sharded (checkpoint.format)."""
    ema_decay: float | None = None
    """Keep an exponential moving average of the weights (mgpu.EMA: average = decay x average + (1 - decay) x
    weights after every optimizer step, floating buffers averaged too, as timm's ModelEmaV3), e.g. 0.999; null:
    none. Evaluations (so the best checkpoint and early stopping) use the average, as timm's train script does;
    it is saved in every checkpoint as `ema` (under fsdp sharded like the model), resumes bit-identically, and
    `mgpu.load_model(run, model, ema=True)` loads it."""
    deterministic: bool = False
    """Deterministic GPU kernels (torch.use_deterministic_algorithms, cuDNN deterministic and no autotuning,
    CUBLAS_WORKSPACE_CONFIG=:4096:8): what a bit-identical resume needs on GPUs; slower. CPU runs are
    deterministic without it."""


@dataclass
class EvalConfig:
    """Evaluation, best-checkpoint tracking and early stopping."""

    every_steps: int = 0
    """Evaluate every this many optimizer steps (0: at the end of every epoch)."""
    metric: str = "loss"
    """Evaluation metric that decides the best checkpoint and early stopping."""
    mode: Literal["min", "max"] = "min"
    """Whether a lower or a higher `metric` is better."""
    early_stopping_patience: int | None = None
    """Evaluations without improvement before training stops (null: never stop early)."""
    min_delta: float = 0.0
    """Smallest change of `metric` that counts as an improvement."""


@dataclass
class CheckpointConfig:
    """Checkpoints in the run directory."""

    every_steps: int = 0
    """Save every this many optimizer steps (0: at the end of every epoch only, plus preemption saves)."""
    keep_last: int = 2
    """Most recent checkpoints to keep."""
    keep_best: bool = True
    """Also keep the checkpoint with the best eval.metric."""
    async_save: bool = True
    """Write checkpoints in the background while training goes on."""
    format: Literal["auto", "single", "sharded"] = "auto"
    """single: rank 0 writes one state.pt; sharded: every rank writes its shard through
    torch.distributed.checkpoint (resumable on any number of ranks; DDP's replicated tensors written once,
    spread over the ranks); auto: sharded under train.parallel=fsdp, else single."""
    keep_snapshot_buffers: bool = True
    """Keep the background save's host copy of the state between saves (one copy; pinned on GPUs) so the
    next snapshot skips allocating it; false frees it once each write ends, so host memory holds that copy
    only while a write is in flight. Freed at the end of training either way."""
    memory_every_steps: int | None = None
    """Every this many optimizer steps, each rank also copies what a checkpoint would hold for it into the
    node's shared memory (/dev/shm, two slots, outliving the process; 0: never; null: as often as a copy costs at
    most 0.5 % of the steps' time, 0.3 % under DDP where survivors' saves (below) come first, measured at step 5 and
    agreed by the ranks, mgpu.state.memory.cadence): a step
    that fails and is started again in the same allocation (a killed rank, a crash, a hang) resumes from the newest
    step every rank holds there, when it is newer than the durable checkpoint. Under DDP, with snapshots on, the
    ranks that survive a failure also save the last step they completed (mgpu.state.memory.step_mark): a lost rank then
    costs at most its step, whatever the cadence. Costs one state per rank in host memory (twice: two slots; under
    FSDP2 its shard) and a host copy every k steps; removed when the run ends. Not with optim.zero (no snapshots,
    said once). See docs/memory-snapshots.md."""


@dataclass
class LogConfig:
    """Progress reporting."""

    every_steps: int = 10
    """Log training metrics every this many optimizer steps (0: at the end of every epoch only)."""
    tensorboard: bool = True
    """Write TensorBoard event files to the run directory."""
    progress_bar: Literal["auto", "on", "off"] = "auto"
    """auto: only when stdout is a terminal."""
    wandb: bool = False
    """Also log to Weights & Biases (`pip install mgpu[wandb]`; WANDB_MODE=offline works without a network):
    the run's identity is the wandb run id, so requeues and resubmissions continue the same wandb run."""
    wandb_project: str = "mgpu"
    """The wandb project (the entity is wandb's default, or WANDB_ENTITY)."""


@dataclass
class RunConfig:
    """Where the run's files go."""

    name: str = "run"
    """Name of the run; resuming uses the run directory of the same name."""
    root: str = "runs"
    """Run directories are created under it."""
    dir: str | None = None
    """Explicit run directory (overrides root/name)."""


@dataclass
class DistributedConfig:
    """The process group."""

    init_timeout_s: float = 1800.0
    """Seconds to wait for every rank to join (and for any collective) before failing."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """auto: nccl with GPUs, gloo on CPU."""


@dataclass
class PreemptionConfig:
    """Saving and requeueing before the scheduler stops the job."""

    signal: str = "USR2"
    """Signal that announces the end of the job (as in sbatch --signal=B:USR2@120); stored without 'SIG'."""
    check_every_steps: int | None = None
    """Optimizer steps between the ranks' agreements on a stop flag (one small asynchronous all-reduce
    each, read one step later: a stop comes at most this + 1 steps after the signal). None: every step
    until the first log line, then the power of two of steps closest below one second."""
    deadline_margin_s: float = 60.0
    """Under Slurm, rank 0 stops the run before the job's time limit even without the signal: when the time
    left is less than this margin (at most a tenth of the limit) plus the longest checkpoint write so far
    plus the agreement's delay (mgpu.cluster.deadline); the write time of earlier runs counts too (the ledger's saves).
    0: rely on the signal alone."""
    slurm_poll_s: float = 60.0
    """Under Slurm, seconds between rank 0's questions about the job's end time and its nodes (squeue, scontrol show
    node, in a background thread): how soon a changed time limit or a node set to drain is seen. Each asks
    slurmctld twice; lower it only where a drain must be seen sooner."""


@dataclass
class WatchdogConfig:
    """Hung ranks: found, explained and ended in minutes instead of a collective's timeout (mgpu.stop.watchdog)."""

    enabled: bool = True
    """Run a watchdog thread on every rank."""
    step_multiple: float = 10.0
    """A rank is hung after this many median step times (in an evaluation: median evaluation batch times)
    without progress. A step's time is wall time, waits for the other ranks included."""
    floor_s: float = 60.0
    """... but never sooner than this many seconds in a training step."""
    first_step_s: float = 600.0
    """Allowance before a run's first step (data loading, compilation). A resume (finding, hashing and loading
    the checkpoint) gets at least this, more where the run's saves and resumes say its checkpoint takes
    longer to read, and its reads count as progress (docs/allowances.md)."""
    eval_s: float = 300.0
    """Allowance for a run's first evaluation batch (a compiled model builds its evaluation graph), and the
    least any later one gets (step_multiple x the median evaluation batch time where that is more)."""
    checkpoint_s: float = 600.0
    """Allowance for gathering and writing one checkpoint, at least; raised to 3x the time the next save is
    expected to take (the newest checkpoint's size at the slowest write rate of the run's last saves, earlier
    runs' included, and at least as long as a save that failed or was killed since ran; capped at a day:
    docs/allowances.md)."""
    collective_timeout_s: float = 300.0
    """The process group's timeout after the first step (the rendezvous keeps distributed.init_timeout_s);
    raised to outlast every allowance above (with the defaults: 650 s), so the watchdog, with its evidence,
    ends a hang first. Without the watchdog the group keeps distributed.init_timeout_s."""


@dataclass
class StragglersConfig:
    """Slow ranks: each rank's compute and wait per step, and the rank that holds the others up named
    (mgpu.stop.rank_timing, mgpu.record.stragglers; docs/status.md)."""

    enabled: bool = True
    """Measure every rank's compute and wait per step (its waits in DDP's synchronisations left out of its
    compute) and carry them in the stop agreement's all-reduce (no extra collective); status, TensorBoard and
    the ledger show the slowest rank, its node and its factor. Off: none of it is measured."""
    margin: float = 1.2
    """A rank whose compute per step is at least this factor over the median of the other ranks' in most of the
    steps of the last ..."""
    hold_steps: int = 30
    """... this many steps and ..."""
    hold_s: float = 20.0
    """... this many seconds is named a straggler, in one line (rank, node, factor, since which step); cleared
    once most of that window is under the margin again. Both holds: a machine shared with other jobs can slow
    one rank for ten seconds, which a hold in steps alone would take for a straggler when steps are short
    (docs/status.md: the noise measured, and why a 1.3x slower rank is still named)."""
    exclude_node: bool = False
    """Exclude a named straggler's node when mgpu next requeues the job (its own requeue after a stop or a
    failure, as a hang's node is: never leaving the job fewer nodes than it needs). Off: named only."""


@dataclass
class Config:
    """Everything a run needs to know, one section per concern."""

    task: TaskConfig = field(default_factory=TaskConfig)
    """What to train."""
    data: DataConfig = field(default_factory=DataConfig)
    """How batches are drawn."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation and early stopping."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    log: LogConfig = field(default_factory=LogConfig)
    """Progress reporting."""
    run: RunConfig = field(default_factory=RunConfig)
    """Where the run's files go."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """The process group."""
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    """Saving and requeueing before the scheduler stops the job."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Hung ranks."""
    stragglers: StragglersConfig = field(default_factory=StragglersConfig)
    """Slow ranks."""


SAFE_TO_CHANGE: frozenset[str] = frozenset({
    "train.epochs", "train.max_steps", "eval.every_steps", "eval.early_stopping_patience",
    "checkpoint.every_steps", "checkpoint.keep_last", "checkpoint.async_save", "checkpoint.keep_snapshot_buffers",
    "checkpoint.memory_every_steps",
    "data.num_workers", "data.worker_start_method", "data.eval_batch_size", "log.*", "run.*", "distributed.*", "preemption.*", "watchdog.*",
    "stragglers.*",
    "optim.lr", "optim.weight_decay",  # applied to every parameter group after the restore (mgpu.state.hparams)
})
"""Dotted keys (fnmatch patterns) that may differ between a checkpoint's config and the run resuming it."""
