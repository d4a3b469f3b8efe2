"""SmolLM2-135M-Instruct's arithmetic config on one device: the transformers engine and the torch
trainer in bf16, no Prefect. Prints generation tokens/s, the train step's time and MFU, and peak
device memory.

    python scripts/gpu_real_model.py [--device cuda] [--model DIR] [--steps 3]

Made for a GPU machine that has torch, transformers and peft but none of this project's other
dependencies and no network. What else it imports (pydantic, for the run config) it takes from
wheels in ``.cache/gpu-wheels`` when it is not installed (``scripts/gpu_wheels.sh`` downloads them
here: ~3 MB). The model: ``--model DIR`` (the imported folder, when its weights can travel), else the
cached import if there is one, else SmolLM2-135M-Instruct's architecture built from its config with
random weights (the same shapes, so the same speed and memory), with the tokenizer in
``.cache/gpu-tokenizer`` when it travelled (else the tiny model's). On CPU it runs too, as a check
of this script (``--device cpu --steps 1``: minutes, not a measurement).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# SmolLM2-135M-Instruct's architecture (config.json of the imported folder, the fields that set shapes)
SMOLLM2_ARCH = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
}
PEAK_TFLOPS_BF16 = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
"""Dense bf16 peak of known GPUs (TFLOP/s), for MFU; another device's MFU is left out."""


def _wheels_on_path() -> None:
    """pydantic and math-verify from ``.cache/gpu-wheels`` when this Python lacks them (wheels unpacked to
    a temp dir, on this process's path and, through PYTHONPATH, its children's: the math reward's workers)."""
    try:
        import math_verify  # noqa: F401
        import pydantic  # noqa: F401
        return
    except ImportError:
        pass
    wheels = sorted((ROOT / ".cache" / "gpu-wheels").glob("*.whl"))
    if not wheels:
        raise SystemExit("gpu_real_model: pydantic or math-verify is not installed and .cache/gpu-wheels has no "
                         "wheels: run scripts/gpu_wheels.sh where there is network, and carry .cache/gpu-wheels")
    target = Path(tempfile.mkdtemp(prefix="gpu-wheels-"))
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(target)
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH")) if p)


def _model_dir(arg: str | None, out: Path) -> tuple[str, str]:
    """The model folder and what it is."""
    if arg:
        return arg, "given folder"
    cached = sorted((ROOT / ".cache" / "miles" / "models").glob("smollm2-135m-instruct-*/_COMPLETE"))
    if cached:
        return str(cached[-1].parent), "imported SmolLM2-135M-Instruct"
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    config = LlamaConfig(**{k: v for k, v in SMOLLM2_ARCH.items() if k != "model_type"})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    travelled = ROOT / ".cache" / "gpu-tokenizer"
    if (travelled / "tokenizer.json").is_file():
        PreTrainedTokenizerFast.from_pretrained(travelled).save_pretrained(out)
        return str(out), "SmolLM2-135M-Instruct's architecture, random weights, its tokenizer"
    from miles_core.models.tiny import build_tokenizer

    build_tokenizer().save_pretrained(out)
    return str(out), "SmolLM2-135M-Instruct's architecture, random weights, the tiny model's tokenizer"


def _prompts(tokenizer, n: int) -> list[tuple[list[int], str]]:
    rows = [json.loads(line) for line in (ROOT / "datasets/arith/train.jsonl").read_text().splitlines()[:n]]
    out = []
    for r in rows:
        ids = (tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
               if tokenizer.chat_template else tokenizer.encode(r["prompt"]))
        out.append((list(ids), r["label"]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    _wheels_on_path()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_real_model: skipped: no CUDA device")
        return 0
    from miles_core.config import HFEngineConfig, TorchTrainerConfig, TrainConfig
    from miles_core.engines.base import GenerateRequest, SamplingParams
    from miles_core.engines.hf import HFEngine
    from miles_core.rewards.math import math_reward
    from miles_core.storage.weights import WeightStore
    from miles_core.train.base import TrainBatch
    from miles_core.train.torch_trainer import TorchTrainer
    from miles_core.types import Group, Sample

    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    work = Path(tempfile.mkdtemp(prefix="gpu-real-model-"))
    model_dir, what = _model_dir(args.model, work / "model")
    print(f"model: {what} ({model_dir}); device {args.device}, {dtype}", flush=True)
    engine = HFEngine(model_dir, HFEngineConfig(device=args.device, max_batch_size=args.prompts * args.samples),
                      dtype=dtype)
    train_cfg = TrainConfig(lr=1e-6, global_batch_size=args.prompts * args.samples, micro_batch_size=64,
                            backend=TorchTrainerConfig(device=args.device))
    trainer = TorchTrainer(model_dir, train_cfg, WeightStore(str(work / "weights"), tied_once=True), dtype=dtype)
    params = sum(p.numel() for p in trainer.model.parameters())
    prompts = _prompts(engine.tokenizer, args.prompts)
    sampling = SamplingParams(max_new_tokens=args.tokens, temperature=0.7)
    rows = []
    for step in range(1, args.steps + 1):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        requests = [GenerateRequest(ids, sampling, rid=f"{step}-{p}-{i}") for p, (ids, _) in enumerate(prompts)
                    for i in range(args.samples)]
        t0 = time.perf_counter()
        results = asyncio.run(engine.generate(requests))
        gen_s = time.perf_counter() - t0
        groups = []
        for p, (ids, label) in enumerate(prompts):
            samples = []
            for i in range(args.samples):
                r = results[p * args.samples + i]
                text = engine.tokenizer.decode(r.output_ids, skip_special_tokens=True)
                samples.append(Sample("", ids, list(r.output_ids), text, label=label,
                                      reward=math_reward(text, label) + random.random() * 1e-3,
                                      loss_mask=[1] * len(r.output_ids), rollout_logprobs=list(r.logprobs),
                                      group_index=p, sample_index=i))
            groups.append(Group(samples))
        batch = TrainBatch.from_groups(groups, temperature=0.7)
        t0 = time.perf_counter()
        metrics = trainer.step(batch)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        train_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        uri = trainer.export(trainer.version)
        asyncio.run(engine.update_weights(uri, trainer.version))
        push_s = time.perf_counter() - t0
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples)
        generated = sum(len(r.output_ids) for r in results)
        flops = 6 * params * tokens  # forward and backward of every token (the recompute of old logprobs aside)
        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        peak = next((v for k, v in PEAK_TFLOPS_BF16.items() if k in name), None)
        rows.append({
            "step": step, "generated_tok_s": generated / gen_s, "gen_s": gen_s, "train_s": train_s,
            "train_tok_s": tokens / train_s, "mfu": None if peak is None else flops / train_s / (peak * 1e12),
            "push_s": push_s, "loss": metrics["loss"],
            "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if args.device.startswith("cuda") else None,
        })
        print(json.dumps(rows[-1]), flush=True)
    last = rows[-1]
    mfu = "n/a (unknown device peak)" if last["mfu"] is None else f"{last['mfu']:.1%}"
    memory = "n/a" if last["peak_gpu_gb"] is None else f"{last['peak_gpu_gb']:.2f} GB"
    print(f"\nSmolLM2-135M ({params / 1e6:.1f}M parameters) on {args.device}, {dtype}: generation "
          f"{last['generated_tok_s']:,.0f} tok/s ({args.prompts} x {args.samples} samples, <= {args.tokens} tokens); "
          f"train step {last['train_s']:.2f} s ({last['train_tok_s']:,.0f} tok/s, MFU {mfu}); weight push "
          f"{last['push_s']:.2f} s; peak device memory {memory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
