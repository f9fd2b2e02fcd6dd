"""The same GPT trained several ways, side by side: ms per step with and without periodic checkpoints.

    python bench/gpu/side_by_side.py                        # one GPU (a world of one), the 'gpu' size, ~8 min
    python bench/gpu/side_by_side.py --size tiny --ranks 2  # CPU, 2 gloo ranks, a tiny GPT (CI: seconds a form)
    python bench/gpu/side_by_side.py --forms hand_fsdp,own_fsdp --every 0   # FSDP2's step overhead alone

Forms (each in fresh processes: one per rank, RANK/WORLD_SIZE set as a launcher would):
  hand_ddp        a hand-written loop (DDP when several ranks), `torch.save` of model + optimizer on rank 0
  lightning       Lightning's Trainer + ModelCheckpoint, if `lightning` is installed (skipped with a note if not;
                  mgpu does not depend on it)
  trainer         mgpu's Trainer (jobs/train.py's engine), defaults
  own             mgpu's own loop (Session: wrap, load, save, log, should_stop)
  hand_fsdp       a hand-written FSDP2 loop (fully_shard per block and the root), `dcp.save` for checkpoints
  trainer_fsdp    the Trainer with train.parallel=fsdp (sharded checkpoints)
  own_fsdp        the own loop with wrap(parallel="fsdp")
  trainer_sharded the Trainer, DDP, checkpoint.format=sharded
Each form runs `--steps` steps without checkpoints and again with one every `--every` steps (0: without only).
`ms_step`: the median over the timed window (the steps after `--warmup`) of wall time per step, a CUDA
synchronize at both ends of the window (none on CPU); `blocked_s`: per save, how long the loop was held
(median); `write_s`: per save, from the call to durable where the form knows it (mgpu's ledger; a synchronous
`torch.save`'s is its blocked time); `disk_gb_s`: a plain sequential write + fsync of 1 GiB (`--disk-mb`) in the
checkpoint directory's filesystem, measured first. One table on stdout and `bench/results/side_by_side.json`
(`--out`).

Sizes: `tiny` (2 layers, 64 wide, 32 tokens: a CPU step in milliseconds), `small` (4 layers, 256 wide, 128
tokens: a CPU step in about a hundred milliseconds, for CPU ratios), `state` (the `gpu` size's weights, so its
checkpoints too, with 64-token windows of batch 1: its saves on a CPU) and `gpu` (12 layers, 768 wide,
1,024 tokens, batch 8, bf16 autocast: 124M parameters, ~1.5 GB of checkpoint state; 16 runs in about 8 minutes
of one H100 by estimate: not yet run on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from mgpu.train.task import Task  # noqa: E402

FORMS = ("hand_ddp", "lightning", "trainer", "own", "hand_fsdp", "trainer_fsdp", "own_fsdp", "trainer_sharded")
SIZES = {"tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32, "vocab": 256, "batch": 4},
         "small": {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 128, "vocab": 512, "batch": 8},
         "gpu": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "vocab": 50304, "batch": 8},
         "state": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 64, "vocab": 50304, "batch": 1}}


# ---------------------------------------------------------------------------------------------- the model, data
def gpt(size: dict[str, int]) -> Any:
    from jobs.tasks.gpt import GPT

    return GPT(size["vocab"], size["block_size"], size["n_layer"], size["n_head"], size["n_embd"], dropout=0.0)


def batches(size: dict[str, int], count: int, rank: int) -> Any:
    """`count` batches of random token windows for this rank (the same on every form)."""
    import torch

    generator = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, size["vocab"], (count, size["batch"], size["block_size"] + 1), generator=generator)


def loss_of(model: Any, windows: Any, per_sample: bool = False) -> Any:
    """The next-token loss: the batch's mean, or one per window (`per_sample`: what a Task's loss returns)."""
    import torch
    import torch.nn.functional as F

    with torch.autocast(windows.device.type, dtype=torch.bfloat16, enabled=windows.is_cuda):
        logits = model(windows[:, :-1])
    losses = F.cross_entropy(logits.float().transpose(1, 2), windows[:, 1:], reduction="none")
    return losses.mean(dim=1) if per_sample else losses.mean()


class Timer:
    """Step ends, and each save's time holding the loop."""

    def __init__(self, device: Any) -> None:
        self.device, self.ends, self.blocked = device, [], []  # type: ignore[var-annotated]

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step_done(self, warmup: int) -> None:
        if len(self.ends) == warmup:
            self.sync()  # the window's start
        self.ends.append(time.perf_counter())

    def held(self, action: Callable[[], Any]) -> None:
        started = time.perf_counter()
        action()
        self.blocked.append(time.perf_counter() - started)


def window_ms(ends: list[float], warmup: int) -> float:
    timed = ends[warmup:]
    return (timed[-1] - timed[0]) / max(1, len(timed) - 1) * 1e3


# ---------------------------------------------------------------------------------------------- the forms
def _hand_loop(args: Any, size: dict[str, int], device: Any, rank: int, model: Any, optimizer: Any,
               save: Callable[[int], None] | None) -> dict[str, Any]:
    """A hand-written loop's steps over `model` (wrapped as the form wraps it), `save(step)` every args.every."""
    timer = Timer(device)
    for step, windows in enumerate(batches(size, args.steps, rank), 1):
        loss = loss_of(model, windows.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if save is not None and args.every and step % args.every == 0:
            timer.held(lambda: save(step))
        timer.step_done(args.warmup)
    timer.sync()
    timer.ends[-1] = time.perf_counter()
    return {"ms_step": window_ms(timer.ends, args.warmup), "blocked": timer.blocked, "written": timer.blocked}


def hand_ddp(args: Any, size: dict[str, int], device: Any, rank: int, world: int, out: Path) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = gpt(size).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def save(step: int) -> None:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, out / f"hand_{step}.pt")

    return _hand_loop(args, size, device, rank, ddp, optimizer, save if rank == 0 else None)


def hand_fsdp(args: Any, size: dict[str, int], device: Any, rank: int, world: int, out: Path) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = gpt(size).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def save(step: int) -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out / f"hand_fsdp_{step}"))

    return _hand_loop(args, size, device, rank, model, optimizer, save)


def own(args: Any, size: dict[str, int], device: Any, rank: int, world: int, out: Path,
        parallel: str = "ddp") -> dict[str, Any]:
    import torch

    import mgpu
    from mgpu.config.loading import load_config
    from mgpu.record.ledger import read_ledger

    session = mgpu.Session(out / "own", seed=0, config=load_config(None, ["log.every_steps=10"]))
    model = session.wrap(gpt(size), parallel=parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    state = {"model": model, "optimizer": optimizer}
    session.load(state)
    timer = Timer(session.device)
    for windows in batches(size, args.steps, rank):
        loss = loss_of(model, windows.to(session.device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if session.should_stop():
            break
        session.log(loss=loss)
        if args.every and session.step % args.every == 0:
            timer.held(lambda: session.save(state))
        timer.step_done(args.warmup)
    timer.sync()
    timer.ends[-1] = time.perf_counter()
    session.finish()
    saved = [e for e in read_ledger(session.run.ledger) if e["event"] == "checkpoint_saved"] if rank == 0 else []
    return {"ms_step": window_ms(timer.ends, args.warmup), "blocked": timer.blocked,
            "written": [e["seconds"] for e in saved if e.get("reason") == "periodic"]}


def trainer(args: Any, size: dict[str, int], device: Any, rank: int, world: int, out: Path,
            overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    from mgpu.config.loading import load_config
    from mgpu.record.ledger import read_ledger
    from mgpu.run.session import Session
    from mgpu.train.task import build_task
    from mgpu.train.trainer import Trainer

    cfg = load_config(None, ["task.target=bench.gpu.side_by_side:GptBenchTask",
                             f"task.args.size={args.size}", f"task.args.samples={args.steps * size['batch'] * world}",
                             f"data.batch_size={size['batch']}", "train.epochs=1", "schedule.name=constant",
                             "log.every_steps=10", f"checkpoint.every_steps={args.every}", *overrides])
    cfg.run.dir = str(out / "trainer")
    session = Session(config=cfg)
    fit = Trainer(cfg, build_task(cfg.task.target, cfg.task.args), session)
    result = fit.fit()
    session.end(result.status, epoch=result.epoch, metrics=result.metrics, best_metrics=result.best_metrics,
                best_step=result.best_step)
    run = session.run
    ends = list(fit.step_ends)
    saved = [e for e in read_ledger(run.ledger) if e["event"] == "checkpoint_saved"] if rank == 0 else []
    periodic = [e for e in saved if e.get("reason") == "periodic"]
    return {"ms_step": window_ms(ends, args.warmup), "blocked": [e.get("blocked_s", 0.0) for e in periodic],
            "written": [e["seconds"] for e in periodic]}


def lightning(args: Any, size: dict[str, int], device: Any, rank: int, world: int, out: Path) -> dict[str, Any]:
    try:
        import lightning as L  # noqa: N812
    except ImportError:
        return {"skipped": "lightning is not installed (mgpu does not depend on it)"}
    import torch

    class Module(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.model = gpt(size)

        def training_step(self, windows: Any, index: int) -> Any:
            return loss_of(self.model, windows)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    ends: list[float] = []

    class Ends(L.Callback):  # type: ignore[misc,name-defined]
        def on_train_batch_end(self, *a: Any) -> None:
            if device.type == "cuda" and len(ends) == args.warmup:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    callbacks: list[Any] = [Ends()]
    if args.every:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=out / "lightning", every_n_train_steps=args.every, save_top_k=-1))
    torch.manual_seed(0)
    fit = L.Trainer(max_steps=args.steps, accelerator=device.type, devices=world, logger=False,
                    enable_progress_bar=False, callbacks=callbacks, enable_checkpointing=bool(args.every))
    fit.fit(Module(), torch.utils.data.DataLoader(list(batches(size, args.steps, 0)), batch_size=None))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"ms_step": window_ms(ends, args.warmup), "blocked": [], "written": []}


class GptBenchTask(Task):
    """The trainer's Task: this GPT on random token windows (as the hand-written loops')."""

    def __init__(self, size: str = "tiny", samples: int = 64) -> None:
        self.shape, self.samples = SIZES[size], samples

    def build_model(self) -> Any:
        import torch

        torch.manual_seed(0)
        return gpt(self.shape)

    def train_dataset(self) -> Any:
        import torch
        from torch.utils.data import TensorDataset

        generator = torch.Generator().manual_seed(1000)
        return TensorDataset(torch.randint(0, self.shape["vocab"], (self.samples, self.shape["block_size"] + 1),
                                           generator=generator))

    def loss(self, model: Any, batch: Any) -> Any:
        return loss_of(model, batch[0] if isinstance(batch, (list, tuple)) else batch, per_sample=True)


RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {
    "hand_ddp": hand_ddp, "lightning": lightning, "hand_fsdp": hand_fsdp,
    "trainer": trainer, "own": own,
    "trainer_fsdp": lambda *a: trainer(*a, overrides=("train.parallel=fsdp",)),
    "own_fsdp": lambda *a: own(*a, parallel="fsdp"),
    "trainer_sharded": lambda *a: trainer(*a, overrides=("checkpoint.format=sharded",)),
}


# ---------------------------------------------------------------------------------------------- one rank
def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    size = SIZES[args.size]
    out = Path(args.workdir)
    needs_group = args.form in ("hand_ddp", "hand_fsdp", "lightning") and world > 1 or args.form == "hand_fsdp"
    if needs_group and args.form != "lightning":
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    result = RUNNERS[args.form](args, size, device, rank, world, out)
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        Path(args.result).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------- the driver
def disk_gb_s(directory: Path, mb: int) -> float:
    from bench.write_speed import plain_write

    data = memoryview(os.urandom(mb << 20))
    best = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        plain_write(directory / "disk.bin", data)
        best = min(best, time.perf_counter() - started)
        (directory / "disk.bin").unlink()
    return len(data) / best / 1e9


def run_form(args: argparse.Namespace, form: str, every: int, base: Path) -> dict[str, Any]:
    import random
    import statistics

    workdir = Path(tempfile.mkdtemp(prefix=f"{form}-", dir=base))
    result_path = workdir / "result.json"
    port = str(random.SystemRandom().randint(20000, 32000))
    procs = []
    for rank in range(args.ranks):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.ranks),
               "LOCAL_WORLD_SIZE": str(args.ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, __file__, "--rank-of", form, "--size", args.size, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--every", str(every), "--workdir", str(workdir),
               "--result", str(result_path), *(["--cpu"] if args.cpu else [])]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = [proc.communicate(timeout=args.timeout)[0] for proc in procs]
    row: dict[str, Any] = {"form": form, "every": every}
    if any(proc.returncode for proc in procs) or not result_path.is_file():
        row["error"] = " | ".join(o.strip().splitlines()[-1] for o in outputs if o.strip())[:300]
        for rank, output in enumerate(outputs):  # the whole story where a lent GPU's minutes are spent on it
            tail = "\n".join(output.strip().splitlines()[-20:])
            print(f"--- {form} (every {every}) rank {rank}, rc {procs[rank].returncode}:\n{tail}", file=sys.stderr)
    else:
        result = json.loads(result_path.read_text())
        if "skipped" in result:
            row["skipped"] = result["skipped"]
        else:
            row["ms_step"] = round(result["ms_step"], 3)
            row["saves"] = len(result["blocked"]) or len(result["written"])
            row["blocked_s"] = round(statistics.median(result["blocked"]), 4) if result["blocked"] else None
            row["blocked_sum_s"] = round(sum(result["blocked"]), 4)
            row["write_s"] = round(statistics.median(result["written"]), 4) if result["written"] else None
    shutil.rmtree(workdir, ignore_errors=True)
    return row


HAND = {"hand_ddp": "hand_ddp", "lightning": "hand_ddp", "trainer": "hand_ddp", "own": "hand_ddp",
        "trainer_sharded": "hand_ddp", "hand_fsdp": "hand_fsdp", "trainer_fsdp": "hand_fsdp", "own_fsdp": "hand_fsdp"}
"""Each form's peer: the hand-written loop of the same parallelism."""


def vs_hand(rows: list[dict[str, Any]], timed_steps: int) -> None:
    """Set each row's `vs_hand`: its ms_step over its hand-written peer's, with the same saves; and a row with
    saves its `vs_none` (over the same form's without) and `vs_none_less_held` (less the time its saves held the
    loop, spread over the `timed_steps`: what the saves cost beyond their host copies)."""
    steps = {(row["form"], row["every"]): row.get("ms_step") for row in rows}
    for row in rows:
        peer = steps.get((HAND[row["form"]], row["every"]))
        row["vs_hand"] = round(row["ms_step"] / peer, 3) if row.get("ms_step") and peer else None
        none = steps.get((row["form"], 0))
        if row["every"] and row.get("ms_step") and none:
            row["vs_none"] = round(row["ms_step"] / none, 3)
            held_ms = row.get("blocked_sum_s", 0.0) * 1e3 / max(1, timed_steps)
            row["vs_none_less_held"] = round((row["ms_step"] - held_ms) / none, 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="gpu")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--steps", type=int, default=0, help="steps per run (0: 60 gpu, 30 tiny)")
    parser.add_argument("--warmup", type=int, default=0, help="untimed steps first (0: 10 gpu, 5 tiny)")
    parser.add_argument("--every", type=int, default=0, help="a checkpoint every N steps (0: steps // 3)")
    parser.add_argument("--no-saves", action="store_true", help="only the runs without checkpoints")
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--cpu", action="store_true", help="on the CPU even where a GPU is")
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: here)")
    parser.add_argument("--disk-mb", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (60 if args.size != "tiny" else 30)
    args.warmup = args.warmup or (10 if args.size != "tiny" else 5)
    if args.rank_of is not None:
        args.form = args.rank_of
        rank_main(args)
        return 0
    forms = [form for form in args.forms.split(",") if form]
    unknown = [form for form in forms if form not in FORMS]
    if unknown:
        print(f"side_by_side: unknown form(s) {', '.join(unknown)} (known: {', '.join(FORMS)})", file=sys.stderr)
        return 2
    every = args.every or max(1, args.steps // 3)
    base = Path(tempfile.mkdtemp(prefix="side-by-side-", dir=args.dir or Path.cwd()))
    try:
        disk = disk_gb_s(base, args.disk_mb)
        print(f"disk: {disk:.2f} GB/s (plain sequential write + fsync of {args.disk_mb} MiB, best of 2)", flush=True)
        rows = []
        for form in forms:
            for saves in ((0,) if args.no_saves else (0, every)):
                row = run_form(args, form, saves, base)
                row["disk_gb_s"] = round(disk, 3)
                print(json.dumps(row), flush=True)
                rows.append(row)
                if args.out:  # what has run so far survives a run cut short (a lent GPU's time limit)
                    args.out.write_text(json.dumps({"partial": True, "rows": rows}, indent=1))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    from bench.common import report

    vs_hand(rows, args.steps - args.warmup)
    keys = ("form", "every", "ms_step", "vs_hand", "vs_none", "vs_none_less_held", "saves", "blocked_s", "blocked_sum_s",
            "write_s", "disk_gb_s", "skipped", "error")
    report("side_by_side", [{key: row.get(key, "") for key in keys} for row in rows], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
