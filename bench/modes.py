"""Benchmark: sync, async and fully-async runs of the same workload, side by side, in one invocation.

Run: ``.venv/bin/python bench/modes.py [--steps 24 --batch 128 --eval-every 2 --seeds 0 1 --engine server]``

Workload: GRPO on the toy addition task with the built-in warm-started tiny model, ``--batch``
prompts x 8 samples per step, held-out evaluation (256 prompts, greedy) every ``--eval-every``
steps. Generation and training really run in parallel on this 2-core machine: with ``--engine
server`` (the default) the rollout engine is its own process speaking SGLang's HTTP protocol
(transformers behind it), pinned to core 1, and the trainer runs in this process, pinned to core 0,
each with one torch thread; the fully-async producer is a process of its own, also on core 1. ``--engine inprocess`` keeps the engine in this process instead (both
sides then share the cores and Python's lock).

Per mode it prints: median step wall time next to the median rollout time, train time, their sum
and their max (steps after the first two), the trainer's idle fraction, and the time to reach
each of ``--targets`` held-out accuracies: training wall time (the sum of step times; evaluation
excluded) until the first evaluation at or above it, averaged over ``--seeds``. For fully-async there is no per-step rollout:
its rollout column is the time the producer needs for one batch at its throughput while busy.
Goals (from the issues): async step time <= 1.10 x max(rollout, train); fully-async step time
<= 1.05 x its train time and trainer idle < 5% (steps after an evaluation included) when
generation is faster than training; async and fully-async reach each target no later than sync.
Writes the table to ``bench/results/modes.md``.

``--model smollm2-135m-instruct --gains``: the generation-heavy workload of ``configs/smollm2-steps.toml``
(SmolLM2-135M-Instruct answering word problems step by step in up to 256 tokens, ``--batch`` prompts x 4
samples), targets as gains over each run's starting accuracy, ``fully_async_2`` (two producers) as a
fifth row; goals there: async step <= 1.1 x max(rollout, train), fully async at each target in at most
0.7 x sync's time, trainer idle < 5%. Writes ``bench/results/modes_smollm2.md``.
"""

from __future__ import annotations

import argparse
import json
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

MODES = ("sync", "async", "fully_async")
ROOT = Path(__file__).resolve().parents[1]
# modes.py's names for what it runs: a mode, or fully async with two producers
PRODUCERS = {"fully_async_2": 2}


STEPS_CONFIG = ROOT / "configs" / "smollm2-steps.toml"


def samples_per_step(args: argparse.Namespace) -> int:
    from miles_core.config import RunConfig

    per_prompt = 8 if args.model == "tiny" else RunConfig.read_toml(STEPS_CONFIG)["rollout"]["n_samples_per_prompt"]
    return args.batch * per_prompt


def run_mode(mode: str, seed: int, model_dir: str, root: str, args: argparse.Namespace, eval_every=...) -> dict:
    from miles_core.config import RunConfig

    engine = ({"type": "sglang", "launch": "hf-server", "cpu_affinity": [1], "num_threads": 1}
              if args.engine == "server" else {"type": "hf", "num_threads": 1})
    if args.model != "tiny":
        return run_smollm2(mode, seed, root, args, engine, eval_every)
    cfg = RunConfig.model_validate({
        "name": f"bench-{mode}",
        # fully async: the producer is a process of its own, on the engine's core, off the trainer's
        "mode": {"type": mode} if mode != "fully_async" else {
            "type": mode, "max_concurrent_samples": args.batch * 8, "buffer_capacity_factor": args.capacity_factor,
            "producer_cpu_affinity": [1] if args.engine == "server" else None},
        "seed": seed,
        "model": {"path": model_dir},
        "data": {"type": "toy"},
        "rollout": {"num_rollout": args.steps, "rollout_batch_size": args.batch, "n_samples_per_prompt": 8,
                    "rollout_max_response_len": 6},
        "train": {"lr": 1e-4, "micro_batch_size": 128, "use_tis": args.tis and mode != "sync"},
        "engine": engine,
        "eval": {"eval_interval": args.eval_every if eval_every is ... else eval_every, "num_prompts": 256,
                 "engine": args.eval_engine},
        "storage": {"root": root},
    })
    return run_config(mode, cfg)


def run_smollm2(mode: str, seed: int, root: str, args: argparse.Namespace, engine: dict, eval_every) -> dict:
    """configs/smollm2-steps.toml (generation-heavy: word problems answered step by step, up to 256
    tokens) with this bench's engine, steps, seed, evaluation interval and mode."""
    from miles_core.config import RunConfig

    raw = RunConfig.read_toml(STEPS_CONFIG)
    raw["data"]["path"] = str(ROOT / raw["data"]["path"])
    raw["eval"]["data"]["path"] = str(ROOT / raw["eval"]["data"]["path"])
    fully = mode.startswith("fully_async")
    raw.update(name=f"bench-{mode}", seed=seed, engine=engine, mode={"type": mode} if not fully else {
        "type": "fully_async", "rollout_producers": PRODUCERS.get(mode, 1),
        "max_concurrent_samples": samples_per_step(args), "buffer_capacity_factor": args.capacity_factor,
        "producer_cpu_affinity": [1] if args.engine == "server" else None})
    raw["rollout"].update(num_rollout=args.steps, rollout_batch_size=args.batch)
    raw["train"].update(global_batch_size=samples_per_step(args), use_tis=args.tis and mode != "sync")
    raw["eval"].update(eval_interval=args.eval_every if eval_every is ... else eval_every, engine=args.eval_engine)
    raw["storage"] = {"root": root}
    return run_config(mode, RunConfig.model_validate(raw))


def run_config(mode: str, cfg) -> dict:
    from flows.train import train

    t0 = time.perf_counter()
    summary = train(cfg)
    wall = time.perf_counter() - t0
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    return {"mode": mode, "rows": rows, "evals": evals, "wall": wall, "summary": summary}


def summarise(result: dict, args: argparse.Namespace) -> dict:
    rows = result["rows"][2:] or result["rows"]  # the first steps warm up (and fill the pipeline)
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    samples = samples_per_step(args)
    if result["mode"].startswith("fully_async"):
        # the producer's throughput while it generates (its idle share is time held back by the
        # buffer bound, not generation), turned into seconds per batch
        busy_qps = [r["async/producer_throughput_qps"] / max(1e-3, 1 - r["async/producer_idle_fraction"]) for r in rows
                    if "async/producer_throughput_qps" in r]
        qps = statistics.median(busy_qps)
        rollout = samples / qps if qps > 0 else float("nan")
    else:
        rollout = med("rollout_seconds")
    train = med("train_seconds")
    elapsed, to_target = 0.0, {t: None for t in args.targets}
    acc_at = {int(e["step"]): e["accuracy"] for e in result["evals"]}
    start = result["evals"][0]["accuracy"] if args.gains else 0.0  # --gains: targets above the run's start
    for r in result["rows"]:
        elapsed += r["step_seconds"]
        for t in args.targets:
            if to_target[t] is None and acc_at.get(r["step"], 0.0) >= start + t - 1e-9:
                to_target[t] = elapsed
    return {
        "mode": result["mode"],
        "step": med("step_seconds"),
        "rollout": rollout,
        "train": train,
        "sum": rollout + train,
        "max": max(rollout, train),
        "idle": statistics.fmean(r["trainer_idle_fraction"] for r in rows),
        # evaluation borrows the engine (fully async: the producer pauses and drains), so the
        # step after each evaluation waits for a refill: that idle is evaluation's, not generation's
        "idle_gen": statistics.fmean(r["trainer_idle_fraction"] for r in rows
                                     if (r["step"] - 1) % args.eval_every != 0) if args.eval_every > 1 else float("nan"),
        "to_target": to_target,
        "acc_before": result["evals"][0]["accuracy"],
        "acc_final": result["evals"][-1]["accuracy"],
        "staleness": max(r.get("staleness_max", 0.0) for r in result["rows"]),
        "train_seconds_total": sum(r["step_seconds"] for r in result["rows"]),
    }


def combine(per_seed: list[dict]) -> dict:
    """One mode over several seeds: medians of the timings, mean time to each target (None if a
    seed never got there), accuracies of every seed."""
    keys = ("step", "rollout", "train", "sum", "max", "idle", "idle_gen")
    out = {k: statistics.median(s[k] for s in per_seed) for k in keys}
    out["mode"] = per_seed[0]["mode"]
    out["to_target"] = {
        t: None if any(s["to_target"][t] is None for s in per_seed) else statistics.fmean(s["to_target"][t] for s in per_seed)
        for t in per_seed[0]["to_target"]
    }
    out["acc"] = ", ".join(f"{s['acc_before']:.3f} -> {s['acc_final']:.3f}" for s in per_seed)
    out["staleness"] = max(s["staleness"] for s in per_seed)
    return out


def render(stats: list[dict], args: argparse.Namespace) -> str:
    fmt = lambda x: "n/a" if x is None else f"{x:.1f} s"  # noqa: E731
    targets = " | ".join(f"to acc +{t}" if args.gains else f"to acc {t}" for t in args.targets)
    workload = ("toy addition, built-in tiny model, {steps} steps of {batch} prompts x 8 samples, eval every {every}"
                " steps on 256 held-out prompts" if args.model == "tiny" else
                "configs/smollm2-steps.toml (SmolLM2-135M-Instruct, fp32, full fine-tune; word problems answered step"
                " by step in up to 256 tokens, temperature 0.5), {steps} steps of {batch} prompts x 4 samples, greedy"
                " eval every {every} steps on 47 held-out problems")
    lines = [
        f"Workload: {workload.format(steps=args.steps, batch=args.batch, every=args.eval_every)}, seeds {args.seeds}; "
        f"fully_async_2: two producers; fully-async buffer "
        f"capacity factor {args.capacity_factor}; TIS in async modes: {'on' if args.tis else 'off'}; engine: {args.engine}"
        + (" (SGLang-protocol server pinned to core 1; trainer pinned to core 0; 1 torch thread each)"
           if args.engine == "server" else " (in this process)")
        + ". Step timings: seconds, medians over steps 3+ (median over seeds). Time to an accuracy: training"
        " wall time (sum of step times, evaluation excluded) until the first evaluation at or above it,"
        " mean over seeds.",
        "",
        "| mode | step wall | rollout | train | rollout+train | max(rollout, train) | step / max | trainer idle "
        f"| idle, steps after an eval excluded | {targets} | accuracy before -> after (per seed) | max staleness |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(args.targets) + "---|---:|",
    ]
    for s in stats:
        times = " | ".join(fmt(s["to_target"][t]) for t in args.targets)
        lines.append(
            f"| {s['mode']} | {s['step']:.3f} | {s['rollout']:.3f} | {s['train']:.3f} | {s['sum']:.3f} | "
            f"{s['max']:.3f} | {s['step'] / s['max']:.2f} | {100 * s['idle']:.1f}% | {100 * s['idle_gen']:.1f}% | {times} | "
            f"{s['acc']} | {s['staleness']:.0f} |"
        )
    by = {s["mode"]: s for s in stats}
    lines += ["", "Goals (from the issue):"]
    if "async" in by:
        a = by["async"]
        ok = a["step"] <= 1.10 * a["max"]
        lines.append(f"- async step time <= 1.10 x max(rollout, train): {'MET' if ok else 'NOT MET'} "
                     f"({a['step'] / a['max']:.2f}x)")
    for name in [m for m in by if m.startswith("fully_async")]:
        f = by[name]
        ok = f["step"] <= 1.05 * f["train"]
        lines.append(f"- {name} step time <= 1.05 x its train time (the producer out of the trainer's process): "
                     f"{'MET' if ok else 'NOT MET'} ({f['step'] / f['train']:.2f}x)")
        ok = f["idle"] < 0.05
        lines.append(f"- {name} trainer idle < 5%, steps after an evaluation included: {'MET' if ok else 'NOT MET'} "
                     f"({100 * f['idle']:.1f}%)")
        faster = f["rollout"] < f["train"]
        ok = f["idle_gen"] < 0.05
        lines.append(f"- {name} trainer idle < 5% when generation is faster than training "
                     f"(here generation {'is' if faster else 'is NOT'} faster; steps right after an evaluation "
                     f"excluded, {100 * f['idle']:.1f}% with them): {'MET' if ok else 'NOT MET'} "
                     f"({100 * f['idle_gen']:.1f}%)")
    if "sync" in by:
        for target in args.targets:
            base = by["sync"]["to_target"][target]
            label = f"+{target}" if args.gains else f"{target}"
            for mode in [m for m in by if m != "sync"]:
                t = by[mode]["to_target"][target]
                if args.model == "tiny":
                    ok = t is not None and (base is None or t <= base)
                    lines.append(f"- {mode} reaches accuracy {label} no later than sync: {'MET' if ok else 'NOT MET'} "
                                 f"({fmt(t)} vs {fmt(base)})")
                elif mode.startswith("fully_async"):  # the generation-heavy goal: at most 0.7x sync's time
                    verdict = ("not reached by either" if t is None and base is None else "NOT MET" if t is None
                               else "MET" if base is None or t <= 0.7 * base else "NOT MET")
                    lines.append(f"- {mode} reaches accuracy {label} in <= 0.7 x sync's time: {verdict} "
                                 f"({fmt(t)} vs {fmt(base)})")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch", type=int, default=128, help="prompts per step (x 8 samples)")
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--targets", type=float, nargs="+", default=[0.6, 0.7, 0.75],
                        help="held-out accuracies for time-to-target")
    parser.add_argument("--engine", choices=("server", "inprocess"), default="server")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--capacity-factor", type=float, default=2.0,
                        help="fully async: --async-data-buffer-capacity-factor")
    parser.add_argument("--tis", action="store_true", help="async modes: truncated importance sampling (--use-tis)")
    parser.add_argument("--eval-engine", choices=("separate", "shared"), default="separate",
                        help="where in-run evaluations generate (eval.engine)")
    parser.add_argument("--eval-compare", action="store_true",
                        help="instead of the modes table: fully async with evaluation every --eval-every steps vs "
                             "only after the last step, trainer idle side by side")
    parser.add_argument("--model", choices=("tiny", "smollm2-135m-instruct"), default="tiny",
                        help="smollm2-135m-instruct: configs/smollm2-steps.toml's generation-heavy workload "
                             "(--batch prompts x 4 samples; add fully_async_2 to --modes for two producers)")
    parser.add_argument("--gains", action="store_true",
                        help="--targets are gains over each run's starting accuracy, not accuracies")
    parser.add_argument("--out", default=None, help="default: bench/results/modes.md (modes_smollm2.md for SmolLM2)")
    args = parser.parse_args(argv)
    args.out = args.out or str(Path(__file__).parent / "results" / ("modes.md" if args.model == "tiny" else "modes_smollm2.md"))

    import torch

    from miles_core.config import ModelConfig
    from miles_core.models import ensure_model

    if args.engine == "server" and hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {0})  # the trainer's core; the engine server takes core 1
    torch.set_num_threads(1)
    model = ModelConfig() if args.model == "tiny" else ModelConfig(path=args.model)
    model_dir = str(ensure_model(model, log=lambda *a: print(*a, file=sys.stderr)))
    if args.eval_compare:
        return eval_compare(args, model_dir)
    stats, failed = [], []
    with tempfile.TemporaryDirectory(prefix="bench-modes-") as root:
        for mode in args.modes.split(","):
            per_seed = []
            for seed in args.seeds:
                print(f"[{mode}, seed {seed}] {args.steps} steps ...", file=sys.stderr)
                try:
                    per_seed.append(summarise(run_mode(mode, seed, model_dir, root, args), args))
                except Exception as e:  # noqa: BLE001 (one mode's failure is a result; the others still run)
                    failed.append(f"{mode} (seed {seed}) failed: {type(e).__name__}: {str(e).splitlines()[0]}")
                    print(failed[-1], file=sys.stderr)
            if per_seed:
                stats.append(combine(per_seed))
    text = render(stats, args) + "".join(f"- {line}\n" for line in failed)
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        cmd = " ".join(["python bench/modes.py", *(argv if argv is not None else sys.argv[1:])])
        f.write(f"Command: `.venv/bin/{cmd}`\n\n{text}")


def eval_compare(args: argparse.Namespace, model_dir: str) -> None:
    """Fully async with in-run evaluation vs without: does evaluation make the trainer wait?"""
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as root:
        for label, every in (("eval every %d steps" % args.eval_every, args.eval_every), ("eval after the last step only", None)):
            idle, step = [], []
            for seed in args.seeds:
                print(f"[fully_async, {label}, seed {seed}] {args.steps} steps ...", file=sys.stderr)
                rows = run_mode("fully_async", seed, model_dir, root, args, eval_every=every)["rows"][2:]
                idle.append(statistics.fmean(r["trainer_idle_fraction"] for r in rows))
                step.append(statistics.median(r["step_seconds"] for r in rows))
            results[label] = (statistics.fmean(idle), statistics.median(step))
    (on, (idle_on, step_on)), (off, (idle_off, step_off)) = results.items()
    lines = [
        f"Fully async, {args.steps} steps of {args.batch} prompts x 8, seeds {args.seeds}, engine {args.engine}, "
        f"evaluation engine {args.eval_engine} (256 held-out prompts). Trainer idle: mean over steps 3+ of the "
        "time the trainer waited for data / step time.",
        "",
        "| evaluation | trainer idle | step wall (median) |",
        "|---|---:|---:|",
        f"| {on} | {100 * idle_on:.1f}% | {step_on:.3f} s |",
        f"| {off} | {100 * idle_off:.1f}% | {step_off:.3f} s |",
        "",
        f"- evaluation increases trainer idle by at most 5 points: {'MET' if idle_on - idle_off <= 0.05 else 'NOT MET'} "
        f"({100 * (idle_on - idle_off):+.1f} points)",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).parent / "results" / f"modes-eval-{args.eval_engine}.md"
    out.write_text(f"Command: `.venv/bin/python bench/modes.py {' '.join(sys.argv[1:])}`\n\n{text}")


if __name__ == "__main__":
    main()
