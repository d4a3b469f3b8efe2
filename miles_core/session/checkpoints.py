"""Saving a run and putting it back: ``checkpoints/step-<k>/`` holds the trainer's state and then
``state.json`` (step, weight version, the prompt cursor of that step's rollout; a fully-async
run: the feed's cursors instead, see ``TrainerSide.feed_state``), which makes the checkpoint
complete; ``checkpoint.keep_checkpoints`` of them are kept."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from miles_core import ledger
from miles_core.config import RunConfig
from miles_core.session.history import RunHistory
from miles_core.session.parts import SOURCE_STATE, RunFiles
from miles_core.session.refs import RunRefs

if TYPE_CHECKING:
    from miles_core.train.base import Trainer


log = logging.getLogger(__name__)


def checkpoint_versions(layout, lookback: int = 0) -> set[int]:
    """The weight versions a resume from the run's complete checkpoints loads (retention keeps them):
    each checkpoint's own, and with ``lookback`` (an async run's ``update_weights_interval``) the
    versions pushed in the ``lookback`` steps before it (from the run's metrics): an async run
    resumed after step k redoes rollout k with the version pushed last before k."""
    from miles_core.storage.layout import CHECKPOINT_STATE, checkpoint_dir

    versions, steps = set(), []
    for step in layout.checkpoints():
        state = layout.read_json(f"{checkpoint_dir(step)}/{CHECKPOINT_STATE}")
        if isinstance(state, dict) and isinstance(state.get("version"), int):
            versions.add(state["version"])
            steps.append(step)
    if lookback and steps:  # the pushes (steps n with n % lookback == 0) of the window before each checkpoint
        for row in layout.read_jsonl("metrics.jsonl"):
            n = row.get("step", -1)
            if n % lookback == 0 and any(s - lookback <= n <= s for s in steps) and isinstance(row.get("version"), int):
                versions.add(row["version"])
    return versions


class Checkpointer:
    def __init__(self, cfg: RunConfig, refs: RunRefs, files: RunFiles) -> None:
        self.cfg, self.refs, self.files = cfg, refs, files
        self.skipped: list[str] = []
        """The checkpoints the last ``restore`` could not load, each with why."""

    def save(self, step: int, trainer: Trainer, source_state: dict[str, Any] | None,
             feed_state: dict[str, Any] | None = None) -> str:
        """Save the run after ``step`` steps, then prune; returns the checkpoint's folder.
        ``source_state``: the prompt cursor (None in a fully-async run, whose prompt log is its
        cursor); ``feed_state``: a fully-async run's feed."""
        from miles_core.storage.layout import TRAINER_STATE

        layout = self.files.layout
        state = {"step": step, "version": trainer.version, "data_source": source_state}
        if feed_state is not None:
            state["feed"] = feed_state
        folder = layout.write_checkpoint(step, lambda url: trainer.save(f"{url}/{TRAINER_STATE}"), state)
        layout.prune_checkpoints(self.cfg.checkpoint.keep_checkpoints)
        return folder

    def restore(self, trainer: Trainer, history: RunHistory) -> tuple[int, dict[str, Any]] | None:
        """Put the run's files and ``trainer`` back to the newest complete checkpoint; returns its step
        and state (``version``, ``data_source``), or None for a fresh run.

        After the checkpoint at step k (weights version v):
        - the trainer loads its state; the prompt cursor is the checkpoint's (``state/data_source.json``
          may be newer), and is written back there so a rebuilt rollout side agrees;
        - the weight store rolls back to v (``WeightStore.rollback``: LATEST back to v, newer
          versions deleted, since the redone steps publish them again);
        - ``metrics.jsonl``, ``eval.jsonl`` and the prompt ledger keep their rows of steps <= k;
        - sample segments written by the redone steps stay in the stream as history (the redone
          steps append new ones after them; the trainer reads each step's segment by offset), and
          a stream closed by a finished run is reopened (its ``_END`` removed).

        A checkpoint that cannot be loaded (a truncated ``state.json`` or trainer state) is named in a
        warning and the next older one is used (``skipped`` lists them); when none loads, a
        RuntimeError lists each and why. RuntimeError too when the run has steps in
        ``metrics.jsonl`` but no checkpoint (it cannot go on without redoing them over old data; the
        message names the incomplete checkpoint folders it found); incomplete folders are deleted
        otherwise (left by saves that did not finish). A run
        with neither (killed in its first step) starts again from the first prompt (``state/data_source.json``
        is removed);
        ValueError when the newest checkpoint is past ``num_rollout``."""
        layout = self.files.layout
        steps = self._complete_checkpoints(history)
        if not steps:
            ledger.rewind(layout, 0)  # a step that was killed before its metrics row
            layout.remove(SOURCE_STATE)  # and the prompts its rollout drew: the restarted run draws them again
            return None
        if steps[-1] > self.cfg.rollout.num_rollout:
            raise ValueError(
                f"run {self.refs.run_id} has a checkpoint at step {steps[-1]}, past rollout.num_rollout="
                f"{self.cfg.rollout.num_rollout}; set --num-rollout to {steps[-1]} or more to continue it"
            )
        unusable = []
        for step in reversed(steps):  # the newest that loads: a damaged one is named and passed over
            try:
                state = self._load(step, trainer)
            except Exception as e:  # noqa: BLE001 (any failure to load makes it unusable; it is reported)
                unusable.append(f"{layout.checkpoint(step)}: {type(e).__name__}: {e}"[:500])
                log.warning("checkpoint %s cannot be loaded (%s: %s); trying the next older one",
                            layout.checkpoint(step), type(e).__name__, e)
                continue
            self.files.weights.rollback(state["version"])
            if state["data_source"] is not None:
                layout.write_json(SOURCE_STATE, state["data_source"])
            history.rewind(step)
            ledger.rewind(layout, step)
            self._reopen_stream()
            self.skipped = unusable
            return step, state
        raise RuntimeError(f"run {self.refs.run_id}: none of its checkpoints can be loaded:\n" + "\n".join(unusable))

    def _complete_checkpoints(self, history: RunHistory) -> list[int]:
        """The steps of the run's complete checkpoints, once incomplete folders (failed saves) are
        deleted; RuntimeError for a run with steps in ``metrics.jsonl`` and no checkpoint."""
        from miles_core.storage.layout import CHECKPOINTS

        layout = self.files.layout
        steps, incomplete = layout.checkpoints(), layout.incomplete_checkpoints()
        if not steps and history.has_steps():
            found = (f"; in {layout.url(CHECKPOINTS)} only incomplete checkpoint folders (saves that did not "
                     f"finish): {', '.join(incomplete)}" if incomplete else "")
            why = ("" if self.cfg.checkpoint.save_interval is None else
                   f" (it saves one every {self.cfg.checkpoint.save_interval} steps: none was completed)")
            raise RuntimeError(
                f"run {self.refs.run_id} ({self.refs.run_dir}) already has training steps in metrics.jsonl but "
                f"no checkpoint to resume from{why}{found}; use a new run id"
                + (", and set checkpoint.save_interval (--save-interval N) to make a run resumable"
                   if self.cfg.checkpoint.save_interval is None else "")
            )
        for name in incomplete:  # nothing else writes this run (its lease): what is there was left by a failed save
            layout.remove_checkpoint_folder(name)
            log.warning("removed checkpoint folder %s: incomplete (a save that did not finish)",
                        layout.url(CHECKPOINTS, name))
        return steps

    def _load(self, step: int, trainer: Trainer) -> dict[str, Any]:
        """Checkpoint ``step``'s state (checked) with ``trainer`` loaded from it; raises what broke."""
        from miles_core.storage.layout import CHECKPOINT_STATE, TRAINER_STATE, checkpoint_dir

        layout = self.files.layout
        state = layout.read_json(f"{checkpoint_dir(step)}/{CHECKPOINT_STATE}")
        missing = [k for k in ("step", "version", "data_source") if not isinstance(state, dict) or k not in state]
        if missing:
            raise ValueError(f"{CHECKPOINT_STATE} has no {', '.join(missing)}")
        trainer.load(layout.checkpoint(step, TRAINER_STATE))
        if trainer.version != state["version"]:
            raise ValueError(f"trainer state is at weights version {trainer.version}, {CHECKPOINT_STATE} says "
                             f"{state['version']}")
        return state

    def _reopen_stream(self) -> None:
        """Remove the ``_END`` a finished run wrote, so the resumed run appends after its segments.
        (The stream reads ``_END`` on its first append, which comes after this.)"""
        from miles_core.storage.fs import join
        from miles_core.storage.stream import END_MARKER

        stream = self.files.stream
        end = join(stream.path, END_MARKER)
        if stream.fs.exists(end):
            stream.fs.rm_file(end)
