"""Saving a run and putting it back: ``checkpoints/step-<k>/`` holds the trainer's state and then
``state.json`` (step, weight version, the prompt cursor of that step's rollout), which makes the
checkpoint complete; ``checkpoint.keep_checkpoints`` of them are kept."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles_core.config import RunConfig
from miles_core.session.history import RunHistory
from miles_core.session.parts import SOURCE_STATE, RunFiles
from miles_core.session.refs import RunRefs

if TYPE_CHECKING:
    from miles_core.train.base import Trainer


class Checkpointer:
    def __init__(self, cfg: RunConfig, refs: RunRefs, files: RunFiles) -> None:
        self.cfg, self.refs, self.files = cfg, refs, files

    def save(self, step: int, trainer: Trainer, source_state: dict[str, Any]) -> str:
        """Save the run after ``step`` steps, then prune; returns the checkpoint's folder."""
        from miles_core.storage.layout import CHECKPOINT_STATE, TRAINER_STATE, checkpoint_dir

        layout = self.files.layout
        trainer.save(layout.checkpoint(step, TRAINER_STATE))
        state = {"step": step, "version": trainer.version, "data_source": source_state}
        layout.write_json(f"{checkpoint_dir(step)}/{CHECKPOINT_STATE}", state)
        layout.prune_checkpoints(self.cfg.checkpoint.keep_checkpoints)
        return layout.checkpoint(step)

    def restore(self, trainer: Trainer, history: RunHistory) -> tuple[int, dict[str, Any]] | None:
        """Put the run's files and ``trainer`` back to the newest complete checkpoint; returns its step
        and state (``version``, ``data_source``), or None for a fresh run.

        After the checkpoint at step k (weights version v):
        - the trainer loads its state; the prompt cursor is the checkpoint's (``state/data_source.json``
          may be newer), and is written back there so a rebuilt rollout side agrees;
        - the weight store rolls back to v (``WeightStore.rollback``: LATEST back to v, newer
          versions deleted, since the redone steps publish them again);
        - ``metrics.jsonl`` and ``eval.jsonl`` keep their rows of steps <= k;
        - sample segments written by the redone steps stay in the stream as history (the redone
          steps append new ones after them; the trainer reads each step's segment by offset), and
          a stream closed by a finished run is reopened (its ``_END`` removed).

        RuntimeError when the run has steps in ``metrics.jsonl`` but no checkpoint (it cannot go on
        without redoing them over old data); ValueError when the checkpoint is past ``num_rollout``."""
        from miles_core.storage.layout import CHECKPOINT_STATE, TRAINER_STATE, checkpoint_dir

        layout = self.files.layout
        step = layout.latest_checkpoint()
        if step is None:
            if history.has_steps():
                raise RuntimeError(
                    f"run {self.refs.run_id} ({self.refs.run_dir}) already has training steps in metrics.jsonl but "
                    "no checkpoint to resume from; use a new run id, and set checkpoint.save_interval "
                    "(--save-interval N) to make a run resumable"
                )
            return None
        if step > self.cfg.rollout.num_rollout:
            raise ValueError(
                f"run {self.refs.run_id} has a checkpoint at step {step}, past rollout.num_rollout="
                f"{self.cfg.rollout.num_rollout}; set --num-rollout to {step} or more to continue it"
            )
        state = layout.read_json(f"{checkpoint_dir(step)}/{CHECKPOINT_STATE}")
        version = state["version"]
        self.files.weights.rollback(version)
        trainer.load(layout.checkpoint(step, TRAINER_STATE))
        if trainer.version != version:
            raise ValueError(f"checkpoint {layout.checkpoint(step)}: trainer state is at weights version "
                             f"{trainer.version}, state.json says {version}")
        layout.write_json(SOURCE_STATE, state["data_source"])
        history.rewind(step)
        self._reopen_stream()
        return step, state

    def _reopen_stream(self) -> None:
        """Remove the ``_END`` a finished run wrote, so the resumed run appends after its segments.
        (The stream reads ``_END`` on its first append, which comes after this.)"""
        from miles_core.storage.fs import join
        from miles_core.storage.stream import END_MARKER

        stream = self.files.stream
        end = join(stream.path, END_MARKER)
        if stream.fs.exists(end):
            stream.fs.rm_file(end)
