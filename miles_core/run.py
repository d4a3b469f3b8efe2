"""One training run's work, step by step, without Prefect.

- ``prepare_run(cfg) -> RunRefs``: builds or finds the starting model, creates the run folder and
  writes the config (without secrets).
- ``RunSession``: one training process's run, composed of its parts (``miles_core.session``):
  ``rollouts`` (the policy engine, prompts, reward), ``training`` (the trainer, the fully-async
  feed), ``evals`` (held-out evaluation), ``history`` (``metrics.jsonl``, ``eval.jsonl``) and
  ``checkpoints``, over one ``RunFiles`` and one ``EngineLoop``. Each part is built lazily and can
  be rebuilt from the run folder and the config; sessions are kept per run folder by
  ``get_session`` (a cache: a task in a fresh process builds a new one).
- What needs more than one part is here: ``check_data``, ``evaluate`` (on the rollout engine,
  the fleet paused), ``save_checkpoint`` / ``resume`` (the trainer state and the prompt cursor after
  step k go to ``checkpoints/step-<k>/`` when ``checkpoint_due``; ``resume`` puts the run back to its
  newest complete checkpoint, so the steps after it are redone exactly as they first ran),
  ``start_fleet`` / ``stop_fleet``, ``stop_note`` (a run asked to stop), ``summary``, ``finish`` and
  ``close``.
- ``history_files(cfg, refs)``: the run's history as its files hold it (for the flow's live report).

Prefect tasks in ``tasks/`` call these and the parts' step methods; ``flows/train.py`` orders them.
Every step returns a small, JSON-able reference (``miles_core.session.refs``).
"""

from __future__ import annotations

import threading
from typing import Any

from miles_core.config import RunConfig
from miles_core.session.checkpoints import Checkpointer
from miles_core.session.evals import Evaluator
from miles_core.session.history import HistoryFiles, RunHistory
from miles_core.session.parts import EngineLoop, RunFiles, is_built, trainer_weights
from miles_core.session.refs import RolloutRef, RunRefs, TrainRef
from miles_core.session.rollouts import RolloutSide
from miles_core.session.training import TrainerSide
from miles_core.trackers import open_trackers

__all__ = ["RolloutRef", "RunRefs", "RunSession", "TrainRef", "checkpoint_due", "close_session", "get_session",
           "history_files", "prepare_run"]


FRESH_FEED = {"streams": {}}
"""A fully-async run with no checkpoint: every stream is read from its start."""


def eval_due(cfg: RunConfig, step: int) -> bool:
    """Whether the run evaluates after ``step`` (1-based) training steps: every ``eval_interval``,
    and after the last."""
    interval = cfg.eval.eval_interval
    return step == cfg.rollout.num_rollout or (interval is not None and step % interval == 0)


def checkpoint_due(cfg: RunConfig, step: int) -> bool:
    """Whether the run saves a checkpoint after ``step`` (1-based) training steps."""
    interval = cfg.checkpoint.save_interval
    return interval is not None and (step % interval == 0 or step == cfg.rollout.num_rollout)


def prepare_run(cfg: RunConfig, log=print, owner: dict[str, Any] | None = None) -> RunRefs:
    """Build or find the starting model, take the run's lease (one trainer per run: ``RunBusy``
    when another process trains this run id; ``owner`` is what the lease says of this one, e.g.
    its flow run), move damaged sample segments of an earlier start aside (``set_aside_damaged``),
    then write the config (without secrets)."""
    from miles_core.models import ensure_model
    from miles_core.storage.lease import RunLease
    from miles_core.storage.layout import RunLayout, new_run_id
    from miles_core.storage.stream import set_aside_damaged

    model_dir = ensure_model(cfg.model, log=log)
    run_id = cfg.run_id or new_run_id()
    layout = RunLayout(cfg.storage.root, cfg.name, run_id, cfg.storage.storage_options)
    lease = RunLease(layout, owner).acquire()
    with _LEASES_LOCK:
        _LEASES[layout.run_dir] = lease
    for line in set_aside_damaged(layout.run_dir, cfg.storage.storage_options):  # a resumed run's, before any reader
        log(f"a damaged sample segment was moved aside (its prompts not trained yet are generated again): {line}")
    layout.write_json("config.json", cfg.public_dict())
    return RunRefs(run_id=run_id, run_dir=layout.run_dir, model_dir=str(model_dir))


_LEASES: dict[str, Any] = {}
_LEASES_LOCK = threading.Lock()


def release_lease(refs: RunRefs) -> None:
    """Give back the run's lease (``prepare_run`` took it); nothing if this process holds none."""
    with _LEASES_LOCK:
        lease = _LEASES.pop(refs.run_dir, None)
    if lease is not None:
        lease.release()


def check_lease(refs: RunRefs) -> None:
    """Raise ``RunBusy`` if another trainer took the run's lease over from this one."""
    from miles_core.storage.lease import RunBusy

    with _LEASES_LOCK:
        lease = _LEASES.get(refs.run_dir)
    if lease is not None and lease.lost:
        raise RunBusy(f"run {refs.run_id} lost its lease ({lease.lost}); this trainer stops")


class RunSession:
    """One training process's run: its parts, and what needs more than one of them."""

    def __init__(self, cfg: RunConfig, refs: RunRefs) -> None:
        self.cfg, self.refs = cfg, refs
        self.files = RunFiles.open(cfg, refs)
        self.loop = EngineLoop()
        self.training = TrainerSide(cfg, refs, self.files, producers=lambda: self.fleet)
        trainer = lambda: self.training.trainer  # noqa: E731 (built when an engine first needs its weights)
        self.rollouts = RolloutSide(cfg, refs, self.files, self.loop,
                                    lent=trainer_weights(cfg, cfg.engine, trainer, rollout=True))
        self.trackers = open_trackers(cfg, refs.run_id, refs.run_dir)
        self.history = RunHistory(self.files.layout, self.trackers)
        self.evals = Evaluator(cfg, refs, self.loop, self.files.weights, self.history, lambda: self.rollouts.tokenizer,
                               lent=trainer_weights(cfg, cfg.eval.engine_config or cfg.engine, trainer, rollout=False))
        self.checkpoints = Checkpointer(cfg, refs, self.files)
        self.fleet = None
        """Fully async: the run's rollout fleet (``start_fleet``), which the trainer reads from."""

    @property
    def layout(self):
        return self.files.layout

    @property
    def weights(self):
        return self.files.weights

    def check_data(self) -> dict[str, int]:
        """Load the training and held-out prompts now, so a bad dataset fails the run before any work.
        ``eval_prompts`` counts the prompts of every held-out dataset."""
        return {"train_prompts": len(self.rollouts.source), "eval_prompts": sum(map(len, self.evals.items.values()))}

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluate the rollout engine's current weights on the held-out prompts (in one call). A
        fully-async run's engine here is the trainer's own: it loads the latest version first, and
        the fleet's producers pause meanwhile (through the run folder), as if it were theirs."""
        if self.fleet is None:
            return self.evals.evaluate_on(self.rollouts.engine, step)
        holder = f"eval-step-{step}"
        self.fleet.pause(holder)
        try:
            version = self.weights.latest() or 0
            self.rollouts.push_weights(self.training.weights_uri(version), version)
            return self.evals.evaluate_on(self.rollouts.engine, step)
        finally:
            self.fleet.resume(holder)

    # -- checkpoints

    def save_checkpoint(self, step: int, source_state: dict[str, Any] | None) -> str:
        """Save the run after ``step`` steps (see ``Checkpointer.save``; a fully-async run keeps its
        feed's cursors, ``source_state`` None); returns the folder."""
        feed = self.training.feed_state() if self.cfg.mode.type == "fully_async" else None
        return self.checkpoints.save(step, self.training.trainer, source_state, feed)

    def resume(self) -> int | None:
        """Put the run back to its newest complete checkpoint (``Checkpointer.restore``); returns its
        step (the next step to run is that + 1), or None for a fresh run. Call it before the first
        rollout. A rollout side already built takes the checkpoint's prompt cursor and weights
        (else it reads them when built)."""
        restored = self.checkpoints.restore(self.training.trainer, self.history)
        if self.cfg.mode.type == "fully_async":  # the streams' cursors go back with the trainer
            self.training.restore_feed((restored[1] if restored else {}).get("feed") or FRESH_FEED)
        if restored is None:
            if is_built(self.rollouts, "source"):  # it read the prompt cursor of a first step that never finished
                self.rollouts.source.load_state(self.rollouts.source.start_state())
            return None
        step, state = restored
        if is_built(self.rollouts, "source") and state["data_source"] is not None:
            self.rollouts.source.load_state(state["data_source"])
        if is_built(self.rollouts, "engine"):
            version = state["version"]
            self.rollouts.push_weights(self.training.weights_uri(version), version)
        return step

    def stop_note(self, done: int, source_state: dict[str, Any] | None) -> tuple[str, int | None]:
        """The run was asked to stop after step ``done``: save a checkpoint there if the run keeps them
        (and has none there yet); returns what to say and the step it resumes from (None: none)."""
        text = f"run {self.refs.run_id} stopped after step {done} of {self.cfg.rollout.num_rollout}, as asked"
        if done == 0:
            return f"{text}; nothing to checkpoint before the first step (the same command starts it again)", None
        if self.cfg.checkpoint.save_interval is None:
            why = "set --save-interval N to make a run resumable"
            return f"{text}; no checkpoint ({why}); its steps are in {self.layout.metrics}", None
        if done not in self.layout.checkpoints():
            self.save_checkpoint(done, source_state)
        return f"{text}; checkpoint at step {done}: {self.layout.checkpoint(done)}", done

    def async_rollout_version(self, k: int) -> int:
        """The weights version the engine held when an uninterrupted async run submitted rollout ``k``
        (0-based): it is submitted before step k's training starts, so it is generated with the version
        pushed after the last step n <= k - 1 (1-based) with n % interval == 0 (0: none yet)."""
        interval = self.cfg.mode.update_weights_interval
        pushed = [r["version"] for r in self.history.metrics_rows if r["step"] <= k - 1 and r["step"] % interval == 0]
        return int(pushed[-1]) if pushed else 0

    # -- fully async: a fleet of producers, a trainer that consumes

    def start_fleet(self, launcher, warn=print):
        """Launch the run's rollout producers (``mode.rollout_producers``) with ``launcher``;
        the trainer's feed reads their streams from then on."""
        from miles_core.rollout.supervisor import Fleet

        self.fleet = Fleet(self.cfg, self.refs, launcher, self.files.stream, warn=warn)
        self.fleet.start()
        return self.fleet

    def stop_fleet(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()

    def summary(self, start: int, seconds: float) -> dict[str, Any]:
        """The run's summary: where its files are, its held-out accuracy before training (its step-0
        evaluation) and after (its last), ``start`` (the step it resumed from) and its wall time."""
        evals = self.history.eval_rows
        before = next((e for e in evals if e["step"] == 0), None)
        after = evals[-1] if evals else None
        return {
            "run_id": self.refs.run_id,
            "resumed_from_step": start or None,
            "run_dir": self.refs.run_dir,
            "model_dir": self.refs.model_dir,
            "steps": self.cfg.rollout.num_rollout,
            "accuracy_before": before["accuracy"] if before else None,
            "accuracy_after": after["accuracy"] if after else None,
            "final_version": self.weights.latest(),
            "metrics": self.layout.metrics,
            "eval": self.layout.eval,
            "samples": self.layout.samples() if self.fleet is None else self.layout.url("samples"),
            "weights": self.layout.weights,
            "seconds": round(seconds, 1),
            **({"producers": self.fleet.summary()} if self.fleet is not None else {}),
        }

    def finish(self, summary: dict[str, Any]) -> None:
        """End the run's sample stream (readers see ``_END``) and write ``summary.json``."""
        self.files.stream.close()
        self.layout.write_json("summary.json", summary)
        self.trackers.close(ok=True)

    def close(self) -> None:
        if self.fleet is not None:  # a run that ends by an error: its producers must not outlive it
            self.fleet.cancel()
        self.training.close()
        self.evals.close()
        self.rollouts.close()
        self.loop.close()
        self.trackers.close(ok=False)  # nothing when finish closed them


class RunRegistry:
    """The process's live objects of one kind (sessions, multi-LoRA runs), one per run folder:
    ``get`` builds it on first use (``factory(cfg, refs)``), ``close`` drops and closes it."""

    def __init__(self, factory) -> None:
        self.factory = factory
        self.live: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, cfg: RunConfig, refs: RunRefs):
        """The run's live object; a config other than the one it was built with is refused (the
        object would go on with its own)."""
        with self._lock:
            if refs.run_dir not in self.live:
                self.live[refs.run_dir] = self.factory(cfg, refs)
            live = self.live[refs.run_dir]
        if cfg is not live.cfg and cfg.model_dump() != live.cfg.model_dump():
            raise ValueError(f"run {refs.run_dir} is live in this process with another config; "
                             "a run's config cannot change while it runs (start it again, or use a new run id)")
        return live

    def close(self, refs: RunRefs) -> None:
        with self._lock:
            obj = self.live.pop(refs.run_dir, None)
        if obj is not None:
            obj.close()


_SESSIONS = RunRegistry(RunSession)


# plain functions, not the registry's bound methods: flows that import them are cloudpickled by
# Prefect's runner (deployments), and the registry holds a lock, which does not pickle
def get_session(cfg: RunConfig, refs: RunRefs) -> RunSession:
    return _SESSIONS.get(cfg, refs)


def history_files(cfg: RunConfig, refs: RunRefs) -> HistoryFiles:
    """The run's history as its files hold it, read at each look (builds no session)."""
    from miles_core.storage.fs import outage_retry
    from miles_core.storage.layout import RunLayout

    retry = outage_retry(cfg.storage.max_outage_s)
    return HistoryFiles(RunLayout(cfg.storage.root, cfg.name, refs.run_id, cfg.storage.storage_options, retry=retry))


def close_session(refs: RunRefs) -> None:
    try:
        _SESSIONS.close(refs)
    finally:
        release_lease(refs)
