"""Shared fixtures: an untrained tiny model on disk (built once per test session)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("PREFECT_HOME"):
    # tests run in several processes (pytest -n): each its own Prefect home (database, settings)
    os.environ["PREFECT_HOME"] = os.path.join(os.environ["PREFECT_HOME"], os.environ["PYTEST_XDIST_WORKER"])
    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A randomly initialised tiny Llama model with the character tokenizer (no warm start)."""
    import torch

    from miles_core.config import TinyModelRecipe
    from miles_core.models.tiny import build_untrained

    torch.set_num_threads(1)
    recipe = TinyModelRecipe(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    return build_untrained(recipe, tmp_path_factory.mktemp("tiny-model"))
