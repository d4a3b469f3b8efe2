"""Rollout engines: the ``RolloutEngine`` protocol (``base``) and its implementations.

- ``setup_engine(cfg, model_dir, dtype, seed, storage_options)``: builds the engine an ``EngineConfig`` names.
- ``hf``: ``HFEngine``, the in-process transformers engine (CPU default), imported on first use.
- ``vllm``: ``VLLMEngine``, a client of a vLLM server (``engine.type = "vllm"``), and
  ``LocalVLLMServer``, which launches one from vLLM's own environment (``scripts/setup-vllm.sh``).
- ``sglang``: ``SGLangEngine``, a client of SGLang's HTTP API (``engine.type = "sglang"``): real
  SGLang servers on GPUs, or the stand-in below. One ``POST /generate`` per ``generate`` call.
- ``server``: the stand-in, an HTTP server that serves an ``HFEngine`` under SGLang's endpoints and
  JSON shapes (``miles engine-serve``), and ``LocalEngineServer``, which runs it as a child process.
  With ``engine.url`` unset, ``setup_engine`` launches one over the run's model, pinned to
  ``engine.cpu_affinity``, so generation and training run in different processes on different
  cores; the engine's ``close()`` stops it.

Start a stand-in by hand and point a run at it::

    miles engine-serve --model-dir MODEL_DIR --port 30000 --cpu-affinity 1 --num-threads 1
    # ready on http://127.0.0.1:30000
    # run config: [engine] type = "sglang", url = "http://127.0.0.1:30000"

Importing this package imports neither torch nor an HTTP library: ``hf``, ``sglang`` and ``server``
are imported on first use.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_core.config import HFEngineConfig, SGLangEngineConfig, VLLMEngineConfig
from miles_core.engines.base import GenerateRequest, GenerateResult, RolloutEngine, SamplingParams

__all__ = ["GenerateRequest", "GenerateResult", "RolloutEngine", "SamplingParams", "setup_engine"]


def _build_hf(cfg: HFEngineConfig, model_dir: str, dtype: str, seed: int, storage_options) -> RolloutEngine:
    from miles_core.engines.hf import HFEngine

    return HFEngine(str(model_dir), cfg, dtype=dtype, seed=seed, storage_options=storage_options)


def _build_sglang(cfg: SGLangEngineConfig, model_dir: str, dtype: str, seed: int, storage_options) -> RolloutEngine:
    """A client of ``cfg.url``; without one, of a stand-in server launched over ``model_dir``
    (which the engine owns: its ``close()`` stops the server)."""
    from miles_core.engines.sglang import SGLangEngine

    if cfg.url is not None:
        return SGLangEngine(cfg.url, cfg)
    from miles_core.engines.server import LocalEngineServer

    server = LocalEngineServer(str(model_dir), cfg, dtype=dtype, seed=seed, storage_options=storage_options).start()
    engine = SGLangEngine(server.url, cfg, server=server)
    engine.storage_options = dict(storage_options or {})  # the snapshots it loads: their sizes size its deadlines
    return engine


def _build_vllm(cfg: VLLMEngineConfig, model_dir: str, dtype: str, seed: int, storage_options, lora: bool = False,
                log_dir: str | None = None) -> RolloutEngine:
    """A client of ``cfg.url``; without one, of a vLLM server launched over ``model_dir`` from
    ``cfg.python`` (which the engine owns: its ``close()`` stops the server), its log in ``log_dir``."""
    from miles_core.engines.vllm import SERVED_NAME, LocalVLLMServer, VLLMEngine

    if cfg.url is not None:
        return VLLMEngine(cfg.url, cfg, storage_options=storage_options, seed=seed)
    log_path = None if log_dir is None else str(Path(log_dir) / f"vllm-{uuid.uuid4().hex[:8]}.log")
    server = LocalVLLMServer(str(model_dir), cfg, dtype=dtype, seed=seed, lora=lora, log_path=log_path).start()
    return VLLMEngine(server.url, cfg, server=server, model=SERVED_NAME, storage_options=storage_options, seed=seed)


_BUILDERS: dict[type, Callable[..., RolloutEngine]] = {HFEngineConfig: _build_hf, SGLangEngineConfig: _build_sglang,
                                                       VLLMEngineConfig: _build_vllm}


def setup_engine(
    cfg: HFEngineConfig | SGLangEngineConfig | VLLMEngineConfig,
    model_dir: str,
    dtype: str = "float32",
    seed: int = 0,
    storage_options: dict[str, Any] | None = None,
    lora: bool = False,
    log_dir: str | None = None,
) -> RolloutEngine:
    """The rollout engine of ``cfg`` (one of ``EngineConfig``'s variants) serving ``model_dir``.

    ``dtype`` is the parameter dtype (``ModelConfig.dtype``); ``seed`` seeds requests without a seed;
    ``storage_options`` are the fsspec options of the store that weight URIs point into. An
    ``SGLangEngineConfig`` with a ``url`` uses that server as it is (its model, dtype, seed and
    storage access are the server's own). ``lora``: the engine will serve LoRA adapters (a vLLM
    server is launched with them enabled); ``log_dir``: a local folder for a launched vLLM server's
    log (the run folder's ``engine-logs/`` when it is local)."""
    builder = _BUILDERS.get(type(cfg))
    if builder is None:
        known = ", ".join(t.__name__ for t in _BUILDERS)
        raise TypeError(f"no rollout engine for config {type(cfg).__name__}; known configs: {known}")
    if isinstance(cfg, VLLMEngineConfig):  # a launched vLLM server is started with LoRA or without
        return builder(cfg, model_dir, dtype, seed, storage_options, lora=lora, log_dir=log_dir)
    return builder(cfg, model_dir, dtype, seed, storage_options)
