"""Prefect tasks of a multi-LoRA run (``flows/multi_lora.py``): a few lines each over
``miles_core.multi_lora``, returning small references, never tensors or samples. The adapters'
histories, the run's end (summary, audit, report, curves) and its stops are kept here, so the flow
holds no run."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_table_artifact,
)
from prefect.cache_policies import NO_CACHE

from miles_core.config import RunConfig
from miles_core.audit import audit_at_end
from miles_core.multi_lora import get_multi_lora_run, report, write_curves
from miles_core.run import RunRefs, TrainRef
from tasks.slots import device_slots


@task(name="multi-lora-producer", cache_policy=NO_CACHE, task_run_name="rollout-producer")
def rollout_producer(cfg: RunConfig, refs: RunRefs) -> dict:
    """Generate for every adapter into the run's sample stream until the flow stops the producer."""
    return get_multi_lora_run(cfg, refs).run_producer()  # on the slots the flow holds for the run


@task(name="stop-producer", cache_policy=NO_CACHE, task_run_name="stop-producer")
def stop_producer(cfg: RunConfig, refs: RunRefs) -> None:
    """Write the run's stop to its control plane (``fleet/control/``): the producer stops at its next look."""
    get_multi_lora_run(cfg, refs).stop_producer()


@task(name="adapter-left", cache_policy=NO_CACHE, task_run_name="{name}-left")
def adapter_left(cfg: RunConfig, refs: RunRefs, name: str, error: str | None) -> None:
    """Adapter ``name`` finished (``error`` None) or failed: it no longer holds the producer or the
    other adapters' fused steps back (``MultiLoraRun.mark_finished``)."""
    get_multi_lora_run(cfg, refs).mark_finished(name, error)


@task(name="check-data", cache_policy=NO_CACHE, task_run_name="check-data")
def check_data(cfg: RunConfig, refs: RunRefs) -> dict[str, int]:
    return get_multi_lora_run(cfg, refs).check_data()


@task(name="evaluate-base", cache_policy=NO_CACHE, task_run_name="evaluate-base")
def evaluate_base(cfg: RunConfig, refs: RunRefs) -> dict[str, float]:
    """The base model on the held-out prompts: every adapter's version 0."""
    with device_slots(cfg, "rollout"):  # on the rollout engine: covered by the run's slots
        return get_multi_lora_run(cfg, refs).evaluate_base()


@task(name="train-adapter", cache_policy=NO_CACHE, task_run_name="train-{name}-{step}")
def train_adapter(cfg: RunConfig, refs: RunRefs, name: str, step: int) -> TrainRef:
    """Take the adapter's next batch from the stream, train, publish its version and load it into
    the engine by name. An adapter whose trainer could not be built or put back fails here."""
    session = get_multi_lora_run(cfg, refs).adapters[name]
    if session.resume_error is not None:
        raise session.resume_error
    with device_slots(cfg, "train"):
        ref = session.training.train_from_stream(step, warn=get_run_logger().warning)
    ref.metrics["push_seconds"] = session.push_weights(ref.weights_uri, ref.version)
    return ref


@task(name="evaluate-adapter", cache_policy=NO_CACHE, task_run_name="evaluate-{name}-step-{step}")
def evaluate_adapter(cfg: RunConfig, refs: RunRefs, name: str, step: int) -> dict[str, float]:
    """The adapter's current version on the held-out prompts, generated beside the producer's work."""
    with device_slots(cfg, "rollout"):
        return get_multi_lora_run(cfg, refs).adapters[name].evaluate(step)


@task(name="save-adapter-checkpoint", cache_policy=NO_CACHE, task_run_name="save-checkpoint-{name}-step-{step}")
def save_adapter_checkpoint(cfg: RunConfig, refs: RunRefs, name: str, step: int) -> str:
    return get_multi_lora_run(cfg, refs).adapters[name].save_checkpoint(step)


@task(name="resume-adapters", cache_policy=NO_CACHE, task_run_name="resume-adapters")
def resume_adapters(cfg: RunConfig, refs: RunRefs) -> dict:
    """Settle the producers of earlier starts of the run, then put every adapter back to its newest
    checkpoint: ``{"steps": {name: step to go on from}, "returned": prompts given back to the pool,
    "adopted": partial groups this start's producer continues}``.
    An adapter that cannot be built or restored keeps its error for its subflow (it fails alone)."""
    run = get_multi_lora_run(cfg, refs)
    returned, adopted = run.open_producers()
    steps = {}
    with device_slots(cfg, "train"):
        for name, session in run.adapters.items():
            try:
                steps[name] = session.resume()
            except Exception as e:  # noqa: BLE001 (this adapter fails alone: its first train-adapter raises it)
                session.resume_error, steps[name] = e, 0
    return {"steps": steps, "returned": returned, "adopted": adopted}


@task(name="record-step", cache_policy=NO_CACHE, task_run_name="record-{name}-step-{step}")
def record_adapter_step(cfg: RunConfig, refs: RunRefs, name: str, step: int, row: dict) -> None:
    """Add adapter ``name``'s step ``step`` to its history (``metrics.jsonl`` and the run's trackers)."""
    get_multi_lora_run(cfg, refs).adapters[name].history.record(step, row)


@task(name="stop-adapter", cache_policy=NO_CACHE, task_run_name="stop-{name}-after-step-{done}")
def stop_adapter(cfg: RunConfig, refs: RunRefs, name: str, done: int) -> tuple[str, int | None]:
    """Adapter ``name`` was asked to stop after step ``done``: checkpoint it there if the run keeps
    checkpoints; returns what to say and the step it resumes from (``AdapterSession.stop_note``)."""
    return get_multi_lora_run(cfg, refs).adapters[name].stop_note(done)


@task(name="stop-run", cache_policy=NO_CACHE, task_run_name="stop-run")
def stop_run(cfg: RunConfig, refs: RunRefs) -> tuple[str, int | None]:
    """The run was asked to stop: what to say, and the step it resumes from (``MultiLoraRun.stop_note``)."""
    return get_multi_lora_run(cfg, refs).stop_note()


@task(name="finish-run", cache_policy=NO_CACHE, task_run_name="finish-run")
def finish_run(cfg: RunConfig, refs: RunRefs, seconds: float) -> dict:
    """End the run (a dead producer fails it with its own error): its summary with the prompt
    ledgers' audit (``summary.json``; ``adapters.md`` and a markdown artifact, a table of the
    adapters) and its curves (``curves.png``, each adapter's and every adapter's side by side, also
    image artifacts); returns the summary."""
    from miles_core.report import data_url

    run = get_multi_lora_run(cfg, refs)
    run.check_producer(now=True)
    summary = run.summary(seconds)
    summary["audit"] = audit_at_end(refs.run_dir, cfg.storage.storage_options, get_run_logger())
    run.finish(summary)
    create_markdown_artifact(report(cfg, summary), key=None, description=f"{cfg.name}: multi-LoRA summary")
    columns = ("name", "status", "lr", "lora_rank", "steps", "final_version", "accuracy_before", "accuracy_after", "error")
    create_table_artifact([{k: a[k] for k in columns} for a in summary["adapters"]], key=None,
                          description=f"{cfg.name}: adapters")
    for png, url, what in write_curves(run, summary):
        create_image_artifact(data_url(png), key=None, description=f"{cfg.name}: {what} (also {url})")
    return summary
