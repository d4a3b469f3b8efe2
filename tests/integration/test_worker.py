"""The project's ``prefect.yaml`` on a real Prefect server on PostgreSQL, as its header says to use
it: create the ``miles`` process work pool, ``prefect deploy --all``, start a worker; a training run
started on the ``train/sync`` deployment runs on that worker (in a process of its own, in the
repository through the file's pull step) and completes, and the run's folder has what it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from serving import REPO, served, wait_for
from test_train_flow import _tiny_run

pytestmark = pytest.mark.integration

PREFECT = str(Path(sys.executable).parent / "prefect")


def _prefect(api_url: str, *args: str) -> str:
    done = subprocess.run([PREFECT, "--no-prompt", *args], cwd=REPO, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PREFECT_API_URL": api_url, "MILES_REPO": str(REPO)})
    assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_prefect_yaml_deployments_run_on_a_worker(postgres_backend, tiny_model_dir, tmp_path):
    from prefect.client.orchestration import get_client

    from deployments.api import start_run

    _prefect(postgres_backend, "work-pool", "create", "miles", "--type", "process")
    _prefect(postgres_backend, "work-pool", "create", "rollout", "--type", "process")
    out = _prefect(postgres_backend, "deploy", "--all")
    with get_client(sync_client=True) as client:
        for name in ("train/sync", "train/async", "train/fully-async", "train-multi-lora/multi-lora",
                     "evaluate-run/on-demand", "tinker-service/serve"):
            deployment = client.read_deployment_by_name(name)
            assert deployment.work_pool_name == "miles", (name, out)
        assert client.read_deployment_by_name("rollout/fleet").work_pool_name == "rollout", out
        schema = client.read_deployment_by_name("train/sync").parameter_openapi_schema
        assert schema["properties"]["cfg"]["$ref"].endswith("/RunConfig")

    worker = ["-m", "prefect", "worker", "start", "--pool", "miles", "--type", "process"]
    with served(worker, postgres_backend, tail=60, env={"MILES_REPO": str(REPO)}) as proc:
        run = start_run(_tiny_run(tmp_path, tiny_model_dir, name="worker-test"), deployment="train/sync")
        wait_for(lambda: proc.poll() is not None or run.status() not in ("SCHEDULED", "PENDING"), 120,
                 "the worker to pick up the run")
        assert proc.poll() is None, "the worker exited"
        summary = run.wait(timeout=300)
    assert run.status() == "COMPLETED" and not run.in_process
    assert summary["final_version"] == 6 and [r["step"] for r in run.metrics()] == [1, 2, 3]
    assert (Path(run.run_dir) / "curves.png").exists()
