"""The chaos benchmark on the local test cluster (slurm/cluster/start.sh must be running; root): the same job runs
for a fixed wall time per configuration while failures are injected at random from a stated mix at a stated mean
time between failures; per configuration, its ETTR, the steps recomputed and the time back to training per failure
kind, and its weights against an unbroken run of the same steps.

    python bench/chaos.py                      # all configurations, ~35 min; docs/chaos.md, bench/results/chaos.json
    python bench/chaos.py --quick              # ~8 min: 120 s each, the fast kinds; bench/results/chaos_quick.json
    python bench/chaos.py --plan-only          # print the failure schedule and the configurations; run nothing
    python bench/chaos.py --config new= --config previous=checkpoint.memory_every_steps=100 --config plain=plain

The job: 2 nodes x 2 ranks, bench/chaos_task.py's MLP paced at `--step-s` a step, 100 steps an epoch, never
finishing within the window. A configuration is `NAME=[plain] [key=value ...]` (bench/chaos_plan.parse_config):
mgpu (jobs/submit.py --cluster slurm) with those overrides, or the plain DDP loop (bench/chaos_plain.py under
torchrun --max-restarts in bench/chaos_plain.sbatch, `--requeue`). By default: `defaults` (mgpu as it is),
`previous` (mgpu with the defaults before issue 44 pinned: the lead adds the new ones to `defaults`), and `plain`
(a torch.save every 100 steps). Every configuration gets the same schedule (bench/chaos_plan.make_plan, seeded),
back to back, each from an idle cluster. A failure comes only once the last one is over (bench/chaos_plan.may_fire:
the job started again and trained a step, or trained on through it for 90 s, and no drained node waits): failures
never overlap, so each one's cost is its own, and a configuration that is down longer meets fewer of them (the table
counts them). A job that ends by
itself before the window does (it gave up, or Slurm did not requeue it) is resubmitted at once, as a user watching
it would, and counted. Then each configuration's unbroken run of the same number of steps (torchrun on this
machine, no pacing) gives the fingerprints its weights are compared with at every step.

The cluster is shared: the whole run holds /tmp/mgpu-e2e.lock (the e2e tests' lock), and on the way out, Ctrl-C
included, every job it submitted is cancelled, the nodes it drained are resumed, the preemption policy it found is
put back and any process it froze and that still lives is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.chaos_inject import (DONE, Cluster, find_ranks, job_state, kill, node_state, sh, take_lock,  # noqa: E402
                                wait_idle, wipe_node_memory)
from bench.chaos_plan import (KINDS, Config, Fired, Injection, Plan, RunResult, make_plan, parse_config,  # noqa: E402
                              may_fire, parse_mix, productive, publish, render, run_result)

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
LOCK = "/tmp/mgpu-e2e.lock"
NODES = ("n1", "n2")
WORLD, PER_NODE = 4, 2
DEFAULT_CONFIGS = ("defaults=", "previous=checkpoint.memory_every_steps=100 checkpoint.every_steps=0",
                   "plain=plain save_every=100")
FULL = {"wall": 600.0, "mtbf": 60.0}
QUICK = {"wall": 120.0, "mtbf": 50.0}
QUICK_MIX = "preempt-grace0,preempt-grace10,kill-rank,kill-node"
"""--quick's default mix: the kinds a 120 s window can see come back (a frozen rank takes mgpu's watchdog 60 s and the
plain loop 600 s; a drain 75 s)."""
MAX_FAILURES = 10000
"""mgpu's failure budget (--max-failures) and torchrun's --max-restarts: a run of failures must not end either."""


def job_config(step_s: float, size: int) -> list[str]:
    """mgpu's overrides for the job itself (every configuration's are added after): one sample per rank a step,
    a progress event with the weights' fingerprint every step (the measurement), epochs enough to outlast the window."""
    return ["task.target=bench.chaos_task:ChaosTask", f"task.args.step_s={step_s}", f"task.args.size={size}",
            "data.batch_size=1", "train.epochs=100000", "log.every_steps=1", "run.name=chaos"]


class Ledger:
    """A run's events.jsonl read as it grows: the times of its newest `progress` and `started` events."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0
        self.newest = {"progress": 0.0, "started": 0.0}

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as file:
                file.seek(self.offset)
                chunk = file.read()
        except FileNotFoundError:
            return
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") in self.newest:
                self.newest[event["event"]] = max(self.newest[event["event"]], float(event["time"]))


class Run:
    """One configuration's job on the cluster: submitted (again, if it ends by itself), followed, ended."""

    def __init__(self, config: Config, folder: Path, cluster: Cluster, step_s: float, size: int) -> None:
        self.config, self.folder, self.cluster, self.step_s, self.size = config, folder, cluster, step_s, size
        self.run_dir = folder / ("run" if config.plain else "chaos")
        self.job_id = ""
        self.submitted = 0

    def submit(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.config.plain:
            opts = dict(o.split("=", 1) for o in self.config.overrides)
            env = dict(os.environ, PYTHON=PYTHON, PROCS=str(PER_NODE), OMP_NUM_THREADS="1",
                       MAX_RESTARTS=opts.get("max_restarts", str(MAX_FAILURES)))
            out = subprocess.run(["sbatch", "--parsable", "-p", "main", "-N2", "--ntasks-per-node=1", "-c4",
                                  "--time", "120", "-J", f"chaos-{self.config.name}", "-o", str(self.folder / "slurm-%j.out"),
                                  str(ROOT / "bench" / "chaos_plain.sbatch"), "--dir", str(self.run_dir),
                                  "--save-every", opts.get("save_every", "100"), "--step-s", str(self.step_s),
                                  "--size", str(self.size), "--timeout-s", opts.get("timeout_s", "600")],
                                 cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
            if out.returncode != 0:
                raise RuntimeError(f"sbatch failed: {out.stdout}{out.stderr}")
            self.job_id = out.stdout.strip().split(";")[0]
        else:
            cmd = [PYTHON, "jobs/submit.py", "--cluster", "slurm", "--nodes", "2", "--gpus-per-node", str(PER_NODE),
                   "--cpus-per-task", "2", "--partition", "main", "--time", "120", "--max-failures", str(MAX_FAILURES),
                   "--job-name", f"chaos-{self.config.name}", "--folder", str(self.folder),
                   *job_config(self.step_s, self.size), *self.config.overrides]
            out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                                 text=True, timeout=120)
            ids = re.findall(r"^slurm job (\S+)$", out.stdout, re.M)
            dirs = re.findall(r"^\s+run directory\s+(\S+)$", out.stdout, re.M)
            if out.returncode != 0 or not ids or not dirs:
                raise RuntimeError(f"jobs/submit.py failed: {out.stdout}{out.stderr}")
            self.job_id, self.run_dir = ids[0], Path(dirs[0])
        self.cluster.jobs.add(self.job_id)
        self.submitted += 1

    def ranks(self) -> dict[int, Any]:
        return find_ranks(str(self.run_dir if self.config.plain else self.folder), self.config.plain)

    def ended(self) -> bool:
        """The job is over (not merely requeued): seen so twice, 2 s apart."""
        if job_state(self.job_id) not in DONE:
            return False
        time.sleep(2)
        return job_state(self.job_id) in DONE

    def fire(self, injection: Injection, drain_s: float) -> str | None:
        """Inject it now; what was done, or None when its target cannot be found (try again later)."""
        kind, target = injection.kind, injection.target
        if kind.startswith("preempt"):
            return f"preemptor job {self.cluster.preempt(10 if kind == 'preempt-grace10' else 0)}"
        if kind == "drain-node":
            self.cluster.drain(target, drain_s)
            return f"drained {target} for {drain_s:g} s"
        ranks = self.ranks()
        if kind in ("kill-rank", "freeze-rank"):
            rank = ranks.get(int(target.split()[1]))
            if rank is None:
                return None
            if kind == "kill-rank":
                kill([rank])
                return f"SIGKILL pid {rank.pid} on {rank.node}"
            self.cluster.freeze(rank.pid)
            return f"SIGSTOP pid {rank.pid} on {rank.node}"
        assert kind == "kill-node", kind
        mine = [r for r in ranks.values() if r.node == target]
        if len(mine) < PER_NODE:
            return None
        kill(mine)
        wiped = [] if self.config.plain else wipe_node_memory(self.job_id, mine, target)
        return f"SIGKILL pids {', '.join(str(r.pid) for r in mine)} on {target}; removed {', '.join(wiped) or 'nothing'}"

    def events(self) -> list[dict[str, Any]]:
        from mgpu.record.failures import merge, read_failures
        from mgpu.record.ledger import read_ledger

        return merge(read_ledger(self.run_dir / "events.jsonl"), read_failures(self.run_dir))


def run_config(run: Run, plan: Plan, say: Any) -> tuple[float, float, list[Fired]]:
    """Submit, inject the plan's failures for its wall time, cancel; (start, end, the failures as fired)."""
    waited = wait_idle(NODES)
    if waited > 2:
        say(f"[{run.config.name}] waited {waited:.0f} s for the cluster to be idle")
    start = time.time()
    run.submit()
    say(f"[{run.config.name}] job {run.job_id} submitted; run directory {run.run_dir}")
    ledger = Ledger(run.run_dir / "events.jsonl")
    pending = list(plan.injections)
    fired: list[Fired] = []
    last_check = 0.0
    end = start + plan.wall_s
    while time.time() < end:
        now = time.time()
        for node in run.cluster.resume_due(now):
            say(f"[{run.config.name}] {now - start:6.1f} s  resumed {node}")
        ledger.poll()
        if now - last_check > 5:
            last_check = now
            if run.ended():
                say(f"[{run.config.name}] {now - start:6.1f} s  job {run.job_id} ended ({job_state(run.job_id)}): "
                    "resubmitted")
                run.submit()
        due = pending and start + pending[0].at_s <= now
        ready = not run.cluster.drained and may_fire(ledger.newest["progress"], ledger.newest["started"],
                                                     fired[-1].at if fired else None, start, now)
        if due and ready:
            detail = run.fire(pending[0], plan.drain_s)
            if detail is not None:
                injection = pending.pop(0)
                fired.append(Fired(injection.kind, injection.target, injection.at_s, time.time(), detail))
                say(f"[{run.config.name}] {now - start:6.1f} s  {injection.kind} {injection.target}: {detail}"
                    + (f" (due at {injection.at_s:g} s)" if now - start - injection.at_s > 2 else ""))
        time.sleep(0.5)
    end = time.time()
    sh("scancel", run.job_id, check=False)
    deadline = time.time() + 90
    while time.time() < deadline and job_state(run.job_id) not in DONE | {""}:
        time.sleep(1)
    for line in run.cluster.restore():
        say(f"[{run.config.name}] {line}")
    return start, end, fired


def reference(config: Config, steps: int, folder: Path, size: int) -> list[dict[str, Any]]:
    """The unbroken run of `steps` steps (torchrun on this machine, no pacing): its ledger's events."""
    from mgpu.record.ledger import read_ledger

    run_dir = folder / "reference"
    if config.plain:
        opts = dict(o.split("=", 1) for o in config.overrides)
        cmd = [str(Path(PYTHON).parent / "torchrun"), "--standalone", "--nproc-per-node", str(WORLD),
               "bench/chaos_plain.py", "--dir", str(run_dir), "--step-s", "0", "--size", str(size),
               "--max-steps", str(steps), "--save-every", opts.get("save_every", "100")]
    else:
        cmd = [str(Path(PYTHON).parent / "torchrun"), "--standalone", "--nproc-per-node", str(WORLD), "jobs/train.py",
               f"run.dir={run_dir}", *job_config(0.0, size), *config.overrides, "--stop-at-step",
               str(steps)]
    with open(folder / "reference.out", "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log, stderr=subprocess.STDOUT,
                       timeout=3600)  # torchrun exits 1 for jobs/train.py's 3 (--stop-at-step stops as a preemption)
    events = read_ledger(run_dir / "events.jsonl")
    if not any(e.get("event") == "progress" and e.get("step") == steps for e in events):
        print(f"[{config.name}] the unbroken run did not reach step {steps}: see {folder / 'reference.out'}")
    return events


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--quick", action="store_true",
                        help=f"a short window each ({QUICK['wall']:g} s, failures every {QUICK['mtbf']:g} s on average)")
    parser.add_argument("--seed", type=int, default=44, help="the schedule's seed (default 44)")
    parser.add_argument("--mtbf", type=float, help=f"mean time between failures, s (default {FULL['mtbf']:g})")
    parser.add_argument("--wall", type=float, help=f"wall time per configuration, s (default {FULL['wall']:g})")
    parser.add_argument("--mix", help=f"failure kinds and weights, e.g. kill-rank=2,freeze-rank=1, or all (default; "
                        f"--quick: {QUICK_MIX}); the kinds: {', '.join(KINDS)}")
    parser.add_argument("--drain-s", type=float, default=75.0,
                        help="how long a drained node stays drained (default 75: mgpu looks every 60 s)")
    parser.add_argument("--step-s", type=float, default=0.2, help="the job's pace, seconds a step (default 0.2)")
    parser.add_argument("--config", action="append", metavar="NAME=SPEC",
                        help="a configuration (repeatable; default: " + "; ".join(DEFAULT_CONFIGS) + ")")
    parser.add_argument("--out", help="the raw results (default bench/results/chaos.json, --quick: chaos_quick.json)")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "chaos.md"),
                        help="the page whose generated block gets the table ('' for none)")
    parser.add_argument("--keep", help="keep the runs' directories under this folder (default: removed)")
    parser.add_argument("--plan-only", action="store_true", help="print the schedule and configurations; run nothing")
    args = parser.parse_args(argv)
    args.wall = args.wall or (QUICK if args.quick else FULL)["wall"]
    args.mtbf = args.mtbf or (QUICK if args.quick else FULL)["mtbf"]
    try:
        args.mix = parse_mix(args.mix or (QUICK_MIX if args.quick else "all"))
        args.configs = [parse_config(c) for c in (args.config or DEFAULT_CONFIGS)]
    except ValueError as error:
        parser.error(str(error))
    names = [c.name for c in args.configs]
    if len(set(names)) != len(names):
        parser.error(f"--config: the names must differ ({', '.join(names)})")
    if args.wall <= 0 or args.mtbf <= 0 or args.drain_s < 0 or args.step_s <= 0:
        parser.error("--wall, --mtbf and --step-s must be above 0, --drain-s at least 0")
    if args.keep and not Path(args.keep).is_dir():
        parser.error(f"--keep {args.keep}: no such directory")
    args.out = Path(args.out or ROOT / "bench" / "results" / ("chaos_quick.json" if args.quick else "chaos.json"))
    return args


def command_line(argv: list[str]) -> str:
    """The command that reproduces the run (where its directories were kept left out)."""
    kept = [a for i, a in enumerate(argv) if not (a == "--keep" or a.startswith("--keep=") or i and argv[i - 1] == "--keep")]
    return "python bench/chaos.py" + "".join(f" {a}" if re.fullmatch(r"[\w.,=/:-]+", a) else f" '{a}'" for a in kept)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    plan = make_plan(args.seed, args.mtbf, args.wall, args.mix, WORLD, NODES, args.drain_s)
    specs = {c.name: c.spec.split("=", 1)[1] or "(mgpu's defaults)" for c in args.configs}
    print("\n".join(plan.lines()))
    print("configurations: " + "; ".join(c.spec for c in args.configs))
    if args.plan_only:
        return 0
    if os.geteuid() != 0 or subprocess.run(["scontrol", "ping"], capture_output=True, timeout=20).returncode != 0:
        print("chaos: needs root and the test cluster running (slurm/cluster/start.sh)", file=sys.stderr)
        return 1
    lock = take_lock(Path(LOCK), lambda line: print(line, flush=True))  # noqa: F841  # held until the exit
    # Ctrl-C and SIGTERM end the run and put the cluster back (SIGINT too when started in the background, where
    # the shell has it ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    busy = [n for n in NODES if node_state(n).split("+")[0] not in ("IDLE", "MIXED", "ALLOCATED")]
    queued = sh("squeue", "-h", "-o", "%i %P %T").split("\n")
    if busy or any(q.strip() for q in queued):
        print(f"chaos: the cluster is not free (nodes {', '.join(busy) or 'ok'}; queue: "
              f"{'; '.join(q for q in queued if q.strip()) or 'empty'}): run it when it is", file=sys.stderr)
        return 1
    cluster = Cluster()
    print(f"the cluster's preemption policy: GraceTime {cluster.policy[0]}, user signal "
          f"{'on' if cluster.policy[1] else 'off'} (put back at the end)")
    scratch = Path(tempfile.mkdtemp(prefix="chaos-", dir=args.keep))
    results: list[RunResult] = []
    fired_by: dict[str, list[Fired]] = {}
    began = time.time()
    say = lambda line: print(line, flush=True)  # noqa: E731
    try:
        finished: list[tuple[Run, float, float]] = []
        for config in args.configs:
            run = Run(config, scratch / config.name, cluster, args.step_s, 400)
            start, end, fired = run_config(run, plan, say)
            fired_by[config.name] = fired
            finished.append((run, start, end))
        for run, start, end in finished:
            events = run.events()
            steps = productive(events, start, end)[0]  # the final trajectory's last step
            say(f"[{run.config.name}] the unbroken run of {steps} steps ...")
            ref = reference(run.config, steps, run.folder, 400) if steps else []
            result = run_result(run.config.name, events, fired_by[run.config.name], start, end, ref,
                                resubmitted=run.submitted - 1)
            results.append(result)
            say(f"[{run.config.name}] ETTR {result.ettr:.3f}, {result.steps} steps, weights {result.weights}")
    except KeyboardInterrupt:
        print("interrupted: putting the cluster back", file=sys.stderr)
        for line in cluster.restore():
            print(line, file=sys.stderr)
        return 130
    finally:
        cluster.restore()
        if not args.keep:
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)
    minutes = (time.time() - began) / 60
    table = render(plan, results, specs)
    print(table)
    when = time.strftime("%Y-%m-%d %H:%M")
    load = os.getloadavg()
    record = {"command": command_line(argv), "time": when, "minutes": round(minutes, 1), "loadavg_at_end": load,
              "plan": plan.as_dict(), "configs": specs, "step_s": args.step_s,
              "results": [asdict(r) for r in results], "fired": {k: [asdict(f) for f in v] for k, v in fired_by.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    if args.doc:
        block = (f"`{command_line(argv)}` ({when}, {minutes:.0f} minutes; load average at the end "
                 f"{load[0]:.1f} on {os.cpu_count()} cores; raw results: "
                 f"[{args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}]"
                 f"(../{args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out})). "
                 f"The schedule:\n\n```\n" + "\n".join(plan.lines()) + f"\n```\n\n{table}")
        page = Path(args.doc)
        page.write_text(publish(page.read_text(), block))
        print(f"table in {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
