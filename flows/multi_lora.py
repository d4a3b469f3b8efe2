"""The multi-LoRA flow: ``train_multi_lora(cfg)`` trains ``cfg.multi_lora``'s adapters over one
rollout stream, so N adapters do not cost N rollouts.

- ``rollout-producer`` (a task, for the whole run) generates into the run's sample stream: once
  for all adapters (``shared``: by the base or a lead adapter), or round-robin, each group by its
  own adapter (``per_adapter``). See ``miles_core/multi_lora.py``.
- One ``adapter-update`` subflow per adapter (children of the run in the UI, all running at once):
  ``train-<name>-<k>`` takes the adapter's next batch from its own cursor on the stream, trains
  its own optimizer (on one base model shared by every adapter, the adapters' steps taken together:
  ``multi_lora.shared_base``), publishes its version under ``adapters/<name>/weights`` and loads it into the
  engine by name; ``evaluate-<name>-step-<k>`` evaluates it beside everything else (nothing
  pauses). Metrics, evaluations and checkpoints go to ``adapters/<name>/``.
- An adapter whose subflow fails fails alone: it stops holding the producer back and the others
  go on. The run completes when every adapter has finished or failed; its summary
  (``summary.json`` and a markdown artifact) shows each adapter's status and held-out accuracy
  side by side, per evaluation step. It fails only if every adapter failed, or the producer did.

Resuming: with ``checkpoint.save_interval`` (``--save-interval N``) each adapter saves its trainer
and its cursors on the run's streams; the same run id again (after a crash, a Ctrl-C, or with a
larger ``--num-rollout``) settles what the earlier producer left (``resume-adapters``) and goes on
with every adapter from its own checkpoint. Every adapter writes a prompt ledger
(``adapters/<name>/ledger/``); the run's summary has their audit (``miles audit RUN``).
"""

import contextvars
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact
from prefect.utilities.annotations import quote

from flows.begin import begin_run, flow_run_name
from flows.live import LiveReport, artifact_key
from miles_core.config import RunConfig
from miles_core.ledger import audit_at_end, audit_line, raise_if_unbalanced
from miles_core.multi_lora import adapter_summary, close_multi_lora_run, get_multi_lora_run
from miles_core.report import curves_png, data_url, reward_points, run_curves
from miles_core.run import RunRefs, checkpoint_due
from miles_core.stopping import RunStopped, cancelled, stop_requested
from tasks.multi_lora import (
    check_data,
    evaluate_adapter,
    evaluate_base,
    resume_adapters,
    rollout_producer,
    save_adapter_checkpoint,
    train_adapter,
)
from tasks.slots import run_slots


def _eval_due(cfg: RunConfig, step: int) -> bool:
    interval = cfg.eval.eval_interval
    return step + 1 == cfg.rollout.num_rollout or (interval is not None and (step + 1) % interval == 0)


@flow(name="adapter-update", flow_run_name="{name}", validate_parameters=False)
def adapter_update(cfg: RunConfig, refs: RunRefs, name: str, start: int = 0) -> dict[str, Any]:
    """Train adapter ``name`` from step ``start`` to ``rollout.num_rollout`` from the run's streams."""
    log = get_run_logger()
    session = get_multi_lora_run(cfg, refs).adapters[name]
    if session.resume_error is not None:  # its trainer could not be built or put back
        raise session.resume_error
    total = cfg.rollout.num_rollout
    c = quote(cfg)  # as in flows/train.py: the tasks' config, not introspected by Prefect on every call
    live = LiveReport(f"{cfg.name}/{name}", artifact_key(cfg.name, refs.run_id, name), total, start, session.history,
                      cfg.tracking.live_every_s)
    for step in range(start, total):
        if stop_requested():  # Ctrl-C or SIGTERM of `miles train-multi-lora`
            return cancelled(_stopped(cfg, refs, name, step))
        t0 = time.perf_counter()
        try:
            ref = train_adapter(c, refs, name, step)
        except RunStopped:  # asked to stop while waiting for data: the groups it read stay for a resumed run
            return cancelled(_stopped(cfg, refs, name, step))
        row = {**ref.metrics, "version": ref.version, "step_seconds": time.perf_counter() - t0}
        if _eval_due(cfg, step):
            row["eval_accuracy"] = evaluate_adapter(c, refs, name, step + 1)["accuracy"]
        session.history.record(step + 1, row)
        if checkpoint_due(cfg, step + 1):
            save_adapter_checkpoint(c, refs, name, step + 1)
        line = (f"{name} step {step + 1:>3}/{total} | reward {row['reward_mean']:.3f} | loss {row['loss']:+.4f}"
                f" | waited {row['trainer_wait_seconds']:.1f}s | staleness max {row.get('staleness_max', 0):.0f}")
        if "eval_accuracy" in row:
            line += f" | eval accuracy {row['eval_accuracy']:.3f}"
        log.info(line)
        live.step_done(step + 1)
    live.finish()
    return {"name": name, "steps": total, "version": session.training.trainer.version}


def _stopped(cfg: RunConfig, refs: RunRefs, name: str, done: int) -> RunStopped:
    """Adapter ``name`` was asked to stop after step ``done``: checkpoint it there if the run keeps them."""
    text = f"adapter {name} stopped after step {done} of {cfg.rollout.num_rollout}, as asked"
    session = get_multi_lora_run(cfg, refs).adapters[name]
    if done == 0 or cfg.checkpoint.save_interval is None:
        return RunStopped(f"{text}; no checkpoint", refs.run_id)
    if done not in session.layout.checkpoints():
        save_adapter_checkpoint(cfg, refs, name, done)
    return RunStopped(f"{text}; checkpoint at step {done}: {session.layout.checkpoint(done)}", refs.run_id, done)


@flow(name="train-multi-lora", flow_run_name=flow_run_name, validate_parameters=True)
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
        counts = check_data(cfg, refs)
        log.info("prompts: %d for training, %d held out", counts["train_prompts"], counts["eval_prompts"])
        with run_slots(cfg):  # the rollout engine and the trainers, for the run's length
            resumed = resume_adapters(cfg, refs)
            starts = resumed["steps"]
            if any(starts.values()) or resumed["returned"] or resumed["adopted"]:
                log.info("resuming run %s: adapters from steps %s; %d prompts the earlier start claimed and never "
                         "wrote went back to the pool, %d partial groups it saved are continued", refs.run_id,
                         ", ".join(f"{n} {k}" for n, k in starts.items()), resumed["returned"], resumed["adopted"])
            before = _before_training(cfg, refs, run, starts, log)
            producer = rollout_producer.submit(cfg, refs)
            try:
                states = _run_adapters(cfg, refs, run, starts, log)
            finally:  # the producer stops before the run's slots go
                run.stop_producer()
                producer.wait(timeout=120)
        if stop_requested():  # asked to stop: Cancelled, with where each adapter can resume from
            return cancelled(_run_stopped(cfg, refs, run))
        run.check_producer()  # a dead producer fails the run with its own error
        summary = _summary(cfg, refs, run, before, time.perf_counter() - t_start)
        summary["audit"] = audit_at_end(refs.run_dir, cfg.storage.storage_options, log)
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
        raise_if_unbalanced(summary["audit"], refs.run_dir)  # it trained, but lost or repeated prompts
        return summary
    finally:
        close_multi_lora_run(refs)


def _before_training(cfg: RunConfig, refs: RunRefs, run, starts: dict[str, int], log) -> dict[str, Any] | None:
    """The base model's evaluation: run now on a fresh run; a resumed run takes it from its history."""
    if any(starts.values()):
        return next((e for e in run.history.eval_rows if e["step"] == 0), None)
    if cfg.eval.skip_eval_before_train:
        return None
    before = evaluate_base(cfg, refs)
    log.info("base model (every adapter's version 0): held-out accuracy %.3f", before["accuracy"])
    return before


def _run_stopped(cfg: RunConfig, refs: RunRefs, run) -> RunStopped:
    """What a stopped run says: where each adapter resumes from (its newest checkpoint)."""
    text = f"multi-LoRA run {refs.run_id} stopped, as asked"
    if cfg.checkpoint.save_interval is None:
        return RunStopped(f"{text}; no checkpoint (set --save-interval N to make a run resumable)", refs.run_id)
    saved = {n: (s.layout.checkpoints() or [0])[-1] for n, s in run.adapters.items()}
    text += "; the adapters' checkpoints are at steps " + ", ".join(f"{n} {k}" for n, k in saved.items())
    return RunStopped(text, refs.run_id, min(saved.values()) if any(saved.values()) else None)


def _run_adapters(cfg: RunConfig, refs: RunRefs, run, starts: dict[str, int], log) -> dict:
    """Every adapter's subflow at once, each on its own thread (Prefect subflows of this run); an
    adapter that finishes or fails leaves the producer's back-pressure at once."""

    def one(name: str):
        error = "its subflow did not finish"
        try:
            state = adapter_update(cfg, refs, name, starts.get(name, 0), return_state=True)
            error = None if state.is_completed() else (state.message or state.type.value)
            if error:
                (log.warning if stop_requested() else log.error)("adapter %s %s: %s", name,
                                                                 "stopped" if stop_requested() else "failed", error)
            return state
        finally:  # whatever happened, it no longer holds the producer or the other adapters' steps
            run.mark_finished(name, error)

    with ThreadPoolExecutor(max_workers=len(run.names), thread_name_prefix="adapter") as pool:
        # each thread runs in a copy of this flow's context, so the subflows are children of the run
        futures = {n: pool.submit(contextvars.copy_context().run, one, n) for n in run.names}
        return {n: f.result() for n, f in futures.items()}


def _summary(cfg: RunConfig, refs: RunRefs, run, before, seconds: float) -> dict[str, Any]:
    adapters = [adapter_summary(run.adapters[n], before, run.finished.get(n)) for n in run.names]
    states = [run.layout.read_json(f"state/producer-{p}.json") or {} for p in run.producer_names()]
    stats = [state.get("stats", {}) for state in states]  # every start's producer
    return {
        "run_id": refs.run_id,
        "run_dir": refs.run_dir,
        "rollout_source": cfg.multi_lora.rollout_source,
        "steps": cfg.rollout.num_rollout,
        "accuracy_before": before["accuracy"] if before else None,
        "adapters": adapters,
        "failed_adapters": sorted(run.failed),
        "groups_generated": sum(s.get("groups_written", 0) for s in stats),
        "samples_generated": sum(s.get("samples_finished", 0) for s in stats),
        "training": run.training_summary(),
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
        f"- trained: {_training_line(summary['training'])}",
        f"- prompt ledgers (`miles audit`): {audit_line(summary['audit'])}",
        f"- run folder: `{summary['run_dir']}` (each adapter under `adapters/<name>/`)",
        f"- wall time: {summary['seconds']} s",
    ])


def _training_line(training: dict[str, Any]) -> str:
    if not training["shared_base"]:
        return "a trainer (and a copy of the base) per adapter"
    return (f"on one base model, {training['fused_steps']} fused steps of "
            f"{training['adapters_per_fused_step']} adapters on average")
