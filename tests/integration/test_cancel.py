"""Cancelling a fully-async deployment run: the run ends CANCELLED within seconds, the producer
stops cleanly, and no partial segment is left in the stream.

Cancellation reaches only deployment runs, so the train flow is served (``flow.serve``) by a
subprocess against the test's Prefect API, started with ``run_deployment`` and cancelled through
the API, as the UI's Cancel button does."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from serving import served, wait_for

pytestmark = pytest.mark.integration

SERVE = """
from flows.train import train
train.serve(name="cancel-test", print_starting_message=False)
"""


def test_cancelling_a_fully_async_deployment_run(prefect_backend, tiny_model_dir, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    from miles_core.config import RunConfig

    cfg = RunConfig.model_validate({
        "name": "cancel-test",
        "mode": "fully_async",
        "model": {"path": str(tiny_model_dir)},
        "data": {"type": "toy", "num_prompts": 64},
        "rollout": {"num_rollout": 10_000, "rollout_batch_size": 4, "n_samples_per_prompt": 4,
                    "rollout_max_response_len": 4},
        "train": {"micro_batch_size": 16},
        "eval": {"eval_interval": None, "num_prompts": 4, "skip_eval_before_train": True},
        "async_rollout": {"segment_max_groups": 2},
        "storage": {"root": str(tmp_path / "runs")},
    })
    with served(["-c", SERVE], prefect_backend, tail=60):
        async def deployed():
            async with get_client() as client:
                try:
                    return await client.read_deployment_by_name("train/cancel-test")
                except Exception:
                    return None

        wait_for(lambda: asyncio.run(deployed()), 90, "the served deployment")
        flow_run = run_deployment("train/cancel-test", parameters={"cfg": cfg.model_dump(mode="json")}, timeout=0)

        runs = tmp_path / "runs" / "cancel-test"

        async def flow_run_state():
            async with get_client() as client:
                return (await client.read_flow_run(flow_run.id)).state

        def training_steps() -> int:
            state = asyncio.run(flow_run_state())
            assert not state.is_final(), f"the deployment run ended before it was cancelled: {state}"
            files = list(runs.glob("*/metrics.jsonl"))
            return len(files[0].read_text().splitlines()) if files else 0

        wait_for(lambda: training_steps() >= 3, 180, "three training steps")

        async def cancel_andwait_for():
            async with get_client() as client:
                await client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
                t0 = time.monotonic()
                while time.monotonic() - t0 < 60:
                    run = await client.read_flow_run(flow_run.id)
                    if run.state.is_final():
                        return run.state, time.monotonic() - t0
                    await asyncio.sleep(0.5)
                return run.state, time.monotonic() - t0

        state, seconds = asyncio.run(cancel_andwait_for())
        assert state.is_cancelled(), state
        assert seconds < 20, f"cancellation took {seconds:.1f} s"

        (run_dir,) = runs.iterdir()
        producer = json.loads((run_dir / "state" / "producer.json").read_text())
        assert producer["status"] == "stopped", producer
        from miles_core.storage import SampleStream

        stream = SampleStream(str(run_dir))
        segments = stream.read()  # every visible segment decodes: nothing partial
        assert segments and sum(len(s) for s in segments) == producer["stats"]["groups_written"] * 4
        leftovers = [p.name for p in (run_dir / "samples" / "rollout").iterdir() if not p.name.endswith(".arrow")]
        assert leftovers == [], leftovers

