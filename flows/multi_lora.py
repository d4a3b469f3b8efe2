"""The multi-LoRA flow: ``train_multi_lora(cfg)`` trains ``cfg.multi_lora``'s adapters over one
rollout stream, so N adapters do not cost N rollouts.

- ``rollout-producer`` (a task, for the whole run) generates into the run's sample stream: once
  for all adapters (``shared``: by the base or a lead adapter), or round-robin, each group by its
  own adapter (``per_adapter``). See ``miles_core/multi_lora.py``.
- One ``adapter-update`` subflow per adapter (children of the run in the UI, all running at once):
  ``train-<name>-<k>`` takes the adapter's next batch from its own cursor on the stream, trains
  its own optimizer, publishes its version under ``adapters/<name>/weights`` and loads it into the
  engine by name; ``evaluate-<name>-step-<k>`` evaluates it beside everything else (nothing
  pauses). Metrics, evaluations and checkpoints go to ``adapters/<name>/``.
- An adapter whose subflow fails fails alone: it stops holding the producer back and the others
  go on. The run completes when every adapter has finished or failed; its summary
  (``summary.json`` and a markdown artifact) shows each adapter's status and held-out accuracy
  side by side, per evaluation step. It fails only if every adapter failed, or the producer did.

Resuming is not supported: a run id that already has adapter steps is refused.
"""

import contextvars
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact

from flows.begin import begin_run
from miles_core.config import RunConfig
from miles_core.multi_lora import adapter_summary, close_multi_lora_run, get_multi_lora_run
from miles_core.report import curves_png, data_url, reward_points, run_curves
from miles_core.run import RunRefs, checkpoint_due
from miles_core.stopping import RunStopped, stop_requested
from tasks.multi_lora import (
    check_data,
    evaluate_adapter,
    evaluate_base,
    rollout_producer,
    save_adapter_checkpoint,
    train_adapter,
)
from tasks.slots import run_slots


def _eval_due(cfg: RunConfig, step: int) -> bool:
    interval = cfg.eval.eval_interval
    return step + 1 == cfg.rollout.num_rollout or (interval is not None and (step + 1) % interval == 0)


@flow(name="adapter-update", flow_run_name="{name}", validate_parameters=False)
def adapter_update(cfg: RunConfig, refs: RunRefs, name: str) -> dict[str, Any]:
    """Train adapter ``name`` for ``rollout.num_rollout`` steps from the run's sample stream."""
    log = get_run_logger()
    session = get_multi_lora_run(cfg, refs).adapters[name]
    total = cfg.rollout.num_rollout
    for step in range(total):
        if stop_requested():  # Ctrl-C or SIGTERM of `miles train-multi-lora`
            raise RunStopped(f"adapter {name} stopped after step {step} of {total}, as asked", refs.run_id)
        t0 = time.perf_counter()
        ref = train_adapter(cfg, refs, name, step)
        row = {**ref.metrics, "version": ref.version, "step_seconds": time.perf_counter() - t0}
        if _eval_due(cfg, step):
            row["eval_accuracy"] = evaluate_adapter(cfg, refs, name, step + 1)["accuracy"]
        session.history.record(step + 1, row)
        if checkpoint_due(cfg, step + 1):
            save_adapter_checkpoint(cfg, refs, name, step + 1)
        line = (f"{name} step {step + 1:>3}/{total} | reward {row['reward_mean']:.3f} | loss {row['loss']:+.4f}"
                f" | waited {row['trainer_wait_seconds']:.1f}s | staleness max {row.get('staleness_max', 0):.0f}")
        if "eval_accuracy" in row:
            line += f" | eval accuracy {row['eval_accuracy']:.3f}"
        log.info(line)
    return {"name": name, "steps": total, "version": session.training.trainer.version}


@flow(name="train-multi-lora", flow_run_name="{cfg.name}", validate_parameters=True)
def train_multi_lora(cfg: RunConfig) -> dict[str, Any]:
    """Train every adapter of ``cfg.multi_lora`` over one rollout stream; returns the run summary
    (per adapter: status, accuracy before and after, the curve, where its files are)."""
    log = get_run_logger()
    if cfg.multi_lora is None:
        raise ValueError("train_multi_lora needs a config with multi_lora (--lora-count N, or [multi_lora] adapters)")
    t_start = time.perf_counter()
    cfg, refs = begin_run(cfg)
    run = get_multi_lora_run(cfg, refs)
    log.info("multi-LoRA run %s: %s; adapters %s, rollout source %s", refs.run_id, refs.run_dir,
             ", ".join(run.names), cfg.multi_lora.rollout_source)
    try:
        _refuse_resume(run)
        counts = check_data(cfg, refs)
        log.info("prompts: %d for training, %d held out", counts["train_prompts"], counts["eval_prompts"])
        with run_slots(cfg):  # the rollout engine and the trainers, for the run's length
            before = None if cfg.eval.skip_eval_before_train else evaluate_base(cfg, refs)
            if before:
                log.info("base model (every adapter's version 0): held-out accuracy %.3f", before["accuracy"])
            producer = rollout_producer.submit(cfg, refs)
            try:
                states = _run_adapters(cfg, refs, run, log)
            finally:  # the producer stops before the run's slots go
                run.stop_producer()
                producer.wait(timeout=120)
        if stop_requested():
            raise RunStopped(f"multi-LoRA run {refs.run_id} stopped, as asked; no checkpoint (multi-LoRA runs cannot "
                             "be resumed yet)", refs.run_id)
        run.check_producer()  # a dead producer fails the run with its own error
        summary = _summary(cfg, refs, run, before, time.perf_counter() - t_start)
        run.finish(summary)
        run.layout.write_text("adapters.md", _report(cfg, summary))
        create_markdown_artifact(_report(cfg, summary), key=None, description=f"{cfg.name}: multi-LoRA summary")
        _publish_table(cfg, summary)
        _publish_curves(cfg, run, summary)
        failed = sorted(run.failed)
        if failed:
            log.error("adapters failed: %s (the others completed; see summary.json)", ", ".join(failed))
        if len(failed) == len(run.names):
            states[failed[0]].result()  # every adapter failed: the run fails with the first one's error
        return summary
    finally:
        close_multi_lora_run(refs)


def _refuse_resume(run) -> None:
    done = [n for n, s in run.adapters.items() if s.history.has_steps()]
    if done:
        raise RuntimeError(
            f"run {run.refs.run_id} already has training steps for adapters {', '.join(done)}; multi-LoRA runs "
            "cannot be resumed yet: use a new run id"
        )


def _run_adapters(cfg: RunConfig, refs: RunRefs, run, log) -> dict:
    """Every adapter's subflow at once, each on its own thread (Prefect subflows of this run); an
    adapter that finishes or fails leaves the producer's back-pressure at once."""

    def one(name: str):
        state = adapter_update(cfg, refs, name, return_state=True)
        error = None if state.is_completed() else (state.message or state.type.value)
        if error:
            log.error("adapter %s failed: %s", name, error)
        run.mark_finished(name, error)
        return state

    with ThreadPoolExecutor(max_workers=len(run.names), thread_name_prefix="adapter") as pool:
        # each thread runs in a copy of this flow's context, so the subflows are children of the run
        futures = {n: pool.submit(contextvars.copy_context().run, one, n) for n in run.names}
        return {n: f.result() for n, f in futures.items()}


def _summary(cfg: RunConfig, refs: RunRefs, run, before, seconds: float) -> dict[str, Any]:
    adapters = [adapter_summary(run.adapters[n], before, run.finished.get(n)) for n in run.names]
    producer = run.layout.read_json("state/producer.json") or {}
    stats = producer.get("stats", {})
    return {
        "run_id": refs.run_id,
        "run_dir": refs.run_dir,
        "rollout_source": cfg.multi_lora.rollout_source,
        "steps": cfg.rollout.num_rollout,
        "accuracy_before": before["accuracy"] if before else None,
        "adapters": adapters,
        "failed_adapters": sorted(run.failed),
        "groups_generated": stats.get("groups_written"),
        "samples_generated": stats.get("samples_finished"),
        "seconds": round(seconds, 1),
    }


def accuracy_table(summary: dict[str, Any]) -> str:
    """Held-out accuracy per evaluation step, one column per adapter (markdown)."""
    adapters = summary["adapters"]
    steps = sorted({s for a in adapters for s, _ in a["curve"]} | ({0} if summary["accuracy_before"] is not None else set()))
    fmt = lambda x: "" if x is None else f"{x:.3f}"  # noqa: E731
    lines = ["| step | " + " | ".join(a["name"] for a in adapters) + " |", "|---:|" + "---:|" * len(adapters)]
    for step in steps:
        cells = []
        for a in adapters:
            value = summary["accuracy_before"] if step == 0 else dict(a["curve"]).get(step)
            cells.append(fmt(value))
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _publish_table(cfg: RunConfig, summary: dict[str, Any]) -> None:
    rows = [{k: a[k] for k in ("name", "status", "lr", "lora_rank", "steps", "final_version", "accuracy_before",
                               "accuracy_after", "error")} for a in summary["adapters"]]
    create_table_artifact(rows, key=None, description=f"{cfg.name}: adapters")


def _publish_curves(cfg: RunConfig, run, summary: dict[str, Any]) -> None:
    """An image per adapter (its reward and held-out accuracy per step, in ``adapters/<name>/curves.png``)
    and one with every adapter side by side (``curves.png``)."""
    reward = {}
    for name, session in run.adapters.items():
        png = run_curves(session.history.metrics_rows, session.history.eval_rows, f"{cfg.name}: adapter {name}")
        url = session.layout.write_bytes("curves.png", png)
        create_image_artifact(data_url(png), key=None, description=f"{cfg.name}: adapter {name}, reward and held-out "
                                                                   f"accuracy per step (also {url})")
        reward[name] = reward_points(session.history.metrics_rows)
    if len(reward) > 1 and len({tuple(points) for points in reward.values()}) == 1:
        # shared rollouts: every adapter trained on the same base-generated batches, one line says it
        reward = {"every adapter (shared rollouts)": next(iter(reward.values()))}
    before = [(0, summary["accuracy_before"])] if summary["accuracy_before"] is not None else []
    accuracy = {a["name"]: before + [tuple(p) for p in a["curve"]] for a in summary["adapters"]}
    png = curves_png(reward, accuracy, f"{cfg.name}: every adapter")
    url = run.layout.write_bytes("curves.png", png)
    create_image_artifact(data_url(png), key=None, description=f"{cfg.name}: every adapter side by side (also {url})")


def _report(cfg: RunConfig, summary: dict[str, Any]) -> str:
    """The run's markdown report: every adapter's held-out accuracy side by side."""
    return "\n".join([
        f"# Multi-LoRA run `{summary['run_id']}` ({cfg.name}, {summary['rollout_source']} rollouts)",
        "",
        "Held-out accuracy per adapter (step 0: the base model):",
        "",
        accuracy_table(summary),
        "",
        f"- failed adapters: {', '.join(summary['failed_adapters']) or 'none'}",
        f"- groups generated (shared by all adapters): {summary['groups_generated']}",
        f"- run folder: `{summary['run_dir']}` (each adapter under `adapters/<name>/`)",
        f"- wall time: {summary['seconds']} s",
    ])
