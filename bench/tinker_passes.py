"""Benchmark: one Tinker ``forward_backward`` + ``optim_step`` of an RL batch on SmolLM2-135M-Instruct
(LoRA rank 8, one torch thread), as the service's trainer cuts it into passes.

Run: ``.venv/bin/python bench/tinker_passes.py``. The batch: 8 prompts x 8 samples, 50 prompt
tokens + 16 response tokens each (random tokens; ``importance_sampling``). Rows: one pass of every
datum (the old default, 8,192 tokens a pass), passes of 512 tokens with every row computing its
prompt, and passes of 512 tokens where each group's prompt runs once (the default). Peak RSS is
the process's, so each row runs in a process of its own.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bench/tinker.py would shadow the tinker SDK: this file's folder leaves sys.path
sys.path = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
ROWS = {"one pass, prompts in every row": (8192, False), "512 tokens a pass, prompts in every row": (512, False),
        "512 tokens a pass, each prompt once (default)": (512, True)}


def one(tokens_per_pass: int, share: bool) -> dict:
    import numpy as np
    import torch

    from miles_core.config import ModelConfig
    from miles_core.models import ensure_model
    from miles_core.tinker import trainer as tm
    from miles_core.tinker.wire import Datum, ForwardBackward

    torch.set_num_threads(1)
    folder = str(ensure_model(ModelConfig(path="smollm2-135m-instruct"), log=lambda *_: None))
    rng = np.random.default_rng(0)
    data = []
    for _ in range(8):
        prompt = rng.integers(0, 49000, 50)
        for _ in range(8):
            toks = np.concatenate([prompt, rng.integers(0, 49000, 16)])
            n = len(toks) - 1
            data.append(Datum(toks[:-1], {"target_tokens": toks[1:], "advantages": rng.normal(size=n).astype(np.float32),
                                          "logprobs": -np.ones(n, np.float32)}))
    tm.MIN_SHARED_PREFIX = 8 if share else 10**9
    trainer = tm.TinkerTrainer({"base": folder}, tokens_per_pass=tokens_per_pass)
    trainer.create("client", "base", 8)
    t = time.perf_counter()
    trainer.forward_backward([ForwardBackward("client", 1, "importance_sampling", {}, False, data)])
    trainer.optim_step("client", {"learning_rate": 1e-5})
    return {"seconds": time.perf_counter() - t, "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}


def main() -> None:
    if len(sys.argv) == 3:
        print(json.dumps(one(int(sys.argv[1]), sys.argv[2] == "1")))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    load = os.getloadavg()[0]
    got = {}
    for name, (size, share) in ROWS.items():
        out = subprocess.run([sys.executable, __file__, str(size), "1" if share else "0"], env=env, cwd=ROOT,
                             capture_output=True, text=True, check=True)
        got[name] = json.loads(out.stdout.strip().splitlines()[-1])
    base = got[next(iter(ROWS))]["seconds"]
    print(f"Command: `.venv/bin/python bench/tinker_passes.py`; load average {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after.\n")
    print("| passes | forward_backward + optim_step s | vs one pass | peak RSS GB |\n|---|---:|---:|---:|")
    for name, r in got.items():
        print(f"| {name} | {r['seconds']:.1f} | {base / r['seconds']:.2f}x faster | {r['peak_gb']:.2f} |")


if __name__ == "__main__":
    main()
