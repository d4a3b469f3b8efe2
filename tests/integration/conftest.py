"""Integration fixtures: one real Prefect backend for the whole session (it takes 12-16 s to start)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_backend():
    """A temporary Prefect server (``prefect_test_harness``); yields its API URL."""
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def demo_model() -> str:
    """The demo's warm-started tiny model (built once, about a minute, then cached)."""
    from miles_core.config import ModelConfig
    from miles_core.models.tiny import ensure_model

    return str(ensure_model(ModelConfig(), log=lambda *_: None))
