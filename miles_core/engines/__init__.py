"""Rollout engines: the ``RolloutEngine`` protocol (``base``) and its implementations.

- ``setup_engine(cfg, model_dir, dtype, seed, storage_options)``: builds the engine an ``EngineConfig`` names.
- ``hf``: the in-process transformers engine (CPU default), imported on first use.

Importing this package does not import torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from miles_core.config import HFEngineConfig
from miles_core.engines.base import GenerateRequest, GenerateResult, RolloutEngine, SamplingParams

__all__ = ["GenerateRequest", "GenerateResult", "RolloutEngine", "SamplingParams", "setup_engine"]


def _build_hf(cfg: HFEngineConfig, model_dir: str, dtype: str, seed: int, storage_options) -> RolloutEngine:
    from miles_core.engines.hf import HFEngine

    return HFEngine(str(model_dir), cfg, dtype=dtype, seed=seed, storage_options=storage_options)


_BUILDERS: dict[type, Callable[..., RolloutEngine]] = {HFEngineConfig: _build_hf}


def setup_engine(
    cfg: HFEngineConfig,
    model_dir: str,
    dtype: str = "float32",
    seed: int = 0,
    storage_options: dict[str, Any] | None = None,
) -> RolloutEngine:
    """The rollout engine of ``cfg`` (one of ``EngineConfig``'s variants) serving ``model_dir``.

    ``dtype`` is the parameter dtype (``ModelConfig.dtype``); ``seed`` seeds requests without a seed;
    ``storage_options`` are the fsspec options of the store that weight URIs point into."""
    builder = _BUILDERS.get(type(cfg))
    if builder is None:
        known = ", ".join(t.__name__ for t in _BUILDERS)
        raise TypeError(f"no rollout engine for config {type(cfg).__name__}; known configs: {known}")
    return builder(cfg, model_dir, dtype, seed, storage_options)
