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

The flow holds no run: its tasks record each adapter's steps (``record-step``), end the run
(``finish-run``), stop it (``stop-adapter``, ``stop-run``), stop the producer through the run's
control plane (``stop-producer``) and let an adapter leave (``adapter-left``); the live reports
read the adapters' files.
"""

import contextvars
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prefect import flow, get_run_logger
from prefect.utilities.annotations import quote

from flows.begin import begin_run, flow_run_name
from flows.live import LiveReport, artifact_key
from miles_core.config import RunConfig
from miles_core.audit import raise_if_unbalanced
from miles_core.multi_lora import adapter_history, close_multi_lora_run
from miles_core.run import RunRefs, checkpoint_due, eval_due
from miles_core.stopping import RunStopped, cancelled, stop_requested
from tasks.multi_lora import (
    adapter_left,
    check_data,
    evaluate_adapter,
    evaluate_base,
    finish_run,
    record_adapter_step,
    resume_adapters,
    rollout_producer,
    save_adapter_checkpoint,
    stop_adapter,
    stop_producer,
    stop_run,
    train_adapter,
)
from tasks.slots import run_slots


@flow(name="adapter-update", flow_run_name="{name}", validate_parameters=False)
def adapter_update(cfg: RunConfig, refs: RunRefs, name: str, start: int = 0) -> dict[str, Any]:
    """Train adapter ``name`` from step ``start`` to ``rollout.num_rollout`` from the run's streams."""
    log = get_run_logger()
    total = cfg.rollout.num_rollout
    c, r, n = quote(cfg), quote(refs), quote(name)  # as in flows/train.py: not introspected by Prefect on every call
    history = adapter_history(cfg, refs, name)
    live = LiveReport(f"{cfg.name}/{name}", artifact_key(cfg.name, refs.run_id, name), total, start, history,
                      cfg.tracking.live_every_s)
    for step in range(start, total):
        if stop_requested():  # Ctrl-C or SIGTERM of `miles train-multi-lora`
            return cancelled(_stopped(cfg, refs, name, step))
        t0 = time.perf_counter()
        try:  # (an adapter that could not be resumed fails here)
            ref = train_adapter(c, r, n, quote(step))
        except RunStopped:  # asked to stop while waiting for data: the groups it read stay for a resumed run
            return cancelled(_stopped(cfg, refs, name, step))
        row = {**ref.metrics, "version": ref.version, "step_seconds": time.perf_counter() - t0}
        if eval_due(cfg, step + 1):
            row["eval_accuracy"] = evaluate_adapter(c, r, n, quote(step + 1))["accuracy"]
        record_adapter_step(c, r, n, quote(step + 1), quote(row))
        if checkpoint_due(cfg, step + 1):
            save_adapter_checkpoint(c, r, n, quote(step + 1))
        line = (f"{name} step {step + 1:>3}/{total} | reward {row['reward_mean']:.3f} | loss {row['loss']:+.4f}"
                f" | waited {row['trainer_wait_seconds']:.1f}s | staleness max {row.get('staleness_max', 0):.0f}")
        if "eval_accuracy" in row:
            line += f" | eval accuracy {row['eval_accuracy']:.3f}"
        log.info(line)
        live.step_done(step + 1, row)
    live.finish()
    rows = history.metrics_rows  # a resumed adapter's rows go back to its checkpoint, with its version
    return {"name": name, "steps": total, "version": rows[-1]["version"] if rows else 0}


def _stopped(cfg: RunConfig, refs: RunRefs, name: str, done: int) -> RunStopped:
    """Adapter ``name`` was asked to stop after step ``done`` (``stop-adapter`` checkpoints it there)."""
    text, step = stop_adapter(quote(cfg), quote(refs), quote(name), quote(done))
    return RunStopped(text, refs.run_id, step)


@flow(name="train-multi-lora", flow_run_name=flow_run_name, validate_parameters=True)
def train_multi_lora(cfg: RunConfig) -> dict[str, Any]:
    """Train every adapter of ``cfg.multi_lora`` over one rollout stream; returns the run summary
    (per adapter: status, accuracy before and after, the curve, where its files are)."""
    log = get_run_logger()
    if cfg.multi_lora is None:
        raise ValueError("train_multi_lora needs a config with multi_lora (--lora-count N, or [multi_lora] adapters)")
    t_start = time.perf_counter()
    cfg, refs = begin_run(cfg)
    c, r = quote(cfg), quote(refs)
    log.info("multi-LoRA run %s: %s; adapters %s, rollout source %s", refs.run_id, refs.run_dir,
             ", ".join(cfg.multi_lora.names), cfg.multi_lora.rollout_source)
    try:
        counts = check_data(c, r)
        log.info("prompts: %d for training, %d held out", counts["train_prompts"], counts["eval_prompts"])
        with run_slots(cfg):  # the rollout engine and the trainers, for the run's length
            resumed = resume_adapters(c, r)
            starts = resumed["steps"]
            if any(starts.values()) or resumed["returned"] or resumed["adopted"]:
                log.info("resuming run %s: adapters from steps %s; %d prompts the earlier start claimed and never "
                         "wrote went back to the pool, %d partial groups it saved are continued", refs.run_id,
                         ", ".join(f"{n} {k}" for n, k in starts.items()), resumed["returned"], resumed["adopted"])
            if not any(starts.values()) and not cfg.eval.skip_eval_before_train:  # a resumed run has it in its history
                before = evaluate_base(c, r)
                log.info("base model (every adapter's version 0): held-out accuracy %.3f", before["accuracy"])
            producer = rollout_producer.submit(c, r)
            try:
                states = _run_adapters(cfg, refs, starts, log)
            finally:  # the producer stops before the run's slots go
                try:
                    stop_producer(c, r)
                except Exception as e:  # noqa: BLE001 (the adapters' own error, if any, is the one raised)
                    log.error("could not stop the producer through the run's control plane (%s: %s); waiting for "
                              "it 120 s, then the run's end stops its engine under it", type(e).__name__, e)
                producer.wait(timeout=120)
        if stop_requested():  # asked to stop: Cancelled, with where each adapter can resume from
            text, step = stop_run(c, r)
            return cancelled(RunStopped(text, refs.run_id, step))
        summary = finish_run(c, r, quote(time.perf_counter() - t_start))  # a dead producer fails the run here
        failed = summary["failed_adapters"]
        if failed:
            log.error("adapters failed: %s (the others completed; see summary.json)", ", ".join(failed))
        if len(failed) == len(cfg.multi_lora.names):
            states[failed[0]].result()  # every adapter failed: the run fails with the first one's error
        raise_if_unbalanced(summary["audit"], refs.run_dir)  # it trained, but lost or repeated prompts
        return summary
    finally:
        close_multi_lora_run(refs)


def _run_adapters(cfg: RunConfig, refs: RunRefs, starts: dict[str, int], log) -> dict:
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
            adapter_left(quote(cfg), quote(refs), quote(name), error)

    names = cfg.multi_lora.names
    with ThreadPoolExecutor(max_workers=len(names), thread_name_prefix="adapter") as pool:
        # each thread runs in a copy of this flow's context, so the subflows are children of the run
        futures = {n: pool.submit(contextvars.copy_context().run, one, n) for n in names}
        return {n: f.result() for n, f in futures.items()}

