"""Benchmark: what Prefect costs a run, in CPU, beside the run's own work, in one invocation.

Run: ``.venv/bin/python bench/orchestration.py [--steps 40]``

The laptop default: ``miles train --config configs/toy.toml`` (sync mode, the ephemeral Prefect
server, a child of the run's process), ``--steps`` steps, no evaluation during the run. Each run
gets a fresh ``PREFECT_HOME`` (its own database) and a fresh run folder. Twice, alternating:

- ``Prefect's defaults``: the server records task-run events one at a time, persists events every
  5 s (Prefect's own settings, set explicitly);
- ``ours``: ``flows/prefect_defaults.py`` (batches of task-run events, flushed every second).

Both run today's flow code (progress artifact at most every 2 s, the "Finished in state
Completed()" log lines dropped, the config passed to tasks under ``quote``).

Measured from outside, with psutil, every 0.2 s: CPU seconds of every process of the run's tree
(``miles``, the run's process, the Prefect server, anything else). The window is from the run's
first step line to its last (steady state: startup and shutdown are left out), divided by the
steps in it. The server's CPU is measured directly. The client's (Prefect's engine and its
background threads, inside the run's process) cannot be told apart from the work there, so it is
measured on a replica: the same flow shape (the run's three tasks per step, with the same config
argument, one log line per step, the progress artifact policy) with empty task bodies, in its own
process; its CPU per step is Prefect's client cost. Prefect's share = (server + client) / the
run's whole CPU per step. The replica also runs with 0 and 1 task runs a step, its server's CPU
measured too: the cost of one task run, and the floor the idle server sets. After each run a new
process reads the run's task runs back from the database: every one should be COMPLETED.

Goal (issue 15): Prefect's share (client and server) under 5% of the run's CPU. Not met. What the
replica rows said on 2026-12-03 (toy steps of 0.42 s and 491 ms of CPU): Prefect 3.9's idle
ephemeral server alone is 2.1% of the run; one task run a step, its log line and progress
artifact 11%; each further task run about 23 ms (4.7%). So at this step length no flow with a task
run per step is under 5%; Prefect's cost per step is about fixed (~100 ms), so a step of more than 2 s
of CPU is under 5% with the run's three tasks. Turning off the server's loop services (scheduler,
late runs, foreman, pause expirations, repossessor, triggers, cancellation cleanup) saved nothing
measurable in the replica.

Writes ``bench/results/orchestration.md``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PREFECTS_OWN = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "1",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "5",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "5",
}
STEP_LINE = re.compile(r"step\s+(\d+)/(\d+) \|")


def _env(home: str, variant: str) -> dict[str, str]:
    from flows import prefect_defaults

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=home, DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    prefect_defaults.apply(env)
    if variant == "Prefect's defaults":
        env.update(PREFECTS_OWN)
    return env


class TreeCPU:
    """CPU seconds per process of a process tree, sampled (a process's last sample is kept after it ends)."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.cpu: dict[int, float] = {}
        self.role: dict[int, str] = {}
        self._lock = threading.Lock()

    def sample(self) -> dict[str, float]:
        import psutil

        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for p in procs:
            try:
                t = p.cpu_times()
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            with self._lock:
                self.cpu[p.pid] = t.user + t.system
                self.role.setdefault(p.pid, "server" if "prefect.server" in cmd else
                                     "run" if "deployments.cli train" in cmd else "other")
        return self.by_role()

    def by_role(self) -> dict[str, float]:
        with self._lock:
            out = {"server": 0.0, "run": 0.0, "other": 0.0}
            for pid, c in self.cpu.items():
                out[self.role[pid]] += c
            return out


def real_run(variant: str, steps: int, work: str) -> dict[str, float]:
    home = tempfile.mkdtemp(prefix="prefect-home-", dir=work)
    root = tempfile.mkdtemp(prefix="runs-", dir=work)
    cmd = [str(ROOT / ".venv/bin/miles"), "train", "--config", "configs/toy.toml", "--num-rollout", str(steps),
           "--set", f"storage.root={root}", "--set", "eval.eval_interval=null"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(home, variant), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    tree = TreeCPU(proc.pid)
    marks: dict[int, tuple[float, dict[str, float]]] = {}
    log: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            log.append(line)
            m = STEP_LINE.search(line)
            if m:
                marks[int(m.group(1))] = (time.monotonic(), tree.sample())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while proc.poll() is None:
        tree.sample()
        time.sleep(0.2)
    reader.join(10)
    if proc.returncode != 0 or 1 not in marks or steps not in marks:
        raise SystemExit(f"the {variant} run failed (exit {proc.returncode}):\n" + "".join(log[-30:]))
    (t0, c0), (t1, c1) = marks[1], marks[steps]
    n = steps - 1
    per = {k: (c1[k] - c0[k]) / n for k in c0}
    return {"server": per["server"], "run": per["run"], "other": per["other"], "step_s": (t1 - t0) / n,
            "total": sum(per.values()), **_task_runs(home, variant)}


def _task_runs(home: str, variant: str) -> dict[str, float]:
    """Every task run in the run's database (a fresh one per run), read back by a new process (its
    own ephemeral server): (COMPLETED ones, all)."""
    code = (
        "import asyncio\n"
        "from prefect.client.orchestration import get_client\n"
        "async def main():\n"
        "    async with get_client() as c:\n"
        "        done = total = offset = 0\n"
        "        while True:\n"
        "            trs = await c.read_task_runs(limit=200, offset=offset)\n"
        "            total += len(trs); done += sum(t.state_type.value == 'COMPLETED' for t in trs)\n"
        "            offset += 200\n"
        "            if len(trs) < 200: break\n"
        "        print(done, total)\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(home, variant), capture_output=True,
                         text=True, timeout=300)
    done, total = (int(x) for x in out.stdout.split()[-2:])
    return {"task_runs_completed": done, "task_runs": total}


REPLICA = '''
import os, sys, time
import psutil
sys.path.insert(0, {root!r})
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote
import flows  # the run's Prefect defaults and log filter
from flows.train import PROGRESS_EVERY_S

from miles_core.config import RunConfig
import tomllib
cfg = RunConfig.model_validate(tomllib.load(open("configs/toy.toml", "rb")))
STEPS, TASKS = {steps}, {tasks}

@task(name="rollout", cache_policy=NO_CACHE, task_run_name="rollout-{{step}}")
def rollout(cfg, refs, step): return step
@task(name="train", cache_policy=NO_CACHE, task_run_name="train-{{step}}")
def train_step(cfg, refs, step): return step
@task(name="push-weights", cache_policy=NO_CACHE, task_run_name="push-weights-v{{step}}")
def push_weights(cfg, refs, step): return 0.0

def server_cpu():  # the ephemeral server: a child process of this one
    total = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total

@flow(name="replica")
def replica(cfg):
    log = get_run_logger()
    progress = create_progress_artifact(0.0, key=None)
    c = quote(cfg)
    rollout(c, None, -1)  # warm
    time.sleep(2)  # the warm-up's events recorded before the window
    t0, s0, at = time.process_time(), server_cpu(), time.monotonic()
    for step in range(STEPS):
        if TASKS >= 1:
            r = rollout(c, None, step)
        if TASKS >= 3:
            t = train_step(c, None, r)
            push_weights(c, None, t)
        if TASKS:
            log.info("step %d/%d | reward 0.5", step + 1, STEPS)
            if step + 1 == STEPS or time.monotonic() - at >= PROGRESS_EVERY_S:
                update_progress_artifact(progress, 100.0 * (step + 1) / STEPS); at = time.monotonic()
        time.sleep({step_s})  # the real run's step time: the progress artifact's pace, the log worker's batches
    time.sleep(2)  # the last batches flushed (recorder and persister: every second)
    return time.process_time() - t0, server_cpu() - s0

client, server = replica(cfg)
print("CLIENT", client, "SERVER", server)
'''


def replica(steps: int, step_s: float, work: str, tasks: int = 3) -> tuple[float, float]:
    """Prefect's (client, server) CPU per step on the replica with ``tasks`` task runs a step (0: an
    idle flow, 1: one task run, a log line and the progress artifact, 3: the run's shape): the
    replica's own process CPU in its loop, and its ephemeral server's."""
    home = tempfile.mkdtemp(prefix="prefect-home-", dir=work)
    code = REPLICA.format(root=str(ROOT), steps=steps, step_s=step_s, tasks=tasks)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(home, "ours"), capture_output=True,
                         text=True, timeout=600)
    line = [x for x in out.stdout.splitlines() if x.startswith("CLIENT")]
    if not line:
        raise SystemExit("the replica failed:\n" + out.stdout[-2000:] + out.stderr[-2000:])
    _, client, _, server = line[0].split()
    return float(client) / steps, float(server) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench-orchestration-")
    load0 = os.getloadavg()
    variants = ["Prefect's defaults", "ours"]
    runs = {v: real_run(v, args.steps, work) for v in variants}
    shapes = {n: replica(args.steps, runs["ours"]["step_s"], work, tasks=n) for n in (0, 1, 3)}
    client = shapes[3][0]
    load1 = os.getloadavg()

    def ms(x: float) -> str:
        return f"{x * 1e3:.1f}"

    a, b = runs[variants[0]], runs[variants[1]]
    rows = [
        ("step time (s)", f"{a['step_s']:.3f}", f"{b['step_s']:.3f}", f"{b['step_s'] / a['step_s']:.2f}"),
        ("run's whole CPU per step (ms)", ms(a["total"]), ms(b["total"]), f"{b['total'] / a['total']:.2f}"),
        ("  the run's process", ms(a["run"]), ms(b["run"]), f"{b['run'] / a['run']:.2f}"),
        ("  Prefect server", ms(a["server"]), ms(b["server"]), f"{b['server'] / a['server']:.2f}"),
        ("  other processes", ms(a["other"]), ms(b["other"]), ""),
        ("Prefect client per step (ms, replica)", ms(client), ms(client), ""),
        ("**Prefect's share of the run's CPU (server + client)**",
         f"**{(a['server'] + client) / a['total']:.1%}**", f"**{(b['server'] + client) / b['total']:.1%}**", ""),
        ("  server alone", f"{a['server'] / a['total']:.1%}", f"{b['server'] / b['total']:.1%}", ""),
        ("task runs COMPLETED in the database / recorded",
         f"{a['task_runs_completed']} / {a['task_runs']}", f"{b['task_runs_completed']} / {b['task_runs']}", ""),
    ]
    lines = [
        f"`.venv/bin/python bench/orchestration.py --steps {args.steps}`",
        "",
        f"The laptop default (`miles train --config configs/toy.toml`, sync, ephemeral Prefect server), "
        f"{args.steps} steps (3 task runs each, and 4 around them), steady state from the first step line to the "
        f"last; CPU from psutil. Load average before: {load0[0]:.2f}, {load0[1]:.2f}, {load0[2]:.2f}; "
        f"after: {load1[0]:.2f}, {load1[1]:.2f}, {load1[2]:.2f}.",
        "",
        f"| | {variants[0]} | {variants[1]} | ours / Prefect's |",
        "|---|---:|---:|---:|",
        *[f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} |" for r in rows],
    ]
    (c0, s0), (c1, s1), (c3, s3) = shapes[0], shapes[1], shapes[3]
    marginal = (c3 + s3 - c1 - s1) / 2
    lines += [
        "",
        "Where Prefect's cost comes from: the replica (empty tasks, the same pace) with 0, 1 and 3 task runs a step "
        "(1 and 3 also log the step line and keep the progress artifact), CPU per step (ms), and as a share of the "
        "real run's CPU per step (ours).",
        "",
        "| replica | client | server | client + server | share of the run's CPU |",
        "|---|---:|---:|---:|---:|",
        *[f"| {name} | {ms(c)} | {ms(srv)} | {ms(c + srv)} | {(c + srv) / b['total']:.1%} |"
          for name, (c, srv) in (("idle flow (0 task runs)", (c0, s0)), ("1 task run a step", (c1, s1)),
                                 ("3 task runs a step (the run's shape)", (c3, s3)))],
        f"| each task run beyond the first (from 1 -> 3) | | | {ms(marginal)} | {marginal / b['total']:.1%} |",
    ]
    text = "\n".join(lines)
    print(text)
    out = ROOT / "bench" / "results" / "orchestration.md"
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
