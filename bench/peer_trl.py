"""Benchmark: our sync, async and fully-async runs against Hugging Face TRL's ``GRPOTrainer`` on the
same work, to the same accuracy, side by side in one invocation.

Run: ``.venv/bin/python bench/peer_trl.py [--steps 60 --seeds 0 1 2 --systems trl,sync,async,fully_async]``

The first run creates TRL's own virtual environment under ``.cache/peer-trl`` (``trl==1.16.0``
with this project's torch and transformers, about 2 minutes from the package registry); TRL runs
there, in ``bench/peer_trl_worker.py``, which imports nothing of this project.

Workload, identical for every system (``--model``): ``tiny``, the built-in warm-started tiny model
(``builtin:tiny-addition``) on toy addition with exact match; or ``smollm2-135m-instruct``,
``configs/smollm2-arith.toml``'s additions asked in words, chat-templated, rewarded by
``peer_trl_worker.answer_matches`` (the answer's last number is the label) on both sides.
``--prompts`` prompts x 8 samples a step, responses of at most ``--max-len`` tokens at
``--temperature``, GRPO (PPO clip 0.2, group-normalised advantages, token-mean loss, no KL, one
optimizer step per batch), AdamW at constant ``--lr`` with betas (0.9, 0.99), gradient clipping 1.0,
micro-batches of ``--micro-batch`` samples, fp32 (our snapshots too). TRL gets the same training rows, its defaults otherwise except
gradient checkpointing off (on by default in TRL; it only slows a model this small).

Resources: TRL and our sync run generate in the training process (TRL: ``model.generate``; ours:
the in-process transformers engine), one torch thread. Our async modes use the machine's second
core, as they are meant to: the rollout engine is a process of its own speaking SGLang's HTTP
protocol, pinned to core 1, the trainer left to the scheduler, one torch thread each (fully async:
the producer process on core 1 too). CPU-seconds are the whole process tree's (Prefect's server
included), start-up included.

Evaluation, one for all: each system saves the policy after every ``--snapshot-every`` steps;
afterwards this script scores every snapshot with the same greedy exact-match evaluation
(``miles_core.models.tiny.greedy_accuracy``) on the first ``--eval-prompts`` held-out problems.
No evaluation runs while a system trains. Training seconds: TRL's clock from the start of
``train()`` to the end of each step (snapshot saves taken out); ours: the sum of the run's step
times. Time to ``+d``: the training seconds at the first snapshot whose accuracy is at least the
starting accuracy + d (median over seeds; "n/a" if a seed never got there). Seeds are
interleaved (seed 0 of every system, then seed 1, ...) so load drifts hit all systems alike.
Writes the table to ``bench/results/peer_trl.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASKS = {
    # --model: the task, and the defaults of the flags it changes
    "tiny": {"task": "toy", "model": "builtin:tiny-addition", "prompts": 32, "max_len": 6, "lr": 1e-4,
             "temperature": 1.0, "micro_batch": 64, "snapshot_every": 5, "eval_prompts": 500, "steps": 60,
             "deltas": [0.3, 0.4, 0.45]},
    # configs/smollm2-arith.toml's workload: two-digit additions asked in words, chat template
    "smollm2-135m-instruct": {"task": "arith", "model": "smollm2-135m-instruct", "prompts": 8, "max_len": 16,
                              "lr": 1e-6, "temperature": 0.5, "micro_batch": 8, "snapshot_every": 2,
                              "eval_prompts": 200, "steps": 20, "deltas": [0.1, 0.2]},
}
ARITH = ROOT / "datasets" / "arith"
TRL_VERSION = "1.16.0"
TRL_VENV = ROOT / ".cache" / "peer-trl"
SYSTEMS = ("trl", "sync", "async", "fully_async")
ADAM_BETAS = (0.9, 0.99)


def ensure_trl_venv() -> Path:
    """TRL's interpreter, creating its virtual environment on first use (same torch and transformers
    as ours, so the comparison is of the trainers, not of library versions)."""
    import torch
    import transformers

    python = TRL_VENV / "bin" / "python"
    check = [str(python), "-c", "import trl, sys; sys.exit(trl.__version__ != %r)" % TRL_VERSION]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"creating {TRL_VENV} with trl=={TRL_VERSION} (one time, ~2 min) ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    torch_version = torch.__version__.split("+")[0]
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={torch_version}", f"trl=={TRL_VERSION}",
                    f"transformers=={transformers.__version__}"], check=True)
    return python


VARIANTS = ("tis", "notis", "lr", "beta2", "interval")  # after "+" in a system name


def parse_system(name: str) -> tuple[str, dict]:
    """``mode[+tis|+notis][+lr=X][+beta2=X][+interval=N]`` (ours) or ``trl``: the mode and the config changes."""
    base, *extras = name.split("+")
    if base not in SYSTEMS or (base == "trl" and extras):
        raise ValueError(f"unknown system {name!r}: one of {', '.join(SYSTEMS)}, ours optionally with "
                         f"+tis, +notis, +lr=X, +beta2=X, +interval=N")
    changes: dict = {}
    for extra in extras:
        key, _, value = extra.partition("=")
        if key == "tis" and not value:
            changes["use_tis"] = True
        elif key == "notis" and not value:
            changes["use_tis"] = False
        elif key in ("lr", "beta2") and value:
            changes["adam_beta2" if key == "beta2" else "lr"] = float(value)
        elif key == "interval" and value:
            changes["update_weights_interval"] = int(value)
        else:
            raise ValueError(f"system {name!r}: unknown variant {extra!r} (known: {', '.join(VARIANTS)})")
    return base, changes


def _spec(args: argparse.Namespace, seed: int, model_dir: str, out: Path) -> dict:
    return {"task": TASKS[args.model]["task"], "model": model_dir, "out": str(out), "seed": seed, "steps": args.steps,
            "snapshot_every": args.snapshot_every, "lr": args.lr, "adam_beta1": ADAM_BETAS[0],
            "adam_beta2": ADAM_BETAS[1], "clip_grad": 1.0, "micro_batch": args.micro_batch, "prompts": args.prompts,
            "samples": 8, "max_len": args.max_len, "temperature": args.temperature, "eps_clip": 0.2, "threads": 1}


def _rows(path: Path, n: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:n] if n else rows


def _run_child(cmd: list[str], log: Path) -> dict:
    """Run one system as a child process; its tree's CPU-seconds and largest peak RSS from wait4."""
    with log.open("w") as f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed (exit {proc.returncode}); last lines of {log}:\n{tail}")
    return {"cpu_seconds": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024,
            "wall": time.perf_counter() - t0}


def run_trl(python: Path, spec: dict) -> dict:
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    usage = _run_child([str(python), str(ROOT / "bench" / "peer_trl_worker.py"), str(out / "spec.json")], out / "log.txt")
    result = json.loads((out / "result.json").read_text())
    snapshots = {int(p.stem.split("-")[1]): str(p) for p in (out / "snapshots").glob("step-*.safetensors")}
    return {"seconds": result["seconds"], "snapshots": snapshots, **usage, "versions": result["versions"]}


def run_ours(system: str, spec: dict) -> dict:
    mode, changes = parse_system(system)
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps({**spec, "mode": mode, "changes": changes}))
    usage = _run_child([sys.executable, str(Path(__file__).resolve()), "--ours", str(out / "spec.json")], out / "log.txt")
    run_dir = Path((out / "run_dir.txt").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed, seconds = 0.0, []
    for r in rows:
        elapsed += r["step_seconds"]
        seconds.append(elapsed)
    snapshots = {}
    for step in _snapshot_steps(spec):
        path = run_dir / "weights" / f"v{step:06d}" / "model.safetensors"
        if not path.exists():
            raise SystemExit(f"{system}: weight version {step} is missing under {run_dir / 'weights'}")
        snapshots[step] = str(path)
    return {"seconds": seconds, "snapshots": snapshots, **usage, "staleness": max(r.get("staleness_max", 0.0) for r in rows),
            "parts": step_parts(rows)}


PARTS = {  # a part of our step: (its column, the metrics key it is the median of)
    "wait": ("waiting for rollout data", "trainer_wait_seconds"),
    "train": ("train (old logprobs, forward, backward, AdamW)", "train_seconds"),
    "push": ("weight push", "push_seconds"),
    "rollout": ("rollout (generate + reward)", "rollout_seconds"),
    "reward": ("slowest reward call", "reward_seconds_max"),
}


def step_parts(rows: list[dict]) -> dict[str, float]:
    """Where one of our steps goes: the median of each part over the steps past the first two (the
    run's metrics.jsonl rows), and what the step spent outside them (reading the batch, Prefect's
    task runs, the metrics line)."""
    rows = rows[2:] or rows
    parts = {name: statistics.median(r[key] for r in rows) for name, (_, key) in PARTS.items()
             if all(key in r for r in rows)}
    parts["step"] = statistics.median(r["step_seconds"] for r in rows)
    parts["other"] = statistics.median(r["step_seconds"] - sum(r.get(PARTS[k][1], 0.0) for k in ("wait", "train", "push"))
                                       for r in rows)
    return parts


def render_parts(results: dict[str, list[dict]]) -> list[str]:
    """The table of where our steps go (median over seeds of each run's medians)."""
    ours = {system: runs for system, runs in results.items() if system != "trl" and all("parts" in r for r in runs)}
    if not ours:
        return []
    cols = ["wait", "train", "push", "other", "rollout", "reward"]
    lines = ["", "Where our steps go (seconds, medians over the steps past the first two; a step is waiting + train + "
             "push + other; in async modes the rollout runs beside the step, in sync mode it is the wait):", "",
             "| system | step | " + " | ".join(PARTS[c][0] if c in PARTS else "other (batch read, Prefect task runs, "
                                                   "metrics)" for c in cols) + " |",
             "|---|---:|" + "---:|" * len(cols)]
    for system, runs in ours.items():
        cell = lambda c: (f"{statistics.median(r['parts'][c] for r in runs):.2f}"  # noqa: E731
                          if all(c in r["parts"] for r in runs) else "")
        lines.append(f"| {system} | {cell('step')} | " + " | ".join(cell(c) for c in cols) + " |")
    lines += ["", "Weight push: sync's rollout engine generates with the trainer's own weights (a push is a version "
              "number); async pushes a snapshot to its engine server; fully async's trainer publishes a snapshot inside "
              "its train task and the producers load it themselves, beside the trainer (no push in the step)."]
    return lines


def _snapshot_steps(spec: dict) -> list[int]:
    return sorted({*range(spec["snapshot_every"], spec["steps"] + 1, spec["snapshot_every"]), spec["steps"]})


def _pin_snapshots(weights_dir: Path, steps: list[int], done: threading.Event) -> threading.Thread:
    """Pin each snapshot step's weight version as soon as it is committed, so the run's retention
    (3 versions) keeps it for the evaluation afterwards; the rest go as in any run."""
    from miles_core.storage import WeightStore

    def watch() -> None:
        store, left = None, list(steps)
        while left and not done.is_set():
            if store is None and weights_dir.exists():
                store = WeightStore(str(weights_dir))
            if store is not None and (weights_dir / f"v{left[0]:06d}" / "_COMMITTED").exists():
                store.pin(left.pop(0), "bench")
                continue
            done.wait(0.05)

    thread = threading.Thread(target=watch, name="pin-snapshots", daemon=True)
    thread.start()
    return thread


def ours_child(spec_path: str) -> None:
    """The child process of one of our runs (``--ours SPEC``): the same workload through ``flows.train``."""
    spec = json.loads(Path(spec_path).read_text())
    mode = spec["mode"]
    import torch

    from flows.train import train
    from miles_core.config import RunConfig

    # the engine server (and the fully-async producer) on core 1; the trainer is left to the
    # scheduler (pinning it to core 0 would pin the Prefect server it starts there too)
    two_cores = mode != "sync" and hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1
    torch.set_num_threads(1)
    engine = ({"type": "sglang", "launch": "hf-server", "cpu_affinity": [1], "num_threads": 1} if two_cores
              else {"type": "hf", "num_threads": 1})
    arith = spec.get("task") == "arith"
    data = ({"type": "file", "path": str(ARITH / "train.jsonl"), "apply_chat_template": True} if arith
            else {"type": "toy", "seed": spec["seed"]})
    raw = {
        "name": f"peer-trl-{mode}",
        "run_id": "bench",
        "mode": {"type": mode, **({"producer_cpu_affinity": [1] if two_cores else None} if mode == "fully_async" else {})},
        "seed": spec["seed"],
        "model": {"path": spec["model"]},
        "data": data,
        "rollout": {"num_rollout": spec["steps"], "rollout_batch_size": spec["prompts"],
                    "n_samples_per_prompt": spec["samples"], "rollout_max_response_len": spec["max_len"],
                    "rollout_temperature": spec["temperature"],
                    **({"reward": "bench.peer_trl_worker:answer_reward"} if arith else {})},
        "train": {"lr": spec["lr"], "adam_beta1": spec["adam_beta1"], "adam_beta2": spec["adam_beta2"],
                  "clip_grad": spec["clip_grad"], "micro_batch_size": spec["micro_batch"]},
        "engine": engine,
        # the run's own evaluations (before and after training, on a separate engine, as by default)
        # are outside the training clock; the table's accuracies come from evaluate() below
        "eval": {"eval_interval": None, "num_prompts": 16 if arith else 64,
                 **({"data": {"type": "file", "path": str(ARITH / "test.jsonl"), "apply_chat_template": True}}
                    if arith else {})},
        "storage": {"root": str(Path(spec["out"]) / "runs"), "snapshot_dtype": "float32"},
    }
    changes = dict(spec.get("changes", {}))
    if "update_weights_interval" in changes:
        raw["mode"]["update_weights_interval"] = changes.pop("update_weights_interval")  # async mode's
    raw["train"].update(changes)  # use_tis, lr, adam_beta2
    cfg = RunConfig.model_validate(raw)
    done = threading.Event()
    pinning = _pin_snapshots(Path(spec["out"]) / "runs" / raw["name"] / "bench" / "weights", _snapshot_steps(spec), done)
    try:
        summary = train(cfg)
    finally:
        done.set()
        pinning.join()
    (Path(spec["out"]) / "run_dir.txt").write_text(str(summary["run_dir"]))


def evaluate(snapshots: dict[int, str], model_dir: str, rows: list[dict], max_len: int,
             task: str = "toy") -> dict[int, float]:
    """Greedy accuracy of each snapshot (step -> accuracy), one evaluator for all systems: the toy
    task's exact match, or (``arith``) the chat-templated prompt answered with its label as the last
    number (``answer_matches``, the reward both sides train with)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles_core.models.tiny import greedy_accuracy

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    score = (lambda: greedy_accuracy(model, tokenizer, rows, max_new_tokens=max_len)) if task == "toy" else \
        (lambda: _chat_accuracy(model, tokenizer, rows, max_len))
    acc = {0: score()}
    for step, path in sorted(snapshots.items()):
        state = load_file(path)
        # a snapshot without the tied head (ours leaves the copy out): the head is the new embeddings
        # then, so the old one must not be loaded over them
        fallback = {k: v for k, v in start.items() if k not in state and not (tied and k == "lm_head.weight")}
        _, unexpected = model.load_state_dict({**fallback, **state}, strict=False)
        if unexpected:
            raise SystemExit(f"{path}: tensors the model does not have: {unexpected[:5]}")
        acc[step] = score()
    return acc


def _chat_accuracy(model, tokenizer, rows: list[dict], max_len: int, batch_size: int = 50) -> float:
    import torch

    from bench.peer_trl_worker import answer_matches

    correct = 0.0
    with torch.no_grad():
        for first in range(0, len(rows), batch_size):
            chunk = rows[first : first + batch_size]
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                                   add_generation_prompt=True) for r in chunk]
            enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
            out = model.generate(**enc, do_sample=False, max_new_tokens=max_len, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
            answers = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            correct += sum(answer_matches(a, r["label"]) for a, r in zip(answers, chunk))
    return correct / len(rows)


def steps_to(acc: dict[int, float], delta: float) -> int | None:
    """The first snapshot's step at or above the starting accuracy + ``delta`` (None: never)."""
    return next((step for step in sorted(acc) if step and acc[step] >= acc[0] + delta - 1e-9), None)


def time_to(result: dict, acc: dict[int, float], delta: float) -> float | None:
    step = steps_to(acc, delta)
    return None if step is None else result["seconds"][step - 1]


def render(results: dict[str, list[dict]], args: argparse.Namespace, load: tuple[float, float], versions: dict) -> str:
    med = lambda xs: statistics.median(xs)  # noqa: E731
    fmt = lambda x: "n/a" if x is None else f"{x:.1f}"  # noqa: E731
    deltas = args.deltas
    samples = args.prompts * 8
    head = " | ".join(f"s to +{d:g} (median; per seed)" for d in deltas)
    workload = ("toy addition, built-in tiny model" if TASKS[args.model]["task"] == "toy" else
                 "two-digit additions in words (datasets/arith), SmolLM2-135M-Instruct, chat template, reward: the "
                 "answer's last number is the label")
    lines = [
        f"Workload: {workload}, {args.steps} steps of {args.prompts} prompts x 8 samples, at most "
        f"{args.max_len} response tokens, temperature {args.temperature:g}, lr {args.lr:g} constant, AdamW betas "
        f"{ADAM_BETAS}, micro-batches of {args.micro_batch}, no KL, fp32, "
        f"one torch thread a process; seeds {args.seeds}, interleaved; every {args.snapshot_every} steps scored by one "
        f"greedy evaluation on {args.eval_prompts} held-out problems."
        + (f" TRL {versions['trl']} (transformers {versions['transformers']}, torch {versions['torch']})." if versions else "")
        + f" Load average {_load_text(load)}.",
        "",
        f"| system | cores | step (median s) | completions/s | steps to +{deltas[-1]:g} (median) | {head} | "
        "accuracy start -> end (per seed) | "
        "run wall s | CPU-s per run | peak RSS MB | vs TRL, time to the last target |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(deltas) + "---|---:|---:|---:|---:|",
    ]
    to_last, to_each = {}, {}
    for system, runs in results.items():
        all_steps = [b - a for r in runs for a, b in zip([0.0, *r["seconds"]], r["seconds"])]
        steps = all_steps[2:] or all_steps  # past the first two (warm-up) when there are more
        step = med(steps)
        cells = []
        for d in deltas:
            per = [time_to(r, r["acc"], d) for r in runs]
            reached = [p for p in per if p is not None]
            m = med(reached) if len(reached) == len(per) else None
            cells.append(f"{fmt(m)} ({', '.join(fmt(p) for p in per)})")
            to_each[system, d] = m
            if d == deltas[-1]:
                to_last[system] = m
        per_steps = [steps_to(r["acc"], deltas[-1]) for r in runs]
        steps_cell = "n/a" if None in per_steps else f"{statistics.median(per_steps):g}"
        accs = ", ".join(f"{r['acc'][0]:.3f} -> {r['acc'][max(r['acc'])]:.3f}" for r in runs)
        cores = 1 if parse_system(system)[0] in ("trl", "sync") else 2
        ratio = ("1.00x" if system == "trl" else
                 "n/a" if to_last.get("trl") is None or to_last[system] is None else f"{to_last['trl'] / to_last[system]:.2f}x")
        lines.append(f"| {system} | {cores} | {step:.3f} | {samples / step:.0f} | {steps_cell} | {' | '.join(cells)} | {accs} | "
                     f"{med([r['wall'] for r in runs]):.0f} | {med([r['cpu_seconds'] for r in runs]):.0f} | {med([r['peak_rss_mb'] for r in runs]):.0f} | {ratio} |")
    lines += ["", "vs TRL: TRL's time to the last target / this system's (above 1: faster than TRL). Run wall and "
              "CPU-s per run: the whole process (tree), start-up and the end included (ours: the Prefect server, the engine and producer processes)."]
    lines += render_parts(results)
    if "trl" in to_last:
        lines += ["", "Goals: sync reaches each target in at most 0.67x TRL's training time, an async mode in "
                      "at most 0.5x:"]
        for system in results:
            if system == "trl":
                continue
            bound = 0.67 if parse_system(system)[0] == "sync" else 0.5
            for d in deltas:
                t, base = to_each[system, d], to_each["trl", d]
                ok = t is not None and base is not None and t <= bound * base
                ratio = "" if t is None or base is None else f", {t / base:.2f}x"
                lines.append(f"- {system}, +{d:g}: {'MET' if ok else 'NOT MET'} ({fmt(t)} s vs TRL {fmt(base)} s{ratio}; "
                             f"goal {bound}x)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(TASKS), default="tiny",
                        help="tiny: the toy addition task on the built-in tiny model; smollm2-135m-instruct: "
                             "configs/smollm2-arith.toml's additions in words (the flags below default per model)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--prompts", type=int, help="prompts per step (x 8 samples)")
    parser.add_argument("--max-len", type=int, help="response tokens at most")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="comma-separated: trl, sync, async, fully_async; ours may add +tis, +notis, +lr=X, "
                             "+beta2=X, +interval=N (e.g. async+notis)")
    parser.add_argument("--snapshot-every", type=int)
    parser.add_argument("--eval-prompts", type=int)
    parser.add_argument("--deltas", type=float, nargs="+", help="accuracy gains over the start to time")
    parser.add_argument("--ours", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="default: bench/results/peer_trl.md (with --render: print only)")
    parser.add_argument("--render", metavar="JSON", nargs="+",
                        help="print the table again from runs' measurements (the JSON file written beside --out), "
                             "with this script's current table; several files (runs of other seeds) are merged, "
                             "and written to --out when it is given; nothing runs")
    args = parser.parse_args(argv)
    if args.ours:
        return ours_child(args.ours)
    task = TASKS[args.model]
    for key, value in task.items():
        if key not in ("task", "model") and getattr(args, key) is None:
            setattr(args, key, value)
    if args.render:
        return render_saved(args, argv)
    args.out = args.out or str(ROOT / "bench" / "results" / "peer_trl.md")

    from miles_core.config import ModelConfig, ToyDataConfig
    from miles_core.data.toy import toy_problems
    from miles_core.models import ensure_model

    systems = args.systems.split(",")
    for system in systems:
        try:
            parse_system(system)
        except ValueError as e:
            parser.error(f"--systems: {e}")
    python = ensure_trl_venv() if "trl" in systems else None
    model_dir = str(ensure_model(ModelConfig(path=task["model"]), log=lambda *a: print(*a, file=sys.stderr)))
    held_out = (toy_problems(ToyDataConfig(), "test", args.eval_prompts) if task["task"] == "toy"
                else _rows(ARITH / "test.jsonl", args.eval_prompts))
    load_before = os.getloadavg()[0]
    results: dict[str, list[dict]] = {s: [] for s in systems}
    versions: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-peer-trl-") as work:
        for seed in args.seeds:
            for system in systems:
                print(f"[{system}, seed {seed}] {args.steps} steps ...", file=sys.stderr)
                out = Path(work) / f"{system}-{seed}"
                spec = _spec(args, seed, model_dir, out)
                if system == "trl":
                    spec["rows"] = (toy_problems(ToyDataConfig(seed=seed), "train") if task["task"] == "toy"
                                    else _rows(ARITH / "train.jsonl"))
                    r = run_trl(python, spec)
                    versions = r["versions"]
                else:
                    r = run_ours(system, spec)
                r["acc"] = evaluate(r["snapshots"], model_dir, held_out, args.max_len, task["task"])
                print(f"  train {r['seconds'][-1]:.1f} s, accuracy " +
                      " ".join(f"{s}:{a:.3f}" for s, a in sorted(r["acc"].items())), file=sys.stderr)
                results[system].append(r)
    load = (load_before, os.getloadavg()[0])
    measured = {system: [{k: v for k, v in r.items() if k != "snapshots"} for r in runs] for system, runs in results.items()}
    save(args, argv, measured, load, versions)


SAVED_ARGS = ("model", "steps", "prompts", "max_len", "lr", "temperature", "micro_batch", "seeds", "snapshot_every",
              "eval_prompts", "deltas")


def save(args: argparse.Namespace, argv: list[str] | None, measured: dict, load: tuple, versions: dict) -> None:
    """Print the table and write it to --out, the measurements beside it as JSON."""
    text = render(measured, args, load, versions)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).with_suffix(".json").write_text(json.dumps(
        {"args": {k: getattr(args, k) for k in SAVED_ARGS}, "load": load, "versions": versions, "results": measured},
        indent=1))
    cmd = " ".join(["python bench/peer_trl.py", *(argv if argv is not None else sys.argv[1:])])
    Path(args.out).write_text(f"Command: `.venv/bin/{cmd}`\n\n{text}")


def _load_text(load) -> str:
    """``(before, after)`` of one invocation, or ``[(seeds, before, after), ...]`` of merged ones."""
    if load and isinstance(load[0], (int, float)):
        return f"{load[0]:.2f} before, {load[1]:.2f} after"
    return "; ".join(f"{before:.2f} before, {after:.2f} after (seeds {', '.join(map(str, seeds))})"
                     for seeds, before, after in load)


def render_saved(args: argparse.Namespace, argv: list[str] | None) -> None:
    """--render: the table of saved measurements; several files (the same settings, other seeds) merged."""
    saved = [json.loads(Path(p).read_text()) for p in args.render]
    for other, path in zip(saved[1:], args.render[1:]):
        differ = [k for k in SAVED_ARGS if k != "seeds" and other["args"].get(k) != saved[0]["args"].get(k)]
        if differ:
            sys.exit(f"--render: {path} was measured with other settings ({', '.join(differ)}) than {args.render[0]}")
    for key, value in saved[0]["args"].items():
        setattr(args, key, value)
    args.seeds = [seed for s in saved for seed in s["args"]["seeds"]]
    repeated = sorted({seed for seed in args.seeds if args.seeds.count(seed) > 1})
    if repeated:
        sys.exit(f"--render: seeds {repeated} are in more than one file; give each run's measurements once")
    if args.out is not None and any(Path(p).resolve() == Path(args.out).with_suffix(".json").resolve()
                                    for p in args.render):
        sys.exit(f"--render: --out {args.out} would write its JSON over an input; choose another name")
    results = {system: [{**r, "acc": {int(k): v for k, v in r["acc"].items()}} for s in saved
                        for r in s["results"].get(system, [])] for system in saved[0]["results"]}
    load = [(s["args"]["seeds"], *_first_load(s["load"])) for s in saved]
    if args.out is None:
        print(render(results, args, load, saved[0]["versions"]))
    else:
        save(args, argv, results, load, saved[0]["versions"])


def _first_load(load) -> tuple[float, float]:
    """A saved file's (before, after): its own, or the widest of the files it merged."""
    if isinstance(load[0], (int, float)):
        return load[0], load[1]
    return min(part[1] for part in load), max(part[2] for part in load)


if __name__ == "__main__":
    main()
