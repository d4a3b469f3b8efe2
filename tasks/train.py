"""Prefect tasks of a training run. Each is a few lines over ``miles_core.run`` and returns a
small reference (offsets, versions, URIs, metrics), never tensors or samples."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from miles_core.config import RunConfig
from miles_core.run import RolloutRef, RunRefs, TrainRef, get_session
from miles_core.run import prepare_run as _prepare_run
from tasks.slots import device_slots


@task(name="prepare-run", cache_policy=NO_CACHE, task_run_name="prepare-run")
def prepare_run(cfg: RunConfig) -> RunRefs:
    from prefect.runtime import flow_run

    return _prepare_run(cfg, log=get_run_logger().info, owner={"flow_run_id": flow_run.id})


@task(name="resume-run", cache_policy=NO_CACHE, task_run_name="resume-run")
def resume_run(cfg: RunConfig, refs: RunRefs) -> int | None:
    session = get_session(cfg, refs)
    step = session.resume()
    for damaged in session.checkpoints.skipped:
        get_run_logger().warning("checkpoint passed over (it cannot be loaded): %s", damaged)
    return step


@task(name="check-data", cache_policy=NO_CACHE, task_run_name="check-data")
def check_data(cfg: RunConfig, refs: RunRefs) -> dict[str, int]:
    return get_session(cfg, refs).check_data()


@task(name="rollout", cache_policy=NO_CACHE, task_run_name="rollout-{step}")
def rollout(cfg: RunConfig, refs: RunRefs, step: int) -> RolloutRef:
    with device_slots(cfg, "rollout"):
        return get_session(cfg, refs).rollouts.rollout(step)


@task(name="train", cache_policy=NO_CACHE, task_run_name="train-{rollout_ref.step}")
def train_step(cfg: RunConfig, refs: RunRefs, rollout_ref: RolloutRef) -> TrainRef:
    with device_slots(cfg, "train"):
        return get_session(cfg, refs).training.train(rollout_ref)


@task(name="push-weights", cache_policy=NO_CACHE, task_run_name="push-weights-v{train_ref.version}")
def push_weights(cfg: RunConfig, refs: RunRefs, train_ref: TrainRef) -> float:
    return get_session(cfg, refs).rollouts.push_weights(train_ref.weights_uri, train_ref.version)


@task(name="evaluate", cache_policy=NO_CACHE, task_run_name="evaluate-step-{step}")
def evaluate(cfg: RunConfig, refs: RunRefs, step: int) -> dict[str, float]:
    """Evaluate the rollout engine's weights (it generates there: the rollout's slots)."""
    with device_slots(cfg, "rollout"):
        return get_session(cfg, refs).evaluate(step)


@task(name="evaluate-version", cache_policy=NO_CACHE, task_run_name="evaluate-step-{step}")
def evaluate_version(cfg: RunConfig, refs: RunRefs, step: int, version: int) -> dict[str, float]:
    """Evaluate weights ``version`` on the run's separate evaluation engine (pinned while in use)."""
    with device_slots(cfg, "eval"):
        return get_session(cfg, refs).evals.evaluate_version(step, version)


@task(name="save-checkpoint", cache_policy=NO_CACHE, task_run_name="save-checkpoint-step-{step}")
def save_checkpoint(cfg: RunConfig, refs: RunRefs, step: int, rollout_ref: RolloutRef | None) -> str:
    """Save the run after ``step`` steps (``rollout_ref``: that step's rollout; None in a fully-async run)."""
    return get_session(cfg, refs).save_checkpoint(step, rollout_ref.source_state if rollout_ref else None)


@task(name="train", cache_policy=NO_CACHE, task_run_name="train-{step}")
def train_from_stream(cfg: RunConfig, refs: RunRefs, step: int) -> TrainRef:
    """Fully async: wait for a batch of groups from the fleet's streams and train on it (on the slots
    the flow holds for the run)."""
    return get_session(cfg, refs).training.train_from_stream(step, warn=get_run_logger().warning)
