"""The engine contract on a CUDA device (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from contract.engine_contract import EngineContract

from miles_core.config import HFEngineConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class TestHFEngineOnCuda(EngineContract):
    logprob_atol = 1e-3  # TF32 / different kernels than the CPU float32 recompute

    def make_engine(self, model_dir: str, seed: int = 0):
        from miles_core.engines.hf import HFEngine

        return HFEngine(model_dir, HFEngineConfig(device="cuda", max_batch_size=64), seed=seed)
