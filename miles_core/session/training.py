"""The training side of a run: its trainer, and in a fully-async run the feed it trains from.

``TrainerSide`` trains a sync or async run's segment (``train``) or the next batch of a fully-async
run's streams (``train_from_stream``), and publishes each new version to the weight store. What it
reads in a fully-async run is its ``Producers`` (a fleet, or a multi-LoRA run's producer): every
producer's stream, a dead one's up to its fence, under its own reader name and through a view for a
multi-LoRA adapter (``reader``, ``view``).

A step that changes nothing (every sample's reward failed, or the loss or gradient norm was not
finite) publishes no version and is counted (``skipped_step`` in its metrics, a warning);
``train.max_skipped_steps`` of them in a row raise ``SkippedSteps``, which names each and why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from miles_core.config import RunConfig
from miles_core.ledger import write_step
from miles_core.rewards import MAX_ERRORS_KEPT, reward_errors
from miles_core.rollout.generate import rollout_metrics
from miles_core.session.parts import RunFiles, built_once, weights_uri
from miles_core.session.refs import RolloutRef, RunRefs, TrainRef
from miles_core.stopping import RunStopped, stop_requested
from miles_core.types import Group

if TYPE_CHECKING:
    from miles_core.rollout.consumer import GroupFeed, GroupView
    from miles_core.storage.stream import SampleStream

log = logging.getLogger(__name__)


class Producers(Protocol):
    """What a fully-async trainer trains from: a fleet (``rollout.supervisor.Fleet``), or a multi-LoRA
    run's producer as one adapter sees it (``multi_lora.RunProducer``)."""

    def streams(self) -> list[tuple[SampleStream, int | None]]:
        """Every producer's stream, each with its fence (the last offset to read; None: no fence)."""

    def recycle(self, groups: list[Group]) -> None:
        """Give the prompts of groups the trainer rejected back to the pool."""

    def check(self) -> None:
        """Raise if the producers failed (the feed calls it for every batch and as it waits)."""

    def metrics(self) -> dict[str, float]:
        """The producers' throughput and idle share since the last call."""


class SkippedSteps(RuntimeError):
    """Too many training steps in a row changed nothing (``train.max_skipped_steps``)."""


class TrainerSide:
    def __init__(self, cfg: RunConfig, refs: RunRefs, files: RunFiles, *, reader: str = "trainer",
                 view: GroupView | None = None, producers: Callable[[], Producers | None] = lambda: None,
                 fleet_dir: str | None = None, build_trainer: Callable[[], Any] | None = None) -> None:
        self.cfg, self.refs, self.files = cfg, refs, files
        self.build_trainer = build_trainer
        """Builds the trainer (a multi-LoRA adapter's, on the run's shared base); None: ``setup_trainer``."""
        self.fleet_dir = fleet_dir or refs.run_dir
        """The run folder whose ``fleet/`` (prompt log, heartbeats) this trainer's producers use (a
        multi-LoRA adapter's folder is below its run's)."""
        self.reader, self.view = reader, view
        self.producers = producers
        """Fully async: what the feed reads, asked for when the feed is built (a run's fleet starts
        after its trainer is restored); None: nothing started yet."""
        self.skipped_in_a_row: list[str] = []
        """The latest steps that changed nothing, and why (``train.max_skipped_steps`` fail the run)."""
        self.done_before: set[int] = set()
        """Fully async, resumed: groups settled before the checkpoint (``restore_feed``)."""
        self.rejections_before: list[list] = []
        """Fully async, resumed: rejections the checkpoint had not written to the ledger yet."""
        self._feed: GroupFeed | None = None

    @built_once
    def trainer(self):
        from miles_core.train import setup_trainer

        if self.build_trainer is not None:
            return self.build_trainer()
        return setup_trainer(
            self.cfg.trainer_config(), self.refs.model_dir, self.files.weights, self.cfg.model.dtype, lora=self.cfg.lora,
            storage_options=self.cfg.storage.storage_options,
        )

    def weights_uri(self, version: int) -> str:
        return weights_uri(self.files.weights, self.refs, version)

    def train(self, rollout: RolloutRef) -> TrainRef:
        """Read the rollout's segment, compute GRPO advantages, step the trainer, publish weights."""
        from miles_core.types import regroup

        t0 = time.perf_counter()
        groups = regroup(self.files.stream.read_segment(rollout.offset).samples())
        ref = self.train_groups(rollout.step, groups)
        write_step(self.files.layout, rollout.step + 1, ref.version, groups, segment=rollout.offset,
                   cursor=rollout.source_state)
        self.files.stream.reader(self.reader).commit(rollout.offset)
        ref.metrics["train_seconds"] = time.perf_counter() - t0
        return ref

    def train_groups(self, step: int, groups: list[Group]) -> TrainRef:
        """One training step on ``groups``: advantages, optimizer step(s), publish the new version.
        Metrics include how stale the groups were (versions between the trainer and their oldest span)."""
        from miles_core.rollout.buffer import group_lag
        from miles_core.train.base import TrainBatch

        t0 = time.perf_counter()
        lags = [group_lag(g, self.trainer.version) for g in groups]
        batch = TrainBatch.from_groups(groups, self.cfg.rollout.rollout_temperature, loss=self.cfg.train.loss)
        metrics = self.trainer.step(batch)
        version = self.trainer.version
        if metrics["num_optimizer_steps"] > 0:
            uri = self.trainer.export(version)
            self._retain()
            self.skipped_in_a_row = []
        else:  # nothing applied (every sample failed, or nothing finite): the engine keeps its weights
            uri = self.weights_uri(version)
            self._skipped(step, metrics, groups)
        seconds = time.perf_counter() - t0
        metrics.update(
            train_seconds=seconds,
            train_tokens_per_s=metrics.get("train_tokens", 0.0) / max(seconds, 1e-9),
            staleness_mean=sum(lags) / max(len(lags), 1),
            staleness_max=float(max(lags, default=0)),
        )
        return TrainRef(step=step, version=version, weights_uri=uri, metrics=metrics)

    def _retain(self) -> None:
        """Delete weight versions but the newest ``storage.keep_snapshots``, the checkpoints' and pinned
        ones (an evaluation's), so a long run's snapshots stay bounded."""
        from miles_core.session.checkpoints import checkpoint_versions

        keep = self.cfg.storage.keep_snapshots
        if keep is not None:
            lookback = self.cfg.mode.update_weights_interval if self.cfg.mode.type == "async" else 0
            # the checkpoint of this step is written after this: its resume's version is among the newest
            deleted = self.files.weights.retain(max(keep, lookback + 1),
                                                pinned=checkpoint_versions(self.files.layout, lookback))
            if deleted:
                log.debug("weight versions deleted by retention: %s", deleted)

    def _skipped(self, step: int, metrics: dict[str, float], groups: list[Group]) -> None:
        """Count a step that changed nothing; ``train.max_skipped_steps`` in a row fail the run."""
        failed = [s for g in groups for s in g.samples if s.reward is None]
        if metrics.get("num_nonfinite_steps", 0) > 0:
            why = f"its loss or gradient norm was not finite ({metrics['num_nonfinite_steps']:.0f} optimizer step(s))"
        else:
            errors = sorted({s.error for s in failed if s.error})[:3]
            why = (f"{len(failed)} of {int(metrics['num_samples'])} samples had no valid reward"
                   + (f" ({'; '.join(errors)})" if errors else ""))
        metrics["skipped_step"] = 1.0
        self.skipped_in_a_row.append(f"step {step + 1}: {why}")
        limit = self.cfg.train.max_skipped_steps
        if len(self.skipped_in_a_row) >= limit:
            raise SkippedSteps(
                f"{limit} training steps in a row changed nothing, so the run stops (--max-skipped-steps {limit}):\n"
                + "\n".join(self.skipped_in_a_row)
            )
        log.warning("training step %d changed nothing: %s (%d of --max-skipped-steps %d in a row)",
                    step + 1, why, len(self.skipped_in_a_row), limit)

    # -- fully async

    def feed(self, warn=None) -> GroupFeed:
        """The trainer's side of the stream (built once; ``warn`` receives no-progress warnings)."""
        if self._feed is None:
            from miles_core.rollout.buffer import make_buffer
            from miles_core.rollout.consumer import GroupFeed

            a = self.cfg.mode
            capacity = max(1, round(a.buffer_capacity_factor * self.cfg.rollout.rollout_batch_size))
            buffer = make_buffer(a, capacity, first_version=self.trainer.version, path=a.custom_data_buffer_path)
            producers = self.producers()
            if producers is None:
                raise RuntimeError("a fully-async trainer reads its producers' streams: start its fleet first")
            kwargs: dict[str, Any] = {"warn": warn} if warn is not None else {}
            self._feed = GroupFeed(self.files.stream, buffer, a, producers.streams, producers.recycle,
                                   reader=self.reader, view=self.view, read_ahead=a.read_ahead,
                                   producer_check=producers.check, done=self.done_before, **kwargs)
            self._feed.rejections = list(self.rejections_before)
        return self._feed

    def train_from_stream(self, step: int, warn=None) -> TrainRef:
        """Wait for ``rollout_batch_size`` trainable groups from the producers, train on them,
        publish the new version (the producers load it), and report the step's async metrics."""
        t0 = time.perf_counter()
        feed = self.feed(warn)
        n = self.cfg.rollout.rollout_batch_size
        batch = feed.next_batch(n, self.trainer.version, stop=stop_requested)
        if len(batch.groups) < n:  # asked to stop while waiting: the groups stay unread for a resumed run
            raise RunStopped(f"run {self.refs.run_id} stopped at step {step + 1} while waiting for rollout data, "
                             f"as asked; the groups it read stay for a resumed run", self.refs.run_id)
        drained = time.perf_counter() - t0
        ref = self.train_groups(step, batch.groups)
        write_step(self.files.layout, step + 1, ref.version, batch.groups, feed.take_rejections())
        feed.commit()
        metrics = ref.metrics
        metrics.update(rollout_metrics(batch.groups))
        metrics.update(batch.metrics)
        metrics.update(self.producers().metrics())
        metrics["async/consumer_drain_seconds"] = drained
        metrics["trainer_wait_seconds"] = batch.wait_seconds
        errors = reward_errors(batch.groups)
        metrics["reward_failed"] = float(len(errors))
        ref.reward_errors = errors[:MAX_ERRORS_KEPT]
        return ref

    def feed_state(self) -> dict[str, Any]:
        """What a fully-async checkpoint keeps of the feed (after the step's ``commit``): every
        stream's cursor, the groups used after it, the groups settled before this feed, and the
        rejections not yet in the ledger."""
        feed = self.feed()
        return {"streams": feed.state(), "done": sorted(feed.done), "rejections": list(feed.rejections)}

    def restore_feed(self, state: dict[str, Any], producers: list[str] | None = None) -> None:
        """Fully async: put this trainer's cursor on every producer's stream back to ``state`` (a
        checkpoint's ``feed_state``; a stream begun after it goes back to its start), and remember
        which groups after the cursors were settled then (and those an earlier resume had settled),
        and every group the trainer ever recycled (its prompt is back in the pool already), so the
        feed trains each remaining group once. ``{"streams": {}}``: a run that never finished a
        step, from the start. ``producers``: whose streams (None: every producer with a heartbeat,
        a fleet's)."""
        from miles_core.rollout.fleet import RECYCLED, ControlPlane, PromptLog, stream_name

        opts, retry = self.cfg.storage.storage_options, self.files.layout.retry
        streams = state["streams"]
        if producers is None:
            producers = list(ControlPlane(self.fleet_dir, opts, retry=retry).heartbeats())
        for producer in producers:
            name = stream_name(producer)
            cursor = int(streams.get(name, {}).get("cursor", -1))
            reader = self.files.stream.sibling(name).reader(self.reader)
            if reader.cursor != cursor:
                reader.commit(cursor)
        done = {int(g) for entry in streams.values() for g in entry["used"]} | {int(g) for g in state.get("done", [])}
        for c in PromptLog(self.fleet_dir, opts, retry=retry).entries():
            if c.kind == "release" and c.reason == RECYCLED:  # its prompt is back in the pool: never trainable
                done.update(c.groups)
        self.done_before = done
        self.rejections_before = list(state.get("rejections", []))

    def close_feed(self) -> None:
        """Stop reading (a multi-LoRA adapter that finished: it no longer holds the producer back)."""
        if self._feed is not None:
            self._feed.close()

    def close(self) -> None:
        self.close_feed()
        close_trainer = getattr(self.__dict__.get("trainer"), "close", None)
        if close_trainer is not None:  # a multi-process trainer stops its worker processes
            close_trainer()
