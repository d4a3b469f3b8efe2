"""In-run evaluation on the run's own evaluation engine: ``evaluate`` subflows beside training.

The evaluation reward here is deliberately slow (serialised sleeps), so an evaluation outlasts
several training steps: with ``overflow = "backpressure"`` every due evaluation still happens, each
of exactly the version trained at its step; with ``"skip"`` the ones due while another runs are
skipped, but never the final step's. Either way the weight store keeps no pin afterwards."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
from test_train_flow import _tiny_run

pytestmark = pytest.mark.integration

_SLOW = threading.Lock()


def slow_toy(sample) -> float:
    """The toy reward, 50 ms per sample, one sample at a time."""
    from miles_core.rewards import get_reward

    with _SLOW:
        time.sleep(0.05)
    return get_reward("toy")(sample)


def _eval_cfg(tmp_path, model_dir, **eval_overrides):
    return _tiny_run(tmp_path, model_dir, rollout={"num_rollout": 6, "rollout_batch_size": 4, "n_samples_per_prompt": 4,
                                                   "rollout_max_response_len": 4},
                     eval={"eval_interval": 1, "num_prompts": 16, "reward": f"{__name__}:slow_toy", **eval_overrides})


def _rows(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def _child_runs(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    async def read():
        async with get_client() as client:
            runs = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
            return sorted(r.name for r in runs if r.state_type.value == "COMPLETED")

    return asyncio.run(read())


def test_backpressure_evaluates_every_due_step_on_its_own_version(prefect_backend, tiny_model_dir, tmp_path):
    from flows.train import train
    from miles_core.storage import WeightStore

    state = train(_eval_cfg(tmp_path, tiny_model_dir), return_state=True)
    assert state.is_completed(), state
    run_dir = Path(state.result()["run_dir"])
    trained = {r["step"]: r["version"] for r in _rows(run_dir, "metrics.jsonl")}
    evals = _rows(run_dir, "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 1, 2, 3, 4, 5, 6]
    # each evaluation is of the version published at its step, whatever the trainer did meanwhile
    assert all(e["weight_version"] == trained[e["step"]] for e in evals if e["step"] > 0)
    assert state.result()["accuracy_after"] == evals[-1]["accuracy"]
    assert WeightStore(str(run_dir / "weights")).pins() == {}, "pins are released"
    assert _child_runs(state.state_details.flow_run_id) == [f"flow-test-step-{k}" for k in range(1, 7)]


def test_skip_drops_evaluations_due_while_one_runs_but_never_the_last(prefect_backend, tiny_model_dir, tmp_path):
    from flows.train import train
    from miles_core.storage import WeightStore

    state = train(_eval_cfg(tmp_path, tiny_model_dir, overflow="skip"), return_state=True)
    assert state.is_completed(), state
    run_dir = Path(state.result()["run_dir"])
    steps = [e["step"] for e in _rows(run_dir, "eval.jsonl")]
    # 16 prompts x 50 ms: each evaluation outlasts a few training steps of this tiny run
    assert steps[0] == 0 and steps[-1] == 6 and 1 in steps
    assert len(steps) < 7, f"some evaluations should have been skipped: {steps}"
    assert WeightStore(str(run_dir / "weights")).pins() == {}
