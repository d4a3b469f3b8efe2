"""Integration fixtures: one real Prefect backend for the whole session (it takes 12-16 s to start),
and, for the modules that serve deployments, a real Prefect server on PostgreSQL per module."""

from __future__ import annotations

import os

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
    """The demo's warm-started tiny model (its shipped build, copied into the cache once)."""
    from miles_core.config import ModelConfig
    from miles_core.models import ensure_model

    return str(ensure_model(ModelConfig(), log=lambda *_: None))


@pytest.fixture(scope="module")
def postgres_backend():
    """A Prefect server on PostgreSQL (``miles server``'s), its scheduler polling every 2 s, which
    this process talks to for the module; yields its API URL. Per module: a module's deployments
    and work pools start from nothing."""
    from postgres_server import postgres_prefect_server, prefect_api

    scheduler = "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS"
    before = os.environ.get(scheduler)
    os.environ[scheduler] = "2"  # the server inherits it: scheduled runs appear within seconds
    try:
        with postgres_prefect_server() as api_url, prefect_api(api_url):
            yield api_url
    finally:
        if before is None:
            os.environ.pop(scheduler, None)
        else:
            os.environ[scheduler] = before
