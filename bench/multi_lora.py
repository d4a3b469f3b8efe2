"""Benchmark: N LoRA adapters over one shared rollout stream vs N separate single-adapter runs.

Run: ``.venv/bin/python bench/multi_lora.py [--steps 12 --batch 32 --counts 1 2 4]``

Workload: GRPO with LoRA (rank 8 on every linear layer) on the toy addition task with the built-in
warm-started tiny model, ``--steps`` steps of ``--batch`` prompts x 8 samples per adapter, the
adapters differing only in learning rate (3e-3, 2e-3, 1e-3, 5e-4, ...), every run fully async,
with the ``nonzero_reward_std`` dynamic filter (groups whose 8 samples all score the same teach
nothing and are dropped before training, so more groups are generated than trained, as in
DAPO-style recipes); held-out evaluation only after the last step (256 prompts).

- one base, N adapters: one ``train-multi-lora`` run (``rollout_source = "shared"``: generated once
  by the base, every adapter trains on every group), the adapters on one copy of the base, their
  steps fused (``multi_lora.shared_base``, the default);
- a trainer each: the same run with ``shared_base = false``: one trainer and one base copy per
  adapter, each stepping on its own thread (how multi-LoRA runs trained before the shared base);
- separate, N adapters: N ``train`` runs with LoRA, one after the other, one per learning rate.

Per N it prints the wall time of the runs (from their start to their summary, Prefect's server
start excluded), the ratios to the separate runs, the tokens the rollout engine generated (every
finished sample, kept or filtered), the seconds of training (the sum over steps of the slowest
adapter's step: what the run spent training), and each adapter's held-out accuracy after training. Goal (from the
issue): rollout tokens constant in N for shared runs, and wall time for N = 4 at most 0.4 x that of
4 separate runs. Writes the table to ``bench/results/multi_lora.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LRS = [3e-3, 2e-3, 1e-3, 5e-4, 3e-4, 2e-4, 1e-4, 5e-5]
LORA = {"rank": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def base_config(args: argparse.Namespace, model_dir: str, root: str, name: str) -> dict:
    return {
        "name": name,
        "seed": args.seed,
        "model": {"path": model_dir},
        "data": {"type": "toy"},
        "rollout": {"num_rollout": args.steps, "rollout_batch_size": args.batch, "n_samples_per_prompt": 8,
                    "rollout_max_response_len": 6},
        "train": {"lr": LRS[0], "micro_batch_size": 64},
        "lora": LORA,
        "engine": {"type": "hf", "num_threads": 2},
        "eval": {"eval_interval": None, "num_prompts": 256, "skip_eval_before_train": True},
        "mode": {"type": "fully_async", "max_concurrent_samples": args.batch * 8, "max_weight_staleness": 4,
                 "dynamic_filters": ["nonzero_reward_std"]},
        "storage": {"root": root},
    }


def producer_tokens(run_dir: str) -> int:
    """Response tokens the run's producers generated (every producer's state file, ``state/producer-<id>.json``)."""
    files = sorted((Path(run_dir) / "state").glob("producer*.json"))
    if not files:
        raise FileNotFoundError(f"no producer state under {run_dir}/state: did the run generate anything?")
    return sum(int(json.loads(f.read_text())["stats"]["response_tokens"]) for f in files)


def train_seconds(metrics_files: list[Path]) -> float:
    """Median seconds of one adapter's train step (steps after the first two) over the runs' metrics."""
    times = [json.loads(line)["train_seconds"] for f in metrics_files for line in f.read_text().splitlines()[2:]]
    return statistics.median(times)


def training_seconds(metrics_files: list[Path]) -> float:
    """Seconds the run spent training: per step, the slowest adapter's train time, summed over steps."""
    per_step: dict[int, float] = {}
    for f in metrics_files:
        for line in f.read_text().splitlines():
            row = json.loads(line)
            per_step[row["step"]] = max(per_step.get(row["step"], 0.0), row["train_seconds"])
    return sum(per_step.values())


def run_shared(n: int, args, model_dir: str, root: str, shared_base: bool) -> dict:
    from flows.multi_lora import train_multi_lora
    from miles_core.config import RunConfig

    raw = base_config(args, model_dir, root, f"bench-{'one-base' if shared_base else 'trainer-each'}-{n}")
    raw["multi_lora"] = {"adapters": [{"name": f"lr-{lr:.0e}".replace("e-0", "e-"), "train": {"lr": lr}}
                                      for lr in LRS[:n]], "shared_base": shared_base}
    summary = train_multi_lora(RunConfig.model_validate(raw))
    files = [Path(a["folder"]) / "metrics.jsonl" for a in summary["adapters"]]
    return {"wall": summary["seconds"], "tokens": producer_tokens(summary["run_dir"]),
            "accuracy": [a["accuracy_after"] for a in summary["adapters"]],
            "train": train_seconds(files), "training": training_seconds(files)}


def run_separate(lr: float, args, model_dir: str, root: str) -> dict:
    from flows.train import train
    from miles_core.config import RunConfig

    raw = base_config(args, model_dir, root, f"bench-separate-{lr:.0e}")
    raw["train"]["lr"] = lr
    summary = train(RunConfig.model_validate(raw))
    files = [Path(summary["run_dir"]) / "metrics.jsonl"]
    return {"wall": summary["seconds"], "tokens": producer_tokens(summary["run_dir"]),
            "accuracy": [summary["accuracy_after"]], "train": train_seconds(files), "training": training_seconds(files)}


def render(rows: list[dict], args) -> str:
    acc = lambda xs: ", ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    lines = [
        f"Workload: toy addition, built-in tiny model, LoRA rank 8, {args.steps} steps of {args.batch} prompts x 8 "
        f"samples per adapter, fully async, nonzero_reward_std filter, adapters differing in learning rate "
        f"({', '.join(f'{lr:g}' for lr in LRS[:max(args.counts)])}); seed {args.seed}; load average "
        f"{args.load_before:.2f} before, {os.getloadavg()[0]:.2f} after.",
        "",
        "| adapters | one base: wall | a trainer each: wall | separate: wall | one base / separate | "
        "a trainer each / separate | rollout tokens, one base / separate | training s: one base | a trainer each | "
        "separate |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        one, each, sep = r["one_base"], r["trainer_each"], r["separate"]
        lines.append(
            f"| {r['n']} | {one['wall']:.1f} s | {each['wall']:.1f} s | {sep['wall']:.1f} s | "
            f"**{one['wall'] / sep['wall']:.2f}** | {each['wall'] / sep['wall']:.2f} | "
            f"{one['tokens']:,} / {sep['tokens']:,} ({one['tokens'] / sep['tokens']:.2f}) | "
            f"{one['training']:.1f} | {each['training']:.1f} | {sep['training']:.1f} |"
        )
    lines += ["", "Held-out accuracy after training (256 prompts), per adapter:", "",
              "| adapters | one base | a trainer each | separate |", "|---:|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {acc(r['one_base']['accuracy'])} | {acc(r['trainer_each']['accuracy'])} | "
                     f"{acc(r['separate']['accuracy'])} |")
    tokens = [r["one_base"]["tokens"] for r in rows]
    four = next((r for r in rows if r["n"] == 4), None)
    lines += ["", "Goals (from the issue):",
              f"- shared rollout tokens constant in N: {'MET' if max(tokens) <= 1.1 * min(tokens) else 'NOT MET'} "
              f"({', '.join(f'{t:,}' for t in tokens)}; within 10%)"]
    if four is not None:
        ratio = four["one_base"]["wall"] / four["separate"]["wall"]
        lines.append(f"- wall time for N = 4 <= 0.4 x 4 separate runs: {'MET' if ratio <= 0.4 else 'NOT MET'} ({ratio:.2f}x)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.load_before = os.getloadavg()[0]

    from prefect.testing.utilities import prefect_test_harness

    from miles_core.config import ModelConfig
    from miles_core.models import ensure_model

    model_dir = str(ensure_model(ModelConfig(), log=lambda *_: None))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-multi-lora-") as root, prefect_test_harness(server_startup_timeout=120):
        separate = [run_separate(lr, args, model_dir, root) for lr in LRS[: max(args.counts)]]
        for n in args.counts:
            parts = separate[:n]
            rows.append({
                "n": n,
                "one_base": run_shared(n, args, model_dir, root, shared_base=True),
                "trainer_each": run_shared(n, args, model_dir, root, shared_base=False),
                "separate": {"wall": sum(p["wall"] for p in parts), "tokens": sum(p["tokens"] for p in parts),
                             "accuracy": [a for p in parts for a in p["accuracy"]],
                             "train": statistics.median(p["train"] for p in parts),
                             "training": sum(p["training"] for p in parts)},
            })
    table = render(rows, args)
    print(table)
    out = Path(__file__).resolve().parent / "results" / "multi_lora.md"
    out.write_text(f"`.venv/bin/python bench/multi_lora.py {' '.join(sys.argv[1:])}`\n\n{table}\n")


if __name__ == "__main__":
    main()
