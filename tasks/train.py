"""Prefect tasks of a training run. Each is a few lines over ``miles_core.run`` and returns a
small reference (offsets, versions, URIs, metrics), never tensors or samples. The run's history,
its end (summary, audit, curves) and its stop are kept here, so the flow holds no session."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from miles_core.config import RunConfig
from miles_core.audit import audit_at_end
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


@task(name="push-weights", cache_policy=NO_CACHE, task_run_name="push-weights-for-rollout-{k}")
def push_rollout_weights(cfg: RunConfig, refs: RunRefs, k: int) -> float:
    """A resumed async run: load the version an uninterrupted run generated rollout ``k`` with."""
    session = get_session(cfg, refs)
    version = session.async_rollout_version(k)
    return session.rollouts.push_weights(session.training.weights_uri(version), version)


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


@task(name="reserve-evaluation", cache_policy=NO_CACHE, task_run_name="reserve-v{version}-for-eval-{step}")
def reserve_evaluation(cfg: RunConfig, refs: RunRefs, step: int, version: int) -> None:
    """Pin weights ``version`` for the evaluation after ``step`` as it is scheduled: retention keeps
    it until that evaluation has loaded it (``evaluate-version`` unpins it)."""
    get_session(cfg, refs).evals.reserve(step, version)


@task(name="save-checkpoint", cache_policy=NO_CACHE, task_run_name="save-checkpoint-step-{step}")
def save_checkpoint(cfg: RunConfig, refs: RunRefs, step: int, rollout_ref: RolloutRef | None) -> str:
    """Save the run after ``step`` steps (``rollout_ref``: that step's rollout; None in a fully-async run)."""
    return get_session(cfg, refs).save_checkpoint(step, rollout_ref.source_state if rollout_ref else None)


@task(name="train", cache_policy=NO_CACHE, task_run_name="train-{step}")
def train_from_stream(cfg: RunConfig, refs: RunRefs, step: int) -> TrainRef:
    """Fully async: wait for a batch of groups from the fleet's streams and train on it (on the slots
    the flow holds for the run)."""
    return get_session(cfg, refs).training.train_from_stream(step, warn=get_run_logger().warning)


@task(name="record-step", cache_policy=NO_CACHE, task_run_name="record-step-{step}")
def record_step(cfg: RunConfig, refs: RunRefs, step: int, row: dict) -> None:
    """Add step ``step``'s metrics to the run's history (``metrics.jsonl`` and its trackers)."""
    get_session(cfg, refs).history.record(step, row)


@task(name="stop-run", cache_policy=NO_CACHE, task_run_name="stop-run-after-step-{done}")
def stop_run(cfg: RunConfig, refs: RunRefs, done: int, rollout_ref: RolloutRef | None) -> tuple[str, int | None]:
    """The run was asked to stop after step ``done``: checkpoint it there if it keeps checkpoints;
    returns what to say and the step it resumes from (``RunSession.stop_note``)."""
    return get_session(cfg, refs).stop_note(done, rollout_ref.source_state if rollout_ref else None)


@task(name="finish-run", cache_policy=NO_CACHE, task_run_name="finish-run")
def finish_run(cfg: RunConfig, refs: RunRefs, start: int, seconds: float) -> tuple[dict, str, bytes]:
    """End the run: its summary with the prompt ledger's audit (``summary.json`` and a markdown
    artifact) and its reward and held-out accuracy curves (``curves.png``); returns the summary, the
    curves' URL and the PNG (the flow's final curves artifact, so they are drawn once)."""
    from prefect.artifacts import create_markdown_artifact

    from miles_core.report import artifact_key, run_curves, summary_markdown

    session = get_session(cfg, refs)
    summary = session.summary(start, seconds)
    summary["audit"] = audit_at_end(refs.run_dir, cfg.storage.storage_options, get_run_logger())
    session.finish(summary)
    rows, evals = session.history.metrics_rows, session.history.eval_rows
    png = run_curves(rows, evals, f"{cfg.name}: step {rows[-1]['step'] if rows else 0}/{cfg.rollout.num_rollout}")
    curves = session.layout.write_bytes("curves.png", png)
    create_markdown_artifact(summary_markdown(cfg.name, summary, curves),
                             key=artifact_key(cfg.name, refs.run_id, "summary"), description=f"{cfg.name} summary")
    return summary, curves, png
