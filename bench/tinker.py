"""Benchmark: the Tinker API (``miles tinker-serve``) driven by the official SDK and tinker-cookbook.

Run: ``.venv/bin/python bench/tinker.py [--parts parity,clients] [--model tiny|smollm2-135m-instruct]``
(the cookbook's environment is built on first use: ``scripts/setup-tinker-cookbook.sh``, ~1 min).

- ``parity`` (``--model tiny``): the cookbook's RL loop (``tinker_cookbook.rl.train.main``,
  unmodified; the task is ``examples/tinker_toy_rl.py``: the toy addition task of
  ``configs/toy.toml``) through the service, against ``miles train`` (sync, LoRA) on the same task
  and settings: 32 prompts x 8 samples a step, up to 6 new tokens, temperature 1, LoRA rank 8 with
  alpha 32 on every linear layer and the LM head, AdamW lr ``--lr`` with betas (0.9, 0.95), no
  gradient clipping, group-centred rewards without std normalisation (the cookbook's advantages),
  one optimizer step a batch, the same prompts at each step (the recipe reads them in order;
  ``miles train`` runs with ``rollout_shuffle`` off). Per step: mean training reward of each; the 10-step rolling means'
  mean absolute difference (goal, Miles' parity bar: <= 0.1); time per step, per
  ``forward_backward`` + ``optim_step`` (the cookbook's ``time/train_step``), samples/s.
- ``parity`` (``--model smollm2-135m-instruct``): the same, on SmolLM2-135M-Instruct and
  ``configs/smollm2-arith.toml``'s task (``examples/tinker_toy_rl.py task=arith``: additions asked in
  words, the chat template, the math reward): 8 prompts x 8 samples a step, up to 16 new tokens,
  LoRA rank 8 (alpha 32, every linear layer and the LM head), micro-batches of 8.
- ``--temperature`` (default 1) samples both loops at that temperature. At 1 they optimise the same
  thing. At any other they do not, by design of each: Tinker's ``sample`` returns the logprobs of
  the tempered distribution, and its training logprobs are the raw model's, so the cookbook's
  importance-sampling loss weighs each token by p(token) / p_T(token) and trains the raw policy;
  ``miles train`` (as Miles does) trains the tempered policy log_softmax(logits / T), on-policy.
- ``clients``: 1, 4 and 16 LoRA training clients at once (rank 8, one thread each), each
  ``--client-steps`` of ``forward_backward`` (8 datums of a fixed batch, cross-entropy) +
  ``optim_step`` after one untimed step (the SDK opens one connection per concurrent training
  call, ~45 ms each here); the wall time until all are done, as a ratio to one client's (goal: 16
  clients <= 4x one client's wall time), and how many clients' calls the service ran together.

Writes ``bench/results/tinker[_smollm2][_t<temperature>][_seed<seed>].md`` (the suffixes when not 1
and 0) and prints it, with the load average before and after.
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
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# run as a script, this file's folder comes first on sys.path, where ``import tinker`` would find
# this file instead of the SDK
sys.path = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["TINKER_TELEMETRY"] = "0"
KEY = "tml-bench-key"


@contextmanager
def service(model: str, storage: str):
    """``miles tinker-serve`` on a free port; yields its URL and process."""
    from miles_core import processes

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"MILES_TINKER_API_KEY": KEY, "OMP_NUM_THREADS": "1"})
    port = processes.free_port()
    log = open(Path(storage) / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "deployments.cli", "tinker-serve", "--base-model", model,
                             "--storage", storage, "--port", str(port), "--no-prefect"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        for line in proc.stdout:
            if "ready on" in line:
                break
        else:
            raise SystemExit(f"miles tinker-serve exited {proc.wait()}: {(Path(storage) / 'serve.log').read_text()[-2000:]}")
        yield f"http://127.0.0.1:{port}", proc
    finally:
        processes.terminate(proc)
        log.close()


def stats(url: str) -> dict:
    req = urllib.request.Request(f"{url}/api/v1/miles/stats", headers={"X-API-Key": KEY})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def cookbook_python() -> str:
    out = subprocess.run([str(ROOT / "scripts" / "setup-tinker-cookbook.sh")], capture_output=True, text=True, check=True)
    return str(ROOT / out.stdout.strip().splitlines()[-1])


def model_folder(model: str) -> str:
    from miles_core.config import ModelConfig
    from miles_core.models import ensure_model

    return str(Path(ensure_model(ModelConfig() if model == "tiny" else ModelConfig(path=model), log=lambda *_: None)).resolve())


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------- parity


def run_cookbook(args, url: str, folder: str, log_path: str) -> list[dict]:
    """The cookbook's RL loop through the service; its metrics.jsonl rows."""
    env = {**os.environ, "TINKER_API_KEY": KEY, "PYTHONPATH": str(ROOT)}
    cmd = [cookbook_python(), str(ROOT / "examples" / "tinker_toy_rl.py"), f"base_url={url}",
           f"model_name={folder}", f"log_path={log_path}", f"max_steps={args.steps}",
           f"learning_rate={args.lr}", "lora_rank=8", f"seed={args.seed}"]
    if args.model != "tiny":
        cmd += ["task=arith", "batch_size=8", "group_size=8", "max_tokens=16"]
    cmd.append(f"temperature={args.temperature}")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the cookbook's loop failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return read_jsonl(Path(log_path) / "metrics.jsonl")


def run_ours(args, folder: str, root: str) -> list[dict]:
    """``miles train`` (sync, LoRA) on the same task and settings; its metrics.jsonl rows."""
    from prefect.testing.utilities import prefect_test_harness

    from flows.train import train
    from miles_core.config import RunConfig

    tiny = args.model == "tiny"
    raw = {
        "name": "bench-tinker-parity", "seed": args.seed, "mode": "sync",
        "model": {"path": folder},
        "data": {"type": "toy"} if tiny else {"type": "file", "path": str(ROOT / "datasets" / "arith" / "train.jsonl"),
                                               "apply_chat_template": True},
        # the recipe reads the prompts in order: so does this run (the same prompts at each step)
        "rollout": {"rollout_shuffle": False, "num_rollout": args.steps, "rollout_batch_size": 32 if tiny else 8,
                    "n_samples_per_prompt": 8,
                    "rollout_max_response_len": 6 if tiny else 16, "rollout_temperature": args.temperature,
                    "reward": "toy" if tiny else "math"},
        "train": {"lr": args.lr, "adam_beta1": 0.9, "adam_beta2": 0.95, "clip_grad": 0.0,
                  "micro_batch_size": 64 if tiny else 8, "loss": {"type": "grpo", "advantage_std_normalize": False}},
        "lora": {"rank": 8, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj", "lm_head"]},
        "engine": {"type": "hf", "num_threads": 1},
        "eval": {"eval_interval": None, "skip_eval_before_train": True,
                 **({} if tiny else {"data": {"type": "file", "path": str(ROOT / "datasets" / "arith" / "test.jsonl"),
                                              "apply_chat_template": True}})},
        "storage": {"root": root},
    }
    with prefect_test_harness(server_startup_timeout=120):
        summary = train(RunConfig.model_validate(raw))
    return read_jsonl(Path(summary["run_dir"]) / "metrics.jsonl")


def rolling(xs: list[float], n: int = 10) -> list[float]:
    return [statistics.fmean(xs[max(0, i - n + 1): i + 1]) for i in range(len(xs))]


def parity(args, root: str) -> str:
    folder = model_folder(args.model)
    with service("tiny-addition" if args.model == "tiny" else args.model, tempfile.mkdtemp(dir=root)) as (url, _):
        t0 = time.monotonic()
        cook = run_cookbook(args, url, folder, str(Path(root) / "cookbook"))
        cook_wall = time.monotonic() - t0
    c_reward = [r["env/all/reward/total"] for r in cook]
    lines = [f"Cookbook loop through the service: {len(cook)} steps in {cook_wall:.0f} s (its start-up included); "
             f"step {statistics.median(r['time/total'] for r in cook):.2f} s, forward_backward + optim_step "
             f"{statistics.median(r['time/train_step'] for r in cook):.2f} s, sampling "
             f"{statistics.median(r['time/sampling'] for r in cook):.2f} s "
             f"(medians); samples/s {statistics.median(_samples(r) / r['time/sampling'] for r in cook):.0f}.", ""]
    ours = run_ours(args, folder, root)
    o_reward = [r["reward_mean"] for r in ours]
    n = min(len(c_reward), len(o_reward))
    rc, ro = rolling(c_reward[:n]), rolling(o_reward[:n])
    gap = statistics.fmean(abs(a - b) for a, b in zip(rc, ro))
    lines.insert(1, f"`miles train` (sync, LoRA): step {statistics.median(r['train_seconds'] + r['rollout_seconds'] for r in ours):.2f} s, "
                    f"train {statistics.median(r['train_seconds'] for r in ours):.2f} s, rollout "
                    f"{statistics.median(r['rollout_seconds'] for r in ours):.2f} s (medians).")
    lines += ["| step | cookbook reward | miles train reward | cookbook, 10-step mean | miles train, 10-step mean |",
              "|---:|---:|---:|---:|---:|"]
    lines += [f"| {i + 1} | {c_reward[i]:.3f} | {o_reward[i]:.3f} | {rc[i]:.3f} | {ro[i]:.3f} |" for i in range(n)]
    verdict = "MET" if gap <= 0.1 else "NOT MET"
    lines += ["", f"Mean absolute difference of the 10-step rolling means: **{gap:.3f}** (goal <= 0.1: {verdict})."]
    return "\n".join(lines)


def _samples(row: dict) -> float:
    return row["env/all/total_episodes"]


# ------------------------------------------------------------------------------------------ clients


def clients(args, root: str) -> str:
    import tinker
    from tinker import types

    model = "tiny-addition" if args.model == "tiny" else args.model
    rows = []
    with service(model, tempfile.mkdtemp(dir=root)) as (url, proc):
        with tinker.ServiceClient(base_url=url, api_key=KEY) as sc:
            first = sc.create_lora_training_client(base_model=model, rank=8).result()
            tok = first.get_tokenizer()
            text = "12+34=46\n" if args.model == "tiny" else "What is 12 + 34? The answer is 46."
            tokens = tok.encode(text)
            datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
            batch = [datum] * 8
            step(first, batch, types)  # the first pass of a process is slow: not in any timing
        for n in args.clients:
            # a session per row: when it ends, the service stops waiting for its clients' calls
            with tinker.ServiceClient(base_url=url, api_key=KEY) as sc:
                rows.append({"n": n, **_concurrent(sc, model, n, batch, args.client_steps, url, proc.pid)})
    one = rows[0]["wall"]
    lines = [f"{args.client_steps} steps per client (forward_backward of 8 datums x {len(tokens) - 1} tokens + "
             "optim_step), LoRA rank 8.", "",
             "| clients | wall s | vs one client | clients per fused pass (mean) | ms a round: wall | "
             "CPU, SDK (the clients' process) | CPU, service |", "|---:|---:|---:|---:|---:|---:|---:|"]
    per_round = 1000 / args.client_steps
    lines += [f"| {r['n']} | {r['wall']:.2f} | {r['wall'] / one:.2f}x | {r['fused']:.1f} | {r['wall'] * per_round:.0f} | "
              f"{r['sdk_cpu'] * per_round:.0f} | {r['service_cpu'] * per_round:.0f} |" for r in rows]
    last = rows[-1]
    verdict = "MET" if last["wall"] <= 4 * one else "NOT MET"
    lines += ["", f"Goal: {last['n']} clients <= 4x one client's wall time: {verdict} ({last['wall'] / one:.2f}x).",
              "", "A round: every client's `forward_backward` + `optim_step`. CPU: process CPU time (all threads) "
              "during the timed steps, per round; two cores are all there is for both processes."]
    return "\n".join(lines)


def _concurrent(sc, model: str, n: int, batch: list, steps: int, url: str, service_pid: int) -> dict:
    """``n`` new training clients, each on its own thread, ``steps`` steps each after one untimed
    step; the wall time of the timed steps, the CPU time of this process (the SDK) and of the
    service meanwhile, and the clients per fused pass."""
    import psutil
    from tinker import types

    service_proc = psutil.Process(service_pid)

    def cpu(p) -> float:
        t = p.cpu_times()
        return t.user + t.system

    tcs = [sc.create_lora_training_client(base_model=model, rank=8, seed=k).result() for k in range(n)]
    ready, go = threading.Barrier(n + 1), threading.Barrier(n + 1)

    def run(tc) -> None:
        step(tc, batch, types)  # untimed: the SDK opens a connection per concurrent training call
        ready.wait()
        go.wait()
        for _ in range(steps):
            step(tc, batch, types)

    threads = [threading.Thread(target=run, args=(tc,)) for tc in tcs]
    for t in threads:
        t.start()
    ready.wait()
    before = len(stats(url)["fused_sizes"])
    me = psutil.Process()
    sdk0, service0 = cpu(me), cpu(service_proc)
    go.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    sdk_cpu, service_cpu = cpu(me) - sdk0, cpu(service_proc) - service0
    sizes = stats(url)["fused_sizes"][before:]
    return {"wall": wall, "fused": statistics.fmean(sizes) if sizes else 0.0, "sdk_cpu": sdk_cpu, "service_cpu": service_cpu}


def step(tc, batch, types) -> None:
    tc.forward_backward(batch, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="parity,clients")
    p.add_argument("--model", default="tiny", choices=["tiny", "smollm2-135m-instruct"])
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: 40 tiny, 20 SmolLM2)")
    p.add_argument("--lr", type=float, default=None, help="default: 1e-3 tiny, 4e-4 SmolLM2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature of both loops (default 1: at any other, the two optimise different "
                        "things, see the module docstring)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--client-steps", type=int, default=30)
    args = p.parse_args()
    args.steps = args.steps or (40 if args.model == "tiny" else 20)
    args.lr = args.lr or (1e-3 if args.model == "tiny" else 4e-4)
    load_before = os.getloadavg()[0]
    sections = []
    with tempfile.TemporaryDirectory(prefix="bench-tinker-") as root:
        if "clients" in args.parts:  # first: the parity part's Prefect server leaves work behind it
            sections.append("### Concurrent training clients\n\n" + clients(args, root))
            print(sections[-1], file=sys.stderr, flush=True)
        if "parity" in args.parts:
            sections.insert(0, "### The cookbook's RL loop through the service\n\n" + parity(args, root))
            print(sections[0], file=sys.stderr, flush=True)
    from importlib.metadata import version

    head = (f"Command: `.venv/bin/python bench/tinker.py {' '.join(sys.argv[1:])}`\n\n"
            f"Model: {args.model}; tinker {version('tinker')}; load average {load_before:.2f} before, "
            f"{os.getloadavg()[0]:.2f} after.\n\n")
    text = head + "\n\n".join(sections) + "\n"
    print(text)
    name = ("tinker" if args.model == "tiny" else "tinker_smollm2") + \
        ("" if args.temperature == 1.0 else f"_t{args.temperature:g}") + ("" if args.seed == 0 else f"_seed{args.seed}") + ".md"
    (ROOT / "bench" / "results" / name).write_text(text)


if __name__ == "__main__":
    main()
