"""Benchmark: N LoRA adapters over one shared rollout stream vs N separate single-adapter runs.

Run: ``.venv/bin/python bench/multi_lora.py [--model tiny|smollm2-135m-instruct --steps 12 --batch 32 --counts 1 2 4]``

Workload (``--model``): GRPO with LoRA (rank 8 on every linear layer), ``--steps`` steps of
``--batch`` prompts x 8 samples per adapter, the adapters differing only in learning rate, every
run fully async, held-out evaluation only after the last step.

- ``tiny`` (the default): the toy addition task with the built-in warm-started tiny model, learning
  rates 3e-3, 2e-3, 1e-3, 5e-4, ..., with the ``nonzero_reward_std`` dynamic filter (groups whose 8
  samples all score the same teach nothing and are dropped before training, so more groups are
  generated than trained, as in DAPO-style recipes); 256 held-out prompts.
- ``smollm2-135m-instruct``: ``configs/smollm2-arith.toml``'s task (additions asked in words,
  chat-templated, the math reward, temperature 0.5, micro-batches of 8) on SmolLM2-135M-Instruct,
  learning rates 2e-5, 1e-5, 5e-6, 2e-6, no dynamic filter (at temperature 0.5 most of this model's
  groups score alike, so a filter would generate several times the groups it trains), 100 held-out
  prompts; ``--variants one_base`` leaves out the trainer-each runs (N copies of the base).

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

LRS = {"tiny": [3e-3, 2e-3, 1e-3, 5e-4, 3e-4, 2e-4, 1e-4, 5e-5],
       "smollm2-135m-instruct": [2e-5, 1e-5, 5e-6, 2e-6, 1e-6, 5e-7, 2e-7, 1e-7]}
LORA = {"rank": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
ROOT = Path(__file__).resolve().parents[1]


def base_config(args: argparse.Namespace, model_dir: str, root: str, name: str) -> dict:
    if args.model == "smollm2-135m-instruct":
        return smollm2_config(args, root, name)
    return {
        "name": name,
        "seed": args.seed,
        "model": {"path": model_dir},
        "data": {"type": "toy"},
        "rollout": {"num_rollout": args.steps, "rollout_batch_size": args.batch, "n_samples_per_prompt": 8,
                    "rollout_max_response_len": 6},
        "train": {"lr": LRS["tiny"][0], "micro_batch_size": 64},
        "lora": LORA,
        "engine": {"type": "hf", "num_threads": 2},
        "eval": {"eval_interval": None, "num_prompts": 256, "skip_eval_before_train": True},
        "mode": {"type": "fully_async", "max_concurrent_samples": args.batch * 8, "max_weight_staleness": 4,
                 "dynamic_filters": ["nonzero_reward_std"]},
        "storage": {"root": root},
    }


def smollm2_config(args: argparse.Namespace, root: str, name: str) -> dict:
    """configs/smollm2-arith.toml's task as a LoRA fully-async run (data paths made absolute)."""
    from miles_core.config import RunConfig

    raw = RunConfig.read_toml(ROOT / "configs" / "smollm2-arith.toml")
    raw["data"]["path"] = str(ROOT / raw["data"]["path"])
    raw["eval"]["data"]["path"] = str(ROOT / raw["eval"]["data"]["path"])
    raw.update(name=name, seed=args.seed, lora=LORA, mode={
        "type": "fully_async", "max_concurrent_samples": args.batch * 8, "max_weight_staleness": 4})
    raw["rollout"].update(num_rollout=args.steps, rollout_batch_size=args.batch)
    raw["train"].update(lr=LRS[args.model][0], global_batch_size=args.batch * 8)
    raw["eval"].update(eval_interval=None, num_prompts=100, skip_eval_before_train=True)
    raw["storage"] = {"root": root}
    return raw


def producer_tokens(run_dir: str) -> int:
    """Response tokens the run's producers generated (every producer's state file, ``state/producer-<id>.json``)."""
    files = sorted((Path(run_dir) / "state").glob("producer*.json"))
    if not files:
        raise FileNotFoundError(f"no producer state under {run_dir}/state: did the run generate anything?")
    return sum(int(json.loads(f.read_text())["stats"]["response_tokens"]) for f in files)


def train_seconds(metrics_files: list[Path]) -> float:
    """Median seconds of one adapter's train step over the runs' metrics (steps after the first two, when a
    run has more)."""
    rows = [f.read_text().splitlines() for f in metrics_files]
    return statistics.median(json.loads(line)["train_seconds"] for lines in rows
                             for line in (lines[2:] if len(lines) > 2 else lines))


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
                                      for lr in LRS[args.model][:n]], "shared_base": shared_base}
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
    task = ("toy addition, built-in tiny model" if args.model == "tiny" else
            "configs/smollm2-arith.toml's additions in words, SmolLM2-135M-Instruct")
    held_out = 256 if args.model == "tiny" else 100
    lines = [
        f"Workload: {task}, LoRA rank 8, {args.steps} steps of {args.batch} prompts x 8 "
        f"samples per adapter, fully async{', nonzero_reward_std filter' if args.model == 'tiny' else ''}, "
        f"adapters differing in learning rate "
        f"({', '.join(f'{lr:g}' for lr in LRS[args.model][:max(args.counts)])}); seed {args.seed}; load average "
        f"{args.load_before:.2f} before, {os.getloadavg()[0]:.2f} after.",
        "",
        "| adapters | one base: wall | a trainer each: wall | separate: wall | one base / separate | "
        "a trainer each / separate | rollout tokens, one base / separate | training s: one base | a trainer each | "
        "separate |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    missing = {"accuracy": []}  # a variant left out (--variants)
    for r in rows:
        one, each, sep = r["one_base"], r.get("trainer_each", missing), r["separate"]
        each_wall, each_ratio, each_training = (
            (f"{each['wall']:.1f} s", f"{each['wall'] / sep['wall']:.2f}", f"{each['training']:.1f}") if each is not missing
            else ("not run",) * 3)
        lines.append(
            f"| {r['n']} | {one['wall']:.1f} s | {each_wall} | {sep['wall']:.1f} s | "
            f"**{one['wall'] / sep['wall']:.2f}** | {each_ratio} | "
            f"{one['tokens']:,} / {sep['tokens']:,} ({one['tokens'] / sep['tokens']:.2f}) | "
            f"{one['training']:.1f} | {each_training} | {sep['training']:.1f} |"
        )
    lines += ["", f"Held-out accuracy after training ({held_out} prompts), per adapter:", "",
              "| adapters | one base | a trainer each | separate |", "|---:|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {acc(r['one_base']['accuracy'])} | {acc(r.get('trainer_each', missing)['accuracy']) or 'not run'} | "
                     f"{acc(r['separate']['accuracy'])} |")
    tokens = [r["one_base"]["tokens"] for r in rows]
    four = next((r for r in rows if r["n"] == 4), None)
    constant = ("not checked (one N measured)" if len(tokens) < 2
                else "MET" if max(tokens) <= 1.1 * min(tokens) else "NOT MET")
    lines += ["", "Goals (from the issue):",
              f"- shared rollout tokens constant in N: {constant} ({', '.join(f'{t:,}' for t in tokens)}; within 10%)"]
    if four is not None:
        ratio = four["one_base"]["wall"] / four["separate"]["wall"]
        lines.append(f"- wall time for N = 4 <= 0.4 x 4 separate runs: {'MET' if ratio <= 0.4 else 'NOT MET'} ({ratio:.2f}x)")
        one, sep = four["one_base"], four["separate"]
        lines.append(f"  (training alone, which sharing the rollouts cannot save, is {one['training']:.0f} s of the shared "
                     f"run's {one['wall']:.0f} s, {one['training'] / sep['wall']:.2f}x of the separate runs' wall time)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=sorted(LRS), default="tiny")
    parser.add_argument("--variants", default="one_base,trainer_each", help="shared runs to measure beside the separate ones")
    parser.add_argument("--out", default=None, help="results file name under bench/results (default: multi_lora.md, "
                                                      "multi_lora_smollm2.md for SmolLM2)")
    args = parser.parse_args()
    args.load_before = os.getloadavg()[0]

    from prefect.testing.utilities import prefect_test_harness

    from miles_core.config import ModelConfig
    from miles_core.models import ensure_model

    model_dir = str(ensure_model(ModelConfig() if args.model == "tiny" else ModelConfig(path=args.model), log=lambda *_: None))
    variants = args.variants.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-multi-lora-") as root, prefect_test_harness(server_startup_timeout=120):
        separate = [run_separate(lr, args, model_dir, root) for lr in LRS[args.model][: max(args.counts)]]
        for n in args.counts:
            parts = separate[:n]
            rows.append({
                "n": n,
                **{v: run_shared(n, args, model_dir, root, shared_base=v == "one_base") for v in variants},
                "separate": {"wall": sum(p["wall"] for p in parts), "tokens": sum(p["tokens"] for p in parts),
                             "accuracy": [a for p in parts for a in p["accuracy"]],
                             "train": statistics.median(p["train"] for p in parts),
                             "training": sum(p["training"] for p in parts)},
            })
    table = render(rows, args)
    print(table)
    name = args.out or ("multi_lora.md" if args.model == "tiny" else "multi_lora_smollm2.md")
    out = Path(__file__).resolve().parent / "results" / name
    out.write_text(f"`.venv/bin/python bench/multi_lora.py {' '.join(sys.argv[1:])}`\n\n{table}\n")


if __name__ == "__main__":
    main()
