"""Benchmark: one train step of the same batch with every trainer backend, side by side, in one run.

Run: ``.venv/bin/python bench/train_step.py [--steps 5 --prompts 8 --hidden 384 --layers 4]``

``--profile``: instead, where one step of the demo's run goes, part by part, beside the bare-torch
limit (``bench/step_profile.py``; writes ``bench/results/train_step_profile.md``).

The batch: ``--prompts`` groups of 8 samples (prompt 32 tokens, responses of 16-64 tokens, 0/1
rewards; random tokens, seeded), one optimizer step per train step (the whole batch), micro-batches
of ``--micro-batch`` samples, old logprobs recomputed (one no-grad forward pass), fp32 unless the case says bf16.
The model: an untrained Llama-config model of ``--hidden`` x ``--layers`` (built once, cached).

Every case runs in a fresh process (so one case's memory is not another's): it builds the
trainer, takes one warm-up step (the optimizer state is allocated there), resets the peak-RSS
counters of its process tree (``/proc/<pid>/clear_refs``), then times ``--steps`` steps. Reported:

- tokens/s: tokens through the model per step (prompt + response of every sample), over the
  median step time;
- peak RSS: the largest resident set of the trainer's processes during the timed steps, summed
  over them (the case's own process, plus for launched ranks the launcher and every rank), and
  the largest single process. A ``baseline`` row is the same interpreter with torch,
  transformers and DeepSpeed imported and no model, for scale.

Threads: a one-process case gets both cores (2 torch threads); a two-process case gets one
thread per rank. Writes the table to ``bench/results/train_step.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

GROUP = 8
PROMPT_LEN = 32

# (name, train.backend, LoRA?, processes)
CASES = [
    ("torch", {"type": "torch"}, False),
    ("torch + LoRA", {"type": "torch"}, True),
    ("deepspeed ZeRO-0", {"type": "deepspeed", "zero_stage": 0}, False),
    ("deepspeed ZeRO-1", {"type": "deepspeed", "zero_stage": 1}, False),
    ("deepspeed ZeRO-2", {"type": "deepspeed", "zero_stage": 2}, False),
    ("deepspeed ZeRO-3", {"type": "deepspeed", "zero_stage": 3}, False),
    ("deepspeed ZeRO-2 bf16", {"type": "deepspeed", "zero_stage": 2, "precision": "bf16"}, False),
    ("deepspeed ZeRO-2 + LoRA", {"type": "deepspeed", "zero_stage": 2}, True),
    ("deepspeed ZeRO-2, 2 processes", {"type": "deepspeed", "zero_stage": 2, "num_processes": 2}, False),
    ("deepspeed ZeRO-3, 2 processes", {"type": "deepspeed", "zero_stage": 3, "num_processes": 2}, False),
]
LORA = {"rank": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


# ------------------------------------------------------------------------------------ the case


def make_batch(num_prompts: int, vocab: int, seed: int):
    import random

    from miles_core.train.base import TrainBatch
    from miles_core.types import Group, Sample

    rng = random.Random(seed)
    groups = []
    for g in range(num_prompts):
        prompt = [rng.randrange(2, vocab) for _ in range(PROMPT_LEN)]
        samples = []
        for j in range(GROUP):
            response = [rng.randrange(2, vocab) for _ in range(rng.randint(16, 64))]
            samples.append(Sample(f"p{g}", prompt, response, reward=float(rng.random() < 0.5),
                                  loss_mask=[1] * len(response), group_index=g, sample_index=j))
        groups.append(Group(samples))
    return TrainBatch.from_groups(groups, temperature=1.0)


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reset_peaks(pids: list[int]) -> None:
    for pid in pids:
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := current RSS
        except OSError:
            pass


def run_case(spec: dict) -> dict:
    import torch

    from miles_core.config import LoraConfig, TrainConfig
    from miles_core.train import setup_trainer

    torch.set_num_threads(spec["threads"])
    if spec.get("baseline"):
        import deepspeed  # noqa: F401
        import transformers  # noqa: F401

        rss = _status_kib(os.getpid(), "VmRSS") / 1024
        return {"peak_rss_mib": rss, "peak_rss_max_mib": rss, "processes": 1}
    cfg = TrainConfig(backend=spec["backend"], micro_batch_size=spec["micro_batch"], lr=1e-5, seed=0)
    lora = LoraConfig(**LORA) if spec["lora"] else None
    from miles_core.storage.weights import WeightStore

    store = WeightStore(tempfile.mkdtemp(prefix="bench-weights-"))  # launched ranks open it too; steps never publish
    trainer = setup_trainer(cfg, spec["model_dir"], store, "float32", lora=lora)
    batch = make_batch(spec["prompts"], spec["vocab"], seed=0)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch.samples)
    try:
        trainer.step(batch)  # warm-up: optimizer state, DeepSpeed buckets
        pids = _tree(os.getpid())
        _reset_peaks(pids)
        times = []
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            metrics = trainer.step(batch)
            times.append(time.perf_counter() - t0)
        peaks = [_status_kib(p, "VmHWM") / 1024 for p in _tree(os.getpid())]
    finally:
        close = getattr(trainer, "close", None)
        if close is not None:
            close()
    step_s = statistics.median(times)
    return {"step_s": step_s, "tokens_per_s": tokens / step_s, "tokens": tokens, "loss": metrics["loss"],
            "peak_rss_mib": sum(peaks), "peak_rss_max_mib": max(peaks), "processes": len(peaks)}


# ------------------------------------------------------------------------------------- driver


def bench_model(hidden: int, layers: int) -> tuple[str, int]:
    from miles_core.config import TinyModelRecipe
    from miles_core.models.tiny import build_untrained

    folder = ROOT / ".cache" / "miles" / f"bench-model-h{hidden}-l{layers}"
    if not (folder / "config.json").exists():
        recipe = TinyModelRecipe(hidden_size=hidden, num_layers=layers, num_heads=max(1, hidden // 64),
                                 intermediate_size=hidden * 8 // 3)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        build_untrained(recipe, tmp)
        os.replace(tmp, folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    return str(folder), vocab


def run_in_subprocess(spec: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        proc = subprocess.run([sys.executable, __file__, "--case", json.dumps(spec), "--out", out.name],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
            return {"error": f"exit {proc.returncode}: {tail}"}
        return json.loads(Path(out.name).read_text())


def _params(model_dir: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case (after one warm-up step)")
    parser.add_argument("--prompts", type=int, default=8, help="groups of 8 samples in the batch")
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=16, help="samples per forward/backward pass")
    parser.add_argument("--only", nargs="*", help="run only cases whose name contains one of these")
    parser.add_argument("--profile", action="store_true",
                        help="break one training step of the demo's model into its parts (bench/step_profile.py)")
    parser.add_argument("--model", default="tiny", help="--profile: tiny (the demo's) or smollm2-135m-instruct")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        Path(args.out).write_text(json.dumps(run_case(json.loads(args.case))))
        return
    if args.profile:
        import step_profile

        table = step_profile.main(args.steps, args.model)
        print(table)
        suffix = "" if args.model == "tiny" else "_smollm2"
        out = ROOT / "bench" / "results" / f"train_step_profile{suffix}.md"
        out.write_text(f"`.venv/bin/python bench/train_step.py {' '.join(sys.argv[1:])}`\n\n{table}\n")
        return

    model_dir, vocab = bench_model(args.hidden, args.layers)
    common = {"model_dir": model_dir, "vocab": vocab, "prompts": args.prompts, "steps": args.steps,
              "micro_batch": args.micro_batch}
    rows = [("baseline (imports, no model)", run_in_subprocess({**common, "baseline": True, "threads": 2}))]
    for name, backend, lora in CASES:
        if args.only and not any(o in name for o in args.only):
            continue
        threads = 1 if backend.get("num_processes", 1) > 1 else 2
        print(f"... {name}", file=sys.stderr, flush=True)
        rows.append((name, run_in_subprocess({**common, "backend": backend, "lora": lora, "threads": threads})))

    ref = next((r for n, r in rows if n == "torch" and "error" not in r), None)
    batch_tokens = next((r["tokens"] for _, r in rows if "tokens" in r), 0)
    lines = [
        f"Model: untrained Llama-config, hidden {args.hidden}, {args.layers} layers, "
        f"{_params(model_dir) / 1e6:.1f}M parameters, fp32 master weights. Batch: {args.prompts} x {GROUP} samples, "
        f"{batch_tokens} tokens, one optimizer step, micro-batch {args.micro_batch}. Median of {args.steps} steps "
        f"after a warm-up step. LoRA: rank {LORA['rank']} on every linear layer.",
        "",
        "| trainer | step (s) | tokens/s | vs torch | peak RSS, all processes (MiB) | largest process (MiB) | processes | loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        if "error" in r:
            reason = next((ln for ln in reversed(r["error"].splitlines()) if "Error" in ln), "see stderr")
            lines.append(f"| {name} | failed: {reason.strip()[:120]} | | | | | | |")
            continue
        if "step_s" not in r:
            lines.append(f"| {name} | | | | {r['peak_rss_mib']:.0f} | {r['peak_rss_max_mib']:.0f} | 1 | |")
            continue
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "n/a"
        lines.append(f"| {name} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {ratio} | {r['peak_rss_mib']:.0f} | "
                     f"{r['peak_rss_max_mib']:.0f} | {r['processes']} | {r['loss']:.5f} |")
    table = "\n".join(lines)
    print(table)
    out = ROOT / "bench" / "results" / "train_step.md"
    out.write_text(f"`.venv/bin/python bench/train_step.py {' '.join(sys.argv[1:])}`\n\n{table}\n")
    for name, r in rows:
        if "error" in r:
            print(f"\n{name} failed:\n{r['error']}", file=sys.stderr)


if __name__ == "__main__":
    main()
