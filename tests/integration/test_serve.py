"""`miles serve` against a real Prefect server on PostgreSQL (``miles server``'s, started by the
test, its scheduler polling every 2 s): the deployments are registered with the run config as their
validated parameter, a training deployment runs to completion through the Python API, and the
scheduled evaluation fires on its own and lands in the run's evaluation history."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from serving import served, wait_for
from test_train_flow import _tiny_run

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def postgres_backend():
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


def _deployment(name: str):
    from prefect.client.orchestration import get_client

    async def read():
        async with get_client() as client:
            try:
                return await client.read_deployment_by_name(name)
            except Exception:
                return None

    return asyncio.run(read())


def _run_states(deployment_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    async def read():
        async with get_client() as client:
            runs = await client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))
            return [f"{r.state_type.value}:{r.state.message if r.state else ''}" for r in runs]

    return asyncio.run(read())


def _completed_runs(deployment_id) -> int:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )

    async def count():
        async with get_client() as client:
            runs = await client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["COMPLETED"]))))
            return len(runs)

    return asyncio.run(count())


def test_serve_registers_deployments_runs_one_and_fires_the_scheduled_eval(postgres_backend, tiny_model_dir, tmp_path):
    from deployments.api import start_run
    from flows.train import train
    from miles_core.eval.standalone import read_history

    first = train(_tiny_run(tmp_path, tiny_model_dir))  # a run for the scheduled evaluation to find
    runs = tmp_path / "runs" / "flow-test"
    argv = ["-m", "deployments.cli", "serve", "--hf-checkpoint", str(tiny_model_dir),
            "--storage-root", str(tmp_path / "runs"), "--eval-runs", str(runs), "--eval-every-s", "5"]
    with served(argv, postgres_backend) as server:
        wait_for(lambda: server.poll() is None and _deployment("evaluate-run/scheduled"), 90, "the served deployments")
        for name in ("train/sync", "train/async", "train/fully-async", "train-multi-lora/multi-lora",
                     "evaluate-run/on-demand"):
            assert _deployment(name) is not None, name
        sync = _deployment("train/sync")
        # the parameter is the pydantic RunConfig: the UI renders (and validates) a form from this schema
        schema = sync.parameter_openapi_schema
        assert schema["properties"]["cfg"]["$ref"].endswith("/RunConfig") and "RunConfig" in schema["definitions"]
        assert sync.parameters["cfg"]["model"]["path"] == str(tiny_model_dir)  # serve's config: the defaults
        scheduled = _deployment("evaluate-run/scheduled")
        assert scheduled.schedules and scheduled.parameters == {"run_dir": str(runs)}

        run = start_run(_tiny_run(tmp_path, tiny_model_dir), deployment="train/sync")
        summary = run.wait(timeout=240)
        assert summary["final_version"] == 6 and run.status() == "COMPLETED"

        # the schedule evaluates the newest run of the name every 5 s: soon one evaluates the
        # deployment run's last version (earlier ones may have caught it mid-training)
        def evaluated_last_version():
            history = read_history(run.run_dir) if (Path(run.run_dir) / "eval_history.parquet").exists() else []
            return any(row["version"] == 6 for row in history)

        try:
            wait_for(evaluated_last_version, 150, "a scheduled evaluation of the finished run")
        except AssertionError:
            print("scheduled runs:", _run_states(scheduled.id))
            raise
        assert _completed_runs(scheduled.id) >= 1

    assert first["final_version"] == 6
