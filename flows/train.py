"""The training flow: ``train(cfg)`` is one run, in the execution mode ``cfg.mode.type`` names.

- ``sync``: rollout k, train k, push weights k.
- ``async``: rollout k+1 is submitted before train k (they overlap); weights are pushed every
  ``update_weights_interval`` steps once no training rollout is in flight.
- ``fully_async``: ``launch-producers`` starts the run's rollout fleet (``rollout_producers``
  producers, each a child process or a ``rollout`` flow run of ``rollout_deployment``), which
  generates for the whole run into one stream per producer (bounded ahead of the trainer,
  staleness-filtered on the trainer's side) and talks to the trainer only through the run folder;
  ``train-k`` tasks consume. A dead producer is replaced (``producer_restarts``). Stopping, failing
  or cancelling the flow stops every producer (whole segments only).

Sync mode, per step k: ``rollout-k`` (generate + reward, one segment appended to the run's sample
stream) -> ``train-k`` (read that segment, optimizer step(s), publish weights version v) ->
``push-weights-v`` (the engine loads v from the weight store). Held-out evaluation runs before
training, every ``eval.eval_interval`` steps and after the last step: by default each in-run
evaluation is an ``evaluate`` subflow on the run's own evaluation engine, which loads the version
just published (pinned in the weight store meanwhile) while training goes on (``InRunEvals``:
``eval.max_in_flight``, ``eval.overflow``); with ``eval.engine = "shared"`` it runs on the rollout
engine between steps (fully async: the producer pauses meanwhile). A checkpoint is saved every
``checkpoint.save_interval`` steps and after the last one. Per-step metrics go to
``metrics.jsonl`` in the run folder and to Prefect artifacts (a progress bar during the run, a
metrics table, the reward and accuracy curves (``curves.png``, an image artifact) and a markdown
summary at the end). The flow holds no session: its tasks record each step (``record-step``), end
the run (``finish-run``) and stop it (``stop-run``); its live report reads the run's files.

Resuming: a ``cfg.run_id`` naming a run with a checkpoint at step k goes on from step k + 1
(``resume-run``; see ``RunSession.resume``) up to ``rollout.num_rollout``, keeping the run's
evaluation before training. A run with steps done but no checkpoint fails rather than start over.
"""


import contextvars
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from prefect import flow, get_run_logger
from prefect.futures import PrefectConcurrentFuture
from prefect.utilities.annotations import quote

from flows.begin import begin_run, flow_run_name
from flows.live import LiveReport, artifact_key
from miles_core.config import RunConfig
from miles_core.audit import raise_if_unbalanced
from miles_core.run import RolloutRef, RunRefs, check_lease, checkpoint_due, close_session, eval_due, history_files
from miles_core.stopping import RunStopped, cancelled, stop_requested
from tasks.fleet import launch_producers, stop_producers
from tasks.slots import run_slots
from tasks.train import (
    check_data,
    evaluate,
    evaluate_version,
    finish_run,
    push_rollout_weights,
    push_weights,
    record_step,
    reserve_evaluation,
    resume_run,
    rollout,
    save_checkpoint,
    stop_run,
    train_from_stream,
    train_step,
)


REWARD_ERRORS = "_reward_errors"
"""The step's first reward failures, handed from a mode's steps to the flow's log (not recorded)."""


def _step_line(step: int, total: int, row: dict[str, Any]) -> str:
    line = f"step {step + 1:>3}/{total} | reward {row['reward_mean']:.3f} | acc {row['accuracy']:.3f} | loss {row['loss']:+.4f}"
    if "rollout_seconds" in row:
        line += f" | gen {row['rollout_tokens_per_s']:,.0f} tok/s | rollout {row['rollout_seconds']:.1f}s"
    else:  # fully async: the producer's side
        qps = row.get("async/producer_throughput_qps")
        line += " | producer starting" if qps is None else f" | producer {qps:,.2f} samples/s"
    line += f" | train {row['train_seconds']:.1f}s"
    if "push_seconds" in row:  # fully async: the producers load new weights themselves
        line += f" push {row['push_seconds']:.2f}s"
    line += f" | waited {row['trainer_wait_seconds']:.1f}s"
    if row.get("staleness_max"):
        line += f" | staleness max {row['staleness_max']:.0f}"
    return line + f" | step {row['step_seconds']:.1f}s"


def _eval_line(label: str, ev: dict[str, float]) -> str:
    line = f"eval {label}: accuracy {ev['accuracy']:.3f} on {int(ev['num_prompts'])} held-out prompts (weights v{int(ev['weight_version'])})"
    named = [(k.removesuffix("/accuracy"), v) for k, v in ev.items() if k.endswith("/accuracy")]
    if named:  # named eval datasets: the plain numbers are the first one's
        line += " | " + ", ".join(f"{name} {value:.3f}" for name, value in named)
    return line


@flow(name="train", flow_run_name=flow_run_name, validate_parameters=True)
def train(cfg: RunConfig) -> dict[str, Any]:
    """Train a policy with GRPO; returns the run summary (before/after accuracy, where things are).
    An existing run (``cfg.run_id``) with a checkpoint resumes from it."""
    log = get_run_logger()
    t_start = time.perf_counter()
    cfg, refs = begin_run(cfg)
    log.info("run %s: %s", refs.run_id, refs.run_dir)
    total = cfg.rollout.num_rollout
    try:
        counts = check_data(cfg, refs)
        log.info("prompts: %d for training, %d held out", counts["train_prompts"], counts["eval_prompts"])
        start = resume_run(cfg, refs) or 0
        if start >= total:
            log.info("run %s has done all %d of its steps (checkpoint at step %d): nothing left to train; "
                     "raise --num-rollout to continue it", refs.run_id, total, start)
        elif start:
            log.info("resuming run %s from checkpoint at step %d (steps %d to %d to go)", refs.run_id, start,
                     start + 1, total)
        live = LiveReport(cfg.name, artifact_key(cfg.name, refs.run_id), total, start, history_files(cfg, refs),
                          cfg.tracking.live_every_s)
        steps = {"sync": _sync_steps, "async": _async_steps, "fully_async": _fully_async_steps}[cfg.mode.type]
        with run_slots(cfg), InRunEvals(cfg, refs, log) as evals:
            if cfg.mode.type == "fully_async":  # the producers start (processes: seconds) while the start is evaluated
                launch_producers(cfg, refs)
            _before_training(cfg, refs, start, log)
            for step, row, r in steps(cfg, refs, start):
                reward_errors, shared_eval = row.pop(REWARD_ERRORS, []), None
                if eval_due(cfg, step + 1) and cfg.eval.engine == "shared":  # between steps (fully async: producers pause)
                    shared_eval = evaluate(quote(cfg), quote(refs), quote(step + 1))
                    row["eval_accuracy"] = shared_eval["accuracy"]
                elif eval_due(cfg, step + 1):  # on its own engine, beside the next steps
                    evals.submit(step + 1, row["version"], final=step + 1 == total)
                record_step(quote(cfg), quote(refs), quote(step + 1), quote(row))
                if checkpoint_due(cfg, step + 1):
                    save_checkpoint(quote(cfg), quote(refs), quote(step + 1), quote(r))
                log.info(_step_line(step, total, row))
                if row.get("reward_failed"):
                    log.warning("step %d: %d of %d samples' rewards failed (they train nothing): %s", step + 1,
                                int(row["reward_failed"]), int(row.get("num_samples", 0)),
                                "; ".join(reward_errors))
                if shared_eval is not None:
                    log.info(_eval_line(f"after step {step + 1}", shared_eval))
                live.step_done(step + 1, row)
                check_lease(refs)  # another trainer took this run over (after this one stalled): stop
                if stop_requested():  # Ctrl-C or SIGTERM of `miles train`: stop here, resumable when it can be
                    raise _stopped(cfg, refs, step + 1, r)
        summary, curves, png = finish_run(quote(cfg), quote(refs), quote(start), quote(time.perf_counter() - t_start))
        live.finish(note=f" (also {curves})", png=png)
        raise_if_unbalanced(summary["audit"], refs.run_dir)  # it trained, but lost or repeated prompts
        return summary
    except RunStopped as stop:  # asked to stop: Cancelled, with where it can resume from
        return cancelled(stop)
    finally:
        close_session(refs)


def _stopped(cfg: RunConfig, refs: RunRefs, done: int, r: RolloutRef | None) -> RunStopped:
    """The run was asked to stop after step ``done`` (``r``: that step's rollout, or None): it is
    checkpointed there if it keeps checkpoints."""
    text, step = stop_run(quote(cfg), quote(refs), quote(done), quote(r))
    return RunStopped(text, refs.run_id, step)


# ------------------------------------------------------------------------------ execution modes
# Each yields (step, metrics row, rollout ref or None) after every training step; the flow
# evaluates, records and checkpoints in between. Their ``finally`` leaves nothing running.


# Task inputs draw the flow run's graph. Prefect links an argument to an earlier task run when the
# argument, or a part of it, is that run's result, matched by ``id()`` where the object takes no
# weak reference (numbers, strings, lists): a new object at a freed result's address is taken for
# it, and a task got edges from runs it never used. So a step's tasks get every argument quoted (not
# searched) and the task before as ``wait_for``, one future, not a list (``_ran``): the graph reads
# prepare-run -> rollout-0 -> train-0 -> push-weights-v1 -> rollout-1 -> ... The tasks are called,
# not submitted: they run on the flow's thread, where a cancellation interrupts them.


def _ran(state) -> PrefectConcurrentFuture:
    """A task run that has ended (``task(..., return_state=True)``) as Prefect's own future, for
    ``wait_for=`` (a state itself would be searched through, result and all)."""
    done: Future = Future()
    done.set_result(state)
    return PrefectConcurrentFuture(state.state_details.task_run_id, done)


def _run(task, *args, after: Any = None) -> tuple[Any, PrefectConcurrentFuture]:
    """Call ``task`` (after ``after``, a future, if any): its result, and its run as a future."""
    state = task(*args, wait_for=after, return_state=True)
    return state.result(), _ran(state)


def _sync_steps(cfg: RunConfig, refs: RunRefs, start: int) -> Iterator[tuple[int, dict, RolloutRef]]:
    """rollout k -> train k -> push weights k."""
    c, q = quote(cfg), quote(refs)  # not introspected by Prefect on every call (they hold no futures)
    pushed = None
    for step in range(start, cfg.rollout.num_rollout):
        t0 = time.perf_counter()
        # the first rollout takes the refs as they are: its edge from prepare-run
        r, rolled = _run(rollout, c, q if pushed else refs, quote(step), after=pushed)
        t, trained = _run(train_step, c, q, quote(r), after=rolled)
        push_s, pushed = _run(push_weights, c, q, quote(t), after=trained)
        row = {**r.metrics, **t.metrics, "version": t.version, "push_seconds": push_s, REWARD_ERRORS: r.reward_errors}
        row["step_seconds"] = time.perf_counter() - t0
        row["trainer_wait_seconds"] = r.metrics["rollout_seconds"]
        yield step, _with_idle(row), r


def _async_steps(cfg: RunConfig, refs: RunRefs, start: int) -> Iterator[tuple[int, dict, RolloutRef]]:
    """Rollout k+1 is submitted before train k, so the two overlap. Weights are pushed (every
    ``update_weights_interval`` steps, and after the last) only once that rollout has finished:
    samples are at most ``update_weights_interval`` versions stale."""
    total, interval = cfg.rollout.num_rollout, cfg.mode.update_weights_interval
    c, q = quote(cfg), quote(refs)  # as in _sync_steps
    if start > 0:  # resumed: the redone rollouts are generated with the weights they first were
        push_rollout_weights(c, q, quote(start))
    ahead = rollout.submit(c, refs, quote(start))
    pushed = None  # the newest push: the rollouts submitted after it generate with its weights
    try:
        for step in range(start, total):
            t0 = time.perf_counter()
            r = ahead.result()
            waited = time.perf_counter() - t0
            if step == start > 0 and step + 1 < total:
                push_rollout_weights(c, q, quote(step + 1))
            rolled = ahead
            ahead = rollout.submit(c, q, quote(step + 1), wait_for=pushed) if step + 1 < total else None
            t, trained = _run(train_step, c, q, quote(r), after=rolled)
            push_s = 0.0
            if (step + 1) % interval == 0 or step + 1 == total:
                t_wait = time.perf_counter()
                if ahead is not None:  # no training rollout in flight while the weights change
                    ahead.wait()
                waited += time.perf_counter() - t_wait
                push_s, pushed = _run(push_weights, c, q, quote(t), after=trained)
            row = {**r.metrics, **t.metrics, "version": t.version, "push_seconds": push_s,
                   REWARD_ERRORS: r.reward_errors}
            row["step_seconds"] = time.perf_counter() - t0
            row["trainer_wait_seconds"] = waited
            yield step, _with_idle(row), r
    finally:
        if ahead is not None:
            ahead.wait()


def _fully_async_steps(cfg: RunConfig, refs: RunRefs, start: int) -> Iterator[tuple[int, dict, None]]:
    """The run's rollout fleet (child processes, or flow runs of ``mode.rollout_deployment``),
    started by ``launch-producers`` before the starting policy's evaluation, talks to the trainer
    only through the run folder; each ``train-k`` takes the next ``rollout_batch_size`` trainable
    groups from the producers' streams. Producers load new versions themselves; ``stop-producers``
    ends them."""
    c, q = quote(cfg), quote(refs)  # as in _sync_steps
    trained = None
    for step in range(start, cfg.rollout.num_rollout):
        t0 = time.perf_counter()
        try:
            t, trained = _run(train_from_stream, c, q if trained else refs, quote(step), after=trained)
        except RunStopped:  # asked to stop while waiting for data: the steps done so far are kept
            raise _stopped(cfg, refs, step, None) from None
        row = {**t.metrics, "version": t.version, "step_seconds": time.perf_counter() - t0,
               REWARD_ERRORS: t.reward_errors}
        yield step, _with_idle(row), None
    stop_producers(cfg, refs)  # a run that fails or is cancelled cancels them instead, in close_session


def _with_idle(row: dict[str, Any]) -> dict[str, Any]:
    row["trainer_idle_fraction"] = min(1.0, row["trainer_wait_seconds"] / max(row["step_seconds"], 1e-9))
    return row


@flow(name="evaluate", flow_run_name="{cfg.name}-step-{step}", validate_parameters=False)
def evaluate_snapshot(cfg: RunConfig, refs: RunRefs, step: int, version: int) -> dict[str, float]:
    """Evaluate weights ``version`` (after ``step`` steps) on the run's evaluation engine."""
    metrics = evaluate_version(cfg, refs, step, version)
    get_run_logger().info(_eval_line(f"after step {step}", metrics))
    return metrics


class InRunEvals:
    """In-run evaluations on the separate engine: each an ``evaluate`` subflow of the run, on a
    thread of its own, so training goes on meanwhile. At most ``eval.max_in_flight`` run at once;
    one more waits for the oldest (``overflow = "backpressure"``) or is skipped (``"skip"``, never
    the final step's). Leaving the block waits for all of them and raises the first failure."""

    def __init__(self, cfg: RunConfig, refs: RunRefs, log) -> None:
        self.cfg, self.refs, self.log = cfg, refs, log
        self.limit, self.overflow = cfg.eval.max_in_flight, cfg.eval.overflow
        self.futures: list[Future] = []
        self.skipped: list[int] = []

    def __enter__(self) -> "InRunEvals":
        self.pool = ThreadPoolExecutor(max_workers=self.limit, thread_name_prefix="eval")
        return self

    def submit(self, step: int, version: int, final: bool) -> None:
        running = [f for f in self.futures if not f.done()]
        if len(running) >= self.limit:
            if self.overflow == "skip" and not final:
                self.skipped.append(step)
                self.log.warning("evaluation after step %d skipped: %d still running (eval.overflow = skip)",
                                 step, len(running))
                return
            wait(running, return_when=FIRST_COMPLETED)
        reserve_evaluation(quote(self.cfg), quote(self.refs), quote(step), quote(version))
        # a copy of this flow's context per thread: the subflow is a child of the run
        # (the refs quoted: the subflow's node would otherwise hang off prepare-run, as a task's would)
        self.futures.append(self.pool.submit(contextvars.copy_context().run, evaluate_snapshot, self.cfg,
                                             quote(self.refs), step, version, return_state=True))

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True)
        if exc[0] is None:
            for future in self.futures:
                _raise_unless_completed(future.result())


def _raise_unless_completed(state) -> None:
    """A failed evaluation fails the run with its error. A completed one is not asked for its result:
    its row is in the run's history already, and a subflow state Prefect read back from its API may
    carry no data (``MissingResult``), which once failed a run whose evaluations had all succeeded."""
    from prefect.exceptions import MissingResult

    if state.is_completed():
        return
    try:
        state.result()  # raises the evaluation's own error
    except MissingResult:
        pass
    raise RuntimeError(f"in-run evaluation {state.name!r} ended {state.type.value}: {state.message}")


def _before_training(cfg: RunConfig, refs: RunRefs, start: int, log) -> None:
    """The starting policy's evaluation, on a fresh run (a resumed run has it in its history)."""
    if start > 0 or cfg.eval.skip_eval_before_train:
        return
    if cfg.mode.type == "fully_async" and cfg.eval.engine == "separate":  # the trainer's process has no rollout engine
        before = evaluate_version(cfg, refs, 0, 0)
    else:
        before = evaluate(cfg, refs, 0)
    log.info(_eval_line("before training", before))
