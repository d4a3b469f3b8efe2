"""The Tinker service as a flow: ``tinker_service(...)`` runs ``miles tinker-serve`` in the flow run's
process until the run is cancelled, so a worker of a work pool on a training machine can serve it
(the deployment ``tinker-service/serve`` of ``miles serve`` and ``prefect.yaml``). Its training
clients appear as flow runs of their own (``miles_core.tinker.runs``).

The API key comes from the worker's environment (``MILES_TINKER_API_KEY``) or a key file on that
machine (``api_key_file``), never from a parameter: parameters are kept in Prefect's database."""

from __future__ import annotations

import argparse
import json
from typing import Optional

from prefect import flow


@flow(name="tinker-service", log_prints=True)
def tinker_service(base_models: Optional[list[str]] = None, storage: str = "runs", host: str = "127.0.0.1",
                   port: int = 8765, api_key_file: Optional[str] = None, lora_alpha: float = 32.0,
                   storage_options: Optional[dict] = None, engine: str = "hf",
                   engine_options: Optional[dict] = None, tokens_per_pass: int = 512) -> None:
    """Serve the Tinker API over ``base_models`` (built-in names or model folders; default: the tiny
    model) with sessions and checkpoints under ``storage``, until the flow run is cancelled. ``engine``
    samples (hf, vllm or sglang; ``engine_options``: fields of its config, as ``miles tinker-serve
    --engine-option`` takes them)."""
    from miles_core.tinker import server

    args = argparse.Namespace(base_model=base_models or ["tiny-addition"], storage=storage, host=host, port=port,
                              api_key_file=api_key_file, lora_alpha=lora_alpha, storage_options=storage_options,
                              prefect=True, engine=engine, tokens_per_pass=tokens_per_pass,
                              engine_option=[f"{k}={json.dumps(v)}" for k, v in (engine_options or {}).items()])
    server.run(args)
