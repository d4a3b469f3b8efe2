"""The body of ``scripts/gpu_check.sh`` (see there): per installed engine, the contract, a measurement,
and a 20-step fully-async run; a summary table at the end. Exit code 1 when any step failed."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu"), str(ROOT / "bench")]

from engines import new_snapshot  # noqa: E402 (bench/engines.py: the weights x 1.01 as a snapshot)
from test_engine_servers import SGLangServer, engine_python  # noqa: E402

from miles_core.config import ModelConfig, SGLangEngineConfig, VLLMEngineConfig  # noqa: E402
from miles_core.engines.base import GenerateRequest, SamplingParams  # noqa: E402

GPU_MEMORY = ["--gpu-memory-utilization", "0.3"]


def contract(engine: str, python: str) -> bool:
    cls = {"sglang": "TestSGLangServerContract", "vllm": "TestVLLMServerContract"}[engine]
    env = {**os.environ, f"MILES_{engine.upper()}_PYTHON": python}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"tests/gpu/test_engine_servers.py::{cls}"]
    print(f"[{engine}] engine contract: {' '.join(cmd[1:])}", flush=True)
    return subprocess.run(cmd, env=env, cwd=ROOT, timeout=200).returncode == 0


def measure(engine: str, python: str, model: str) -> tuple[dict, object]:
    """Tokens/s at 64 concurrent requests of 128 tokens, and the weight-push pause; the running
    server (for the run), or (results, None)."""
    from transformers import AutoTokenizer

    if engine == "vllm":
        from miles_core.engines.vllm import SERVED_NAME, LocalVLLMServer, VLLMEngine

        cfg = VLLMEngineConfig(python=python, max_model_len=512, extra_args=GPU_MEMORY)
        server = LocalVLLMServer(model, cfg).start()
        client = VLLMEngine(server.url, cfg, model=SERVED_NAME, model_dir=model)
    else:
        from miles_core.engines.sglang import SGLangEngine

        server = SGLangServer(python, model).start()
        client = SGLangEngine(server.url, SGLangEngineConfig(url=server.url, coalesce_window_s=0))
    tok = AutoTokenizer.from_pretrained(model)
    prompt = tok.encode("37+45=")

    async def body() -> dict:
        reqs = [GenerateRequest(prompt, SamplingParams(max_new_tokens=128, temperature=1.0, seed=i)) for i in range(64)]
        await client.generate(reqs[:4])  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(client.generate([q]) for q in reqs))
        wall = time.perf_counter() - t0
        generated = sum(len(r.output_ids) for (r,) in results)
        folder = new_snapshot(model, Path(tempfile.mkdtemp(prefix="gpu-check-")) / "v1")
        push0 = time.perf_counter()
        await client.update_weights(folder, 1)
        (first,) = await client.generate([GenerateRequest(prompt, SamplingParams(max_new_tokens=1))])
        pause = time.perf_counter() - push0
        assert first.weight_version == 1, first
        await client.update_weights(model, 0)
        await client.close()
        return {"tok_s": generated / wall, "push_ms": 1000 * pause}

    return asyncio.run(body()), server


def toy_run(engine: str, python: str, server) -> dict | None:
    """20 fully-async steps of the toy task with ``engine`` generating (vLLM: launched by the run)."""
    runs = Path(tempfile.mkdtemp(prefix="gpu-check-runs-"))
    if engine == "vllm":
        eng = {"type": "vllm", "python": python, "max_model_len": 64, "extra_args": GPU_MEMORY}
        extra = []
    else:
        eng = {"type": "sglang", "url": server.url}
        extra = ["--set", "eval.engine_config=" + json.dumps(eng)]
    cmd = [str(ROOT / ".venv" / "bin" / "miles"), "train", "--config", "configs/toy.toml", "--fully-async",
           "--num-rollout", "20", "--storage-root", str(runs), "--set", "engine=" + json.dumps(eng), *extra]
    print(f"[{engine}] 20-step fully-async run: {' '.join(cmd[1:])}", flush=True)
    done = subprocess.run(cmd, cwd=ROOT, timeout=240)
    summaries = sorted(runs.glob("*/*/summary.json"))
    if done.returncode != 0 or not summaries:
        return None
    return json.loads(summaries[-1].read_text())


def main() -> int:
    from miles_core.models import ensure_model

    model = sys.argv[1] if len(sys.argv) > 1 else str(ensure_model(ModelConfig(), log=lambda *_: None))
    rows, ok = [], True
    for engine in ("sglang", "vllm"):
        python = engine_python(engine)
        if python is None:
            print(f"[{engine}] skipped: not installed (set MILES_{engine.upper()}_PYTHON to a Python with {engine})")
            continue
        version = subprocess.run([python, "-c", f"import {engine}; print({engine}.__version__)"],
                                 capture_output=True, text=True).stdout.strip()
        row = {"engine": f"{engine} {version}", "contract": contract(engine, python)}
        server = None
        try:
            numbers, server = measure(engine, python, model)
            row.update(numbers)
            summary = toy_run(engine, python, server)
            row["run"] = None if summary is None else f"{summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}"
        except Exception as e:  # noqa: BLE001 (reported in the table, and the exit code)
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            if server is not None:
                server.stop()
        ok &= row["contract"] and "error" not in row and row.get("run") is not None
        rows.append(row)
    print("\n| engine | contract | tok/s (64 x 128 tokens) | weight push (ms) | 20-step fully-async run |")
    print("|---|---|---:|---:|---|")
    for r in rows:
        tok_s = f"{r['tok_s']:,.0f}" if "tok_s" in r else r.get("error", "")
        push = f"{r['push_ms']:.0f}" if "push_ms" in r else ""
        print(f"| {r['engine']} | {'passed' if r['contract'] else 'FAILED'} | {tok_s} | {push} | {r.get('run') or 'FAILED'} |")
    if not rows:
        print("gpu_check: skipped: neither sglang nor vllm is installed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
