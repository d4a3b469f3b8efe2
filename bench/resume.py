"""Benchmark: what checkpoints and resumes cost, per mode, side by side in one invocation.

Run: ``.venv/bin/python bench/resume.py [--steps 20 --interval 10 --batch 16 --modes sync,async,fully_async]``

Workload: GRPO on the toy addition task with the built-in warm-started tiny model, ``--batch``
prompts x 8 samples per step, no evaluation, the in-process transformers engine (fully async: one
producer process), one torch thread. Per mode, in this order:

1. a run of ``--steps`` steps without checkpoints (the baseline);
2. the same run with a checkpoint every ``--interval`` steps (and after the last): each
   checkpoint's seconds and bytes are measured where it is saved; their share of the run's
   training time is the cost, next to the ratio of the two runs' training times (the sum of step
   times, checkpoints included for the second; noisy, since they are two runs);
3. the second run resumed to ``--steps + 2`` steps: seconds from the call to its first new step,
   next to the first run's seconds from the call to its first step (a fresh start pays the same
   flow start, engine and trainer loading; a resume adds restoring the checkpoint, and fully
   async re-reading the streams).

Goal (issue 14): a checkpoint every 10 steps costs < 5% of run time on the toy task.
Writes the table to ``bench/results/resume.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _config(mode: str, steps: int, interval: int | None, run_id: str, model_dir: str, root: str, batch: int):
    from miles_core.config import RunConfig

    return RunConfig.model_validate({
        "name": f"resume-{mode.replace('_', '-')}", "run_id": run_id, "mode": mode, "model": {"path": model_dir},
        "data": {"type": "toy"},
        "rollout": {"num_rollout": steps, "rollout_batch_size": batch, "n_samples_per_prompt": 8,
                    "rollout_max_response_len": 6},
        "train": {"lr": 1e-4, "micro_batch_size": 128},
        "engine": {"type": "hf", "num_threads": 1},
        "eval": {"eval_interval": None, "num_prompts": 4},
        "checkpoint": {"save_interval": interval},
        "storage": {"root": root},
    })


class Meter:
    """Times every checkpoint save and the moment of each recorded step (patched in, this process)."""

    def __init__(self) -> None:
        from miles_core.session.checkpoints import Checkpointer
        from miles_core.session.history import RunHistory

        self.saves: list[tuple[float, str]] = []
        self.steps: list[float] = []
        save, record = Checkpointer.save, RunHistory.record

        def timed_save(checkpointer, *a, **kw):
            t0 = time.perf_counter()
            folder = save(checkpointer, *a, **kw)
            self.saves.append((time.perf_counter() - t0, folder))
            return folder

        def timed_record(history, *a, **kw):
            self.steps.append(time.perf_counter())
            return record(history, *a, **kw)

        Checkpointer.save, RunHistory.record = timed_save, timed_record

    def reset(self) -> None:
        self.saves, self.steps = [], []


def _bytes(folder: str) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def _run(meter: Meter, cfg) -> dict:
    import json

    from flows.train import train

    meter.reset()
    t0 = time.perf_counter()
    summary = train(cfg)
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return {"first_step_s": meter.steps[0] - t0 if meter.steps else float("nan"),
            "train_s": sum(r["step_seconds"] for r in rows[len(rows) - len(meter.steps):]),
            "saves": list(meter.saves), "wall": time.perf_counter() - t0}


def bench_mode(meter: Meter, mode: str, args, model_dir: str, root: str) -> dict:
    plain = _run(meter, _config(mode, args.steps, None, f"{mode}-plain", model_dir, root, args.batch))
    saved = _run(meter, _config(mode, args.steps, args.interval, f"{mode}-ckpt", model_dir, root, args.batch))
    ckpt_s = sum(s for s, _ in saved["saves"])
    resumed = _run(meter, _config(mode, args.steps + 2, args.interval, f"{mode}-ckpt", model_dir, root, args.batch))
    return {
        "mode": mode,
        "ckpt_total_s": ckpt_s,
        "plain_train_s": plain["train_s"],
        "ckpt_train_s": saved["train_s"] + ckpt_s,  # checkpoints are saved between steps, outside step_seconds
        "checkpoints": len(saved["saves"]),
        "ckpt_s": statistics.median(s for s, _ in saved["saves"]) if saved["saves"] else float("nan"),
        "ckpt_mb": statistics.median(_bytes(f) for _, f in saved["saves"]) / 1e6 if saved["saves"] else float("nan"),
        "fresh_first_step_s": plain["first_step_s"],
        "resume_first_step_s": resumed["first_step_s"],
    }


def render(rows: list[dict], args, load: float) -> str:
    lines = [
        f"Workload: toy addition, built-in tiny model, {args.steps} steps of {args.batch} prompts x 8 samples, no "
        f"evaluation, in-process engine, 1 torch thread; checkpoint every {args.interval} steps and after the last; "
        f"resume to {args.steps + 2} steps. Load average before: {load:.2f}.",
        "",
        "| mode | train s, no checkpoints | train s, with checkpoints | ratio | checkpoints | s each | MB each "
        "| checkpoint share of the run | fresh run: s to step 1 | resumed: s to first new step | resume / fresh |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['plain_train_s']:.1f} | {r['ckpt_train_s']:.1f} | "
            f"{r['ckpt_train_s'] / r['plain_train_s']:.2f}x | {r['checkpoints']} | {r['ckpt_s']:.2f} | "
            f"{r['ckpt_mb']:.2f} | {100 * r['ckpt_total_s'] / r['plain_train_s']:.1f}% | {r['fresh_first_step_s']:.1f} | "
            f"{r['resume_first_step_s']:.1f} | {r['resume_first_step_s'] / r['fresh_first_step_s']:.2f}x |")
    lines += ["", "Goal: a checkpoint every 10 steps costs < 5% of run time: the checkpoint share column (the seconds "
                  "spent saving, measured where they are saved, over the run's training time). The ratio of the two "
                  "runs' times is shown too; they are separate runs on a shared machine, so it moves by several "
                  "percent either way from noise alone. Before the first mode, a 1-step run warms the process up "
                  "(Prefect's ephemeral server, imports), so every fresh run's time to step 1 is comparable."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--modes", default="sync,async,fully_async")
    args = parser.parse_args()

    import torch

    from miles_core.config import ModelConfig
    from miles_core.models import ensure_model

    torch.set_num_threads(1)
    model_dir = str(ensure_model(ModelConfig()))
    load = os.getloadavg()[0]
    meter = Meter()
    with tempfile.TemporaryDirectory(prefix="miles-bench-resume-") as root:
        _run(meter, _config("sync", 1, None, "warm-up", model_dir, root, args.batch))
        rows = [bench_mode(meter, mode, args, model_dir, root) for mode in args.modes.split(",")]
    table = render(rows, args, load)
    print(table)
    out = Path(__file__).parent / "results" / "resume.md"
    out.write_text(f"Command: `.venv/bin/python bench/resume.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`\n\n"
                   + table + "\n")
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
