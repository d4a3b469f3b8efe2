"""One training run's work, step by step, without Prefect.

- ``prepare_run(cfg) -> RunRefs``: builds or finds the starting model, creates the run folder and
  writes the config (without secrets).
- ``RunSession``: the process-local state of a run (tokenizer, engine on its own event-loop thread,
  trainer, prompt source, sample stream, weight store). Sessions are kept per run folder by
  ``get_session``; everything they hold can be rebuilt from the run folder and the config.
- ``RunSession.rollout / train / push_weights / evaluate``: one step of each phase; each returns a
  small, JSON-able reference (offsets, versions, URIs, metrics), never tensors or sample lists.
- ``RunSession.save_checkpoint / resume``: the trainer state and the prompt cursor after step k
  go to ``checkpoints/step-<k>/`` (when ``checkpoint_due``); ``resume`` puts a run back to its
  newest complete checkpoint, so the steps after it are redone exactly as they first ran.

Prefect tasks in ``tasks/`` call these methods; ``flows/train.py`` orders them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
import functools
from typing import TYPE_CHECKING, Any

from miles_core.config import EvalDatasetConfig, FileDataConfig, RunConfig, ToyDataConfig
from miles_core.rollout.generate import PromptItem, generate_groups, rollout_metrics, sampling_params
from miles_core.types import Group, SampleStatus

if TYPE_CHECKING:
    from miles_core.rewards import RewardStats


_SOURCE_STATE = "state/data_source.json"


@dataclass
class RunRefs:
    """Where a run lives: what every task needs besides the config."""

    run_id: str
    run_dir: str
    model_dir: str


@dataclass
class RolloutRef:
    step: int
    offset: int
    num_samples: int
    metrics: dict[str, float] = field(default_factory=dict)
    source_state: dict[str, Any] = field(default_factory=dict)
    """The prompt cursor right after this rollout drew its prompts (what a checkpoint keeps)."""


@dataclass
class TrainRef:
    step: int
    version: int
    weights_uri: str
    metrics: dict[str, float] = field(default_factory=dict)


def checkpoint_due(cfg: RunConfig, step: int) -> bool:
    """Whether the run saves a checkpoint after ``step`` (1-based) training steps."""
    interval = cfg.checkpoint.save_interval
    return interval is not None and (step % interval == 0 or step == cfg.rollout.num_rollout)


def prepare_run(cfg: RunConfig, log=print) -> RunRefs:
    from miles_core.models.tiny import ensure_model
    from miles_core.storage.layout import RunLayout, new_run_id

    model_dir = ensure_model(cfg.model, log=log)
    run_id = cfg.run_id or new_run_id()
    layout = RunLayout(cfg.storage.root, cfg.name, run_id, cfg.storage.storage_options)
    layout.write_json("config.json", cfg.public_dict())
    return RunRefs(run_id=run_id, run_dir=layout.run_dir, model_dir=str(model_dir))


# ----------------------------------------------------------------------------------- prompts


def _prompt_rows(data_cfg: FileDataConfig | ToyDataConfig, split: str, limit: int | None = None):
    from miles_core.data.datasets import load_prompt_rows, rows_from_dicts

    if isinstance(data_cfg, ToyDataConfig):
        from miles_core.data.toy import toy_problems

        dicts = toy_problems(data_cfg, split, limit)
        return rows_from_dicts(dicts, "prompt", "label", f"toy:{split}")
    rows = load_prompt_rows(data_cfg)
    return rows[:limit] if limit is not None else rows


def _eval_prompts(dataset: EvalDatasetConfig, tokenizer) -> list[PromptItem]:
    """The first ``num_prompts`` of a held-out dataset, rendered; errors name the dataset and file."""
    try:
        rows = _prompt_rows(dataset.data, "test", dataset.num_prompts)
        return _render(rows, dataset.data, tokenizer)
    except (ValueError, FileNotFoundError) as e:
        kind = FileNotFoundError if isinstance(e, FileNotFoundError) else ValueError  # a missing file stays one
        where = getattr(dataset.data, "path", "toy task")
        raise kind(f"eval dataset {dataset.name!r} ({where}): {e}") from e


def _render(rows, data_cfg, tokenizer) -> list[PromptItem]:
    from miles_core.data.datasets import render_prompt

    items = []
    for row in rows:
        text = row.prompt if isinstance(data_cfg, ToyDataConfig) else render_prompt(row, data_cfg, tokenizer)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        items.append(PromptItem(text, ids, row.label, row.index, dict(row.metadata)))
    return items


# ----------------------------------------------------------------------------------- session

_BUILD_LOCK = threading.RLock()


def _built_once(method):
    """Like ``functools.cached_property``, but threads that race to build the part wait for one
    build (a fully-async run builds its engine and its trainer from two threads at once, and
    transformers' ``from_pretrained`` is not safe to run concurrently: it inits on the meta device)."""
    name = method.__name__

    @functools.wraps(method)
    def get(self):
        if name not in self.__dict__:
            with _BUILD_LOCK:
                if name not in self.__dict__:
                    self.__dict__[name] = method(self)
        return self.__dict__[name]

    return property(get)



class RunSession:
    """Process-local state of one run. Built lazily: a process that only trains never loads an engine."""

    def __init__(self, cfg: RunConfig, refs: RunRefs) -> None:
        from miles_core.storage.layout import RunLayout
        from miles_core.storage.stream import SampleStream
        from miles_core.storage.weights import WeightStore

        self.cfg, self.refs = cfg, refs
        opts = cfg.storage.storage_options
        self.layout = RunLayout(cfg.storage.root, cfg.name, refs.run_id, opts)
        self.stream = SampleStream(
            refs.run_dir, producer="rollout", storage_options=opts, compression=cfg.storage.segment_compression
        )
        self.weights = WeightStore(self.layout.weights, storage_options=opts)
        self._loop = None
        self._metrics: list[dict[str, Any]] = []
        self._evals: list[dict[str, Any]] = []
        # fully async: how this session reads the stream (a multi-LoRA adapter session reads the
        # run's shared stream under its own name, through its view, and checks the run's producer)
        self.feed_reader = "trainer"
        self.feed_view = None
        self.producer_check = self._check_producer
        self.fleet = None
        """Fully async: the run's rollout fleet (``start_fleet``), which the trainer reads from."""
        self.owns_engine = True
        """False for a session that borrows another session's engine (``close`` leaves it running)."""
        self._eval_lock = threading.Lock()
        self._evals_lock = threading.Lock()

    # -- lazily built parts

    @_built_once
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.refs.model_dir)

    @_built_once
    def engine(self):
        from miles_core.engines import setup_engine
        from miles_core.loop import LoopThread

        self._loop = LoopThread("miles-engine")
        engine = setup_engine(
            self.cfg.engine, self.refs.model_dir, self.cfg.model.dtype, self.cfg.seed, self.cfg.storage.storage_options
        )
        if self.cfg.lora is not None:  # the policy is an adapter of the engine: pushes load it by name
            from miles_core.engines.policy import AdapterPolicy

            engine = AdapterPolicy(engine, self.cfg.lora.adapter_name)
        latest = self.weights.latest()
        if latest is not None:  # a rebuilt session resumes from the newest published weights
            self._loop.run(engine.update_weights(self.weights.uri(latest), latest))
        return engine

    @_built_once
    def trainer(self):
        from miles_core.train import setup_trainer

        return setup_trainer(
            self.cfg.train, self.refs.model_dir, self.weights, self.cfg.model.dtype, lora=self.cfg.lora,
            storage_options=self.cfg.storage.storage_options,
        )

    @_built_once
    def source(self):
        from miles_core.data.source import DataSource

        rows = _prompt_rows(self.cfg.data, "train")
        source = DataSource(rows, seed=self.cfg.seed, shuffle=self.cfg.rollout.rollout_shuffle)
        saved = self.layout.read_json(_SOURCE_STATE)
        if saved is not None:  # a rebuilt session goes on from the prompt cursor of the last rollout
            source.load_state(saved)
        return source

    @property
    def eval_datasets(self) -> list[EvalDatasetConfig]:
        """The held-out datasets, in order, every setting filled in (``EvalConfig.resolved``)."""
        return self.cfg.eval.resolved(self.cfg.data, self.cfg.rollout)

    @_built_once
    def eval_items(self) -> dict[str, list[PromptItem]]:
        """Each held-out dataset's prompts, rendered and tokenized, by dataset name."""
        return {d.name: _eval_prompts(d, self.tokenizer) for d in self.eval_datasets}

    @_built_once
    def reward_fn(self):
        from miles_core.rewards import get_reward

        return get_reward(self.cfg.rollout.reward)

    @_built_once
    def eval_reward_fn(self) -> dict[str, Any]:
        """Each held-out dataset's reward function, by dataset name."""
        from miles_core.rewards import get_reward

        return {d.name: get_reward(d.reward) for d in self.eval_datasets}

    def check_data(self) -> dict[str, int]:
        """Load the training and held-out prompts now, so a bad dataset fails the run before any work.
        ``eval_prompts`` counts the prompts of every held-out dataset."""
        return {"train_prompts": len(self.source), "eval_prompts": sum(map(len, self.eval_items.values()))}

    def _run(self, coro):
        self.engine  # noqa: B018 (builds the loop with the engine)
        return self._loop.run(coro)

    # -- phases

    @_built_once
    def sampling(self):
        r = self.cfg.rollout
        return sampling_params(
            r.rollout_max_response_len, r.rollout_temperature, r.rollout_top_p, r.rollout_top_k,
            r.rollout_stop, r.rollout_stop_token_ids,
        )

    @_built_once
    def custom_generate(self):
        from miles_core.rollout.generate import load_custom_generate

        return load_custom_generate(self.cfg.rollout.custom_generate_function_path)

    def next_prompts(self, n: int) -> list[PromptItem]:
        """The next ``n`` training prompts, rendered and tokenized."""
        return _render(self.source.next_batch(n), self.cfg.data, self.tokenizer)

    def render_rows(self, indices: list[int]) -> list[PromptItem]:
        """The training prompts with these row indices, rendered and tokenized (a fleet's claims)."""
        return _render(self.source.rows(indices), self.cfg.data, self.tokenizer)

    @property
    def loop(self):
        """The asyncio loop the engine lives on (built with the engine)."""
        self.engine  # noqa: B018
        return self._loop.loop

    @_built_once
    def reward_post_process(self):
        from miles_core.rewards import load_post_process

        return load_post_process(self.cfg.rollout.reward_post_process_path)

    async def score(self, groups: list[Group]) -> RewardStats:
        """Score groups in place with the run's reward, then its reward post-processing."""
        from miles_core.rewards import post_process_rewards, score_groups

        stats = await score_groups(self.reward_fn, groups)
        await post_process_rewards(self.reward_post_process, groups)
        return stats

    def rollout(self, step: int) -> RolloutRef:
        """Sample a batch of prompts, generate n responses each, score them, append one segment.
        A custom rollout function (``rollout.rollout_function_path``) does the generating and scoring."""
        r = self.cfg.rollout
        t0 = time.perf_counter()
        if r.rollout_function_path is not None:
            groups = self._custom_rollout(step)
            failed = sum(s.status is SampleStatus.FAILED for g in groups for s in g.samples)
        else:
            items = self.next_prompts(r.rollout_batch_size)
            seed = self.cfg.seed * 1_000_003 + step * 10_007
            groups = self._run(generate_groups(
                self.engine, items, r.n_samples_per_prompt, self.sampling, step * r.rollout_batch_size, seed,
                custom=self.custom_generate, tokenizer=self.tokenizer,
            ))
            failed = self._run(self.score(groups)).failed
        t_gen = time.perf_counter() - t0
        offset = self.stream.append([s for g in groups for s in g.samples])
        source_state = self.source.state()
        self.layout.write_json(_SOURCE_STATE, source_state)
        metrics = rollout_metrics(groups)
        metrics.update(
            rollout_seconds=time.perf_counter() - t0,
            rollout_tokens_per_s=metrics["response_tokens"] / max(t_gen, 1e-9),
            reward_failed=float(failed),
        )
        return RolloutRef(step=step, offset=offset, num_samples=sum(len(g.samples) for g in groups),
                          metrics=metrics, source_state=source_state)

    def _custom_rollout(self, step: int) -> list[Group]:
        from miles_core.rollout.custom import RolloutContext, run_rollout_function

        ctx = RolloutContext(self.cfg, self.engine, self.tokenizer, self.next_prompts, self.sampling, self.score)
        return self._run(run_rollout_function(self.cfg.rollout.rollout_function_path, ctx, step))

    def train(self, rollout: RolloutRef) -> TrainRef:
        """Read the rollout's segment, compute GRPO advantages, step the trainer, publish weights."""
        from miles_core.types import regroup

        t0 = time.perf_counter()
        groups = regroup(self.stream.read_segment(rollout.offset).samples())
        ref = self.train_groups(rollout.step, groups)
        self.stream.reader("trainer").commit(rollout.offset)
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
        else:  # nothing trainable in this batch (e.g. every sample failed): the engine keeps its weights
            uri = self.weights_uri(version)
        seconds = time.perf_counter() - t0
        metrics.update(
            train_seconds=seconds,
            train_tokens_per_s=metrics.get("train_tokens", 0.0) / max(seconds, 1e-9),
            staleness_mean=sum(lags) / max(len(lags), 1),
            staleness_max=float(max(lags, default=0)),
        )
        return TrainRef(step=step, version=version, weights_uri=uri, metrics=metrics)

    def weights_uri(self, version: int) -> str:
        """Where the policy of ``version`` is: its snapshot, or the starting model for version 0."""
        return self.weights.uri(version) if version > 0 else self.refs.model_dir

    def push_weights(self, uri: str, version: int) -> float:
        t0 = time.perf_counter()
        if version != self.engine.weight_version:
            self._run(self.engine.update_weights(uri, version))
        return time.perf_counter() - t0

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluate the rollout engine's current weights on the held-out prompts (in one call). A
        fully-async run's engine here is the trainer's own: it loads the latest version first, and
        the fleet's producers pause meanwhile (through the run folder), as if it were theirs."""
        if self.fleet is None:
            return self._evaluate_on(self.engine, step)
        holder = f"eval-step-{step}"
        self.fleet.pause(holder)
        try:
            version = self.weights.latest() or 0
            self.push_weights(self.weights_uri(version), version)
            return self._evaluate_on(self.engine, step)
        finally:
            self.fleet.resume(holder)

    @_built_once
    def eval_engine(self):
        """The separate evaluation engine (``eval.engine = "separate"``), on the session's loop; with
        LoRA, the run's adapter of it."""
        from miles_core.engines import setup_engine

        self.engine  # noqa: B018 (the loop comes with the rollout engine)
        engine = setup_engine(self.cfg.eval.engine_config or self.cfg.engine, self.refs.model_dir, self.cfg.model.dtype,
                              self.cfg.seed, self.cfg.storage.storage_options)
        if self.cfg.lora is not None:
            from miles_core.engines.policy import AdapterPolicy

            engine = AdapterPolicy(engine, self.cfg.lora.adapter_name)
        return engine

    def evaluate_version(self, step: int, version: int, record: bool = True) -> dict[str, float]:
        """Evaluate weights ``version`` on the separate evaluation engine, which loads it from the
        weight store; the version is pinned there meanwhile (retention keeps it). Evaluations take
        turns on the engine; training and rollouts go on. ``record``: add the result to the run's
        in-run history (``eval.jsonl``)."""
        reader = f"eval-step-{step}"
        if version > 0:
            self.weights.pin(version, reader)
        try:
            with self._eval_lock:
                engine = self.eval_engine
                if engine.weight_version != version:
                    self._run(engine.update_weights(self.weights_uri(version), version))
                return self._evaluate_on(engine, step, record)
        finally:
            if version > 0:
                self.weights.unpin(version, reader)

    def _evaluate_on(self, engine, step: int, record: bool = True) -> dict[str, float]:
        """Evaluate ``engine``'s weights on every held-out dataset; one row (``eval_row``: the first
        dataset's metrics under the plain keys, with ``eval.datasets`` every dataset's as
        ``<name>/<metric>``), plus ``step`` and ``eval_seconds``."""
        from miles_core.eval.metrics import eval_row

        t0 = time.perf_counter()
        per_dataset = {d.name: self._evaluate_dataset(engine, d) for d in self.eval_datasets}
        metrics = eval_row(per_dataset, named=bool(self.cfg.eval.datasets))
        metrics.update(step=float(step), eval_seconds=time.perf_counter() - t0)
        if not record:
            return metrics
        with self._evals_lock:  # evaluations may finish in any order: the history stays sorted by step
            self._evals.append(metrics)
            self._evals.sort(key=lambda e: e["step"])
            self.layout.write_jsonl("eval.jsonl", self._evals)
        return metrics

    def _evaluate_dataset(self, engine, dataset: EvalDatasetConfig) -> dict[str, float]:
        """Generate for and score one held-out dataset; its ``eval_metrics``."""
        from miles_core.eval.metrics import eval_metrics
        from miles_core.rewards import score_groups

        r = self.cfg.rollout
        params = sampling_params(dataset.max_response_len, dataset.temperature, stop=r.rollout_stop,
                                 stop_token_ids=r.rollout_stop_token_ids)
        items = self.eval_items[dataset.name]
        groups = self._run(generate_groups(engine, items, dataset.n_samples_per_prompt, params, 0, seed=self.cfg.seed))
        self._run(score_groups(self.eval_reward_fn[dataset.name], groups))
        return eval_metrics(groups, engine.weight_version)

    def record(self, step: int, row: dict[str, Any]) -> None:
        """Append one step's metrics to ``metrics.jsonl`` in the run folder."""
        self._metrics.append({"step": step, **row})
        self.layout.write_jsonl("metrics.jsonl", self._metrics)

    @property
    def metrics_rows(self) -> list[dict[str, Any]]:
        return list(self._metrics)

    @property
    def eval_rows(self) -> list[dict[str, Any]]:
        return list(self._evals)

    # -- checkpoints

    def save_checkpoint(self, step: int, source_state: dict[str, Any]) -> str:
        """Save the run after ``step`` steps: the trainer state, then ``state.json`` (step, weight
        version, ``source_state``: the prompt cursor of that step's rollout), which makes the
        checkpoint complete. Then prunes to ``checkpoint.keep_checkpoints``; returns the folder."""
        from miles_core.storage.layout import CHECKPOINT_STATE, TRAINER_STATE, checkpoint_dir

        self.trainer.save(self.layout.checkpoint(step, TRAINER_STATE))
        state = {"step": step, "version": self.trainer.version, "data_source": source_state}
        self.layout.write_json(f"{checkpoint_dir(step)}/{CHECKPOINT_STATE}", state)
        self.layout.prune_checkpoints(self.cfg.checkpoint.keep_checkpoints)
        return self.layout.checkpoint(step)

    def resume(self) -> int | None:
        """Put the run back to its newest complete checkpoint; returns its step (the next step to
        run is that + 1), or None for a fresh run. Call it before the first rollout.

        After the checkpoint at step k (weights version v):
        - the trainer loads its state; the prompt cursor is the checkpoint's (``state/data_source.json``
          may be newer), and is written back there so a rebuilt session agrees;
        - the weight store rolls back to v (``WeightStore.rollback``: LATEST back to v, newer
          versions deleted, since the redone steps publish them again), and the engine loads v;
        - ``metrics.jsonl`` and ``eval.jsonl`` keep their rows of steps <= k;
        - sample segments written by the redone steps stay in the stream as history (the redone
          steps append new ones after them; the trainer reads each step's segment by offset), and
          a stream closed by a finished run is reopened (its ``_END`` removed).

        RuntimeError when the run has steps in ``metrics.jsonl`` but no checkpoint (it cannot go on
        without redoing them over old data); ValueError when the checkpoint is past ``num_rollout``."""
        from miles_core.storage.layout import CHECKPOINT_STATE, TRAINER_STATE, checkpoint_dir

        step = self.layout.latest_checkpoint()
        if step is None:
            if self.layout.read_jsonl("metrics.jsonl"):
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
        state = self.layout.read_json(f"{checkpoint_dir(step)}/{CHECKPOINT_STATE}")
        version = state["version"]
        self.weights.rollback(version)
        self.trainer.load(self.layout.checkpoint(step, TRAINER_STATE))
        if self.trainer.version != version:
            raise ValueError(f"checkpoint {self.layout.checkpoint(step)}: trainer state is at weights version "
                             f"{self.trainer.version}, state.json says {version}")
        self.layout.write_json(_SOURCE_STATE, state["data_source"])
        if "source" in self.__dict__:
            self.source.load_state(state["data_source"])
        self._metrics = [r for r in self.layout.read_jsonl("metrics.jsonl") if r["step"] <= step]
        self._evals = [r for r in self.layout.read_jsonl("eval.jsonl") if r["step"] <= step]
        self.layout.write_jsonl("metrics.jsonl", self._metrics)
        self.layout.write_jsonl("eval.jsonl", self._evals)
        self._reopen_stream()
        if "engine" in self.__dict__:  # else the engine loads the latest version, now v, when built
            self.push_weights(self.weights_uri(version), version)
        return step

    def _reopen_stream(self) -> None:
        """Remove the ``_END`` a finished run wrote, so the resumed run appends after its segments.
        (The stream reads ``_END`` on its first append, which comes after this.)"""
        from miles_core.storage.fs import join
        from miles_core.storage.stream import END_MARKER

        end = join(self.stream.path, END_MARKER)
        if self.stream.fs.exists(end):
            self.stream.fs.rm_file(end)

    # -- fully async: a producer for the whole run, a trainer that consumes

    @_built_once
    def producer(self):
        from dataclasses import replace

        from miles_core.rollout.producer import RolloutProducer

        return RolloutProducer(
            self.cfg, self.engine, _PromptSupply(self), self.score, self.stream, self.layout, self.weights,
            replace(self.sampling, seed=self.cfg.seed * 1_000_003), custom_generate=self.custom_generate,
            tokenizer=self.tokenizer,
        )

    def run_producer(self) -> dict[str, Any]:
        """Run the producer until ``stop_producer``; its exception is kept for the trainer to raise."""
        from dataclasses import asdict

        try:
            return asdict(self._run(self.producer.run()))
        except BaseException as e:
            self._producer_error = e
            raise

    def stop_producer(self) -> None:
        if "producer" in self.__dict__:
            self.producer.request_stop()

    def pause_producer(self, holder: str = "eval") -> None:
        """Hold the producers until none has a request in its engine (evaluation borrows it): the
        fleet's through the run folder, an in-process producer directly."""
        if self.fleet is not None:
            self.fleet.pause(holder)
        elif "producer" in self.__dict__:
            self._run(self.producer.pause())

    def resume_producer(self, holder: str = "eval") -> None:
        if self.fleet is not None:
            self.fleet.resume(holder)
        elif "producer" in self.__dict__:
            self._run(self.producer.resume())

    def start_fleet(self, launcher, warn=print):
        """Launch the run's rollout producers (``async_rollout.rollout_producers``) with ``launcher``;
        the trainer's feed reads their streams from then on."""
        from miles_core.rollout.supervisor import Fleet

        self.fleet = Fleet(self.cfg, self.refs, launcher, self.stream, warn=warn)
        self.fleet.start()
        return self.fleet

    def stop_fleet(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()

    def _check_producer(self) -> None:
        error = self.__dict__.get("_producer_error")
        if error is not None:
            raise error

    def feed(self, warn=None):
        """The trainer's side of the stream (built once; ``warn`` receives no-progress warnings)."""
        if "_feed" not in self.__dict__:
            from miles_core.rollout.buffer import make_buffer
            from miles_core.rollout.consumer import GroupFeed

            a = self.cfg.async_rollout
            capacity = max(1, round(a.buffer_capacity_factor * self.cfg.rollout.rollout_batch_size))
            buffer = make_buffer(a, capacity, first_version=self.trainer.version, path=a.custom_data_buffer_path)
            kwargs: dict[str, Any] = {"warn": warn} if warn is not None else {}
            if self.feed_view is not None:
                kwargs["view"] = self.feed_view
            if self.fleet is not None:
                kwargs.update(streams=self.fleet.streams, recycle=self.fleet.recycle, producer_check=self.fleet.check)
            else:
                kwargs["producer_check"] = self.producer_check
            self._feed = GroupFeed(self.stream, buffer, a, reader=self.feed_reader, read_ahead=a.read_ahead, **kwargs)
            self._producer_seen = (time.monotonic(), 0, 0.0)
        return self._feed

    def train_from_stream(self, step: int, warn=None) -> TrainRef:
        """Wait for ``rollout_batch_size`` trainable groups from the producer, train on them,
        publish the new version (the producer loads it), and report the step's async metrics."""
        t0 = time.perf_counter()
        feed = self.feed(warn)
        batch = feed.next_batch(self.cfg.rollout.rollout_batch_size, self.trainer.version)
        drained = time.perf_counter() - t0
        ref = self.train_groups(step, batch.groups)
        feed.commit()
        metrics = ref.metrics
        metrics.update(rollout_metrics(batch.groups))
        metrics.update(batch.metrics)
        metrics.update(self._producer_metrics())
        metrics["async/consumer_drain_seconds"] = drained
        metrics["trainer_wait_seconds"] = batch.wait_seconds
        return ref

    def _producer_metrics(self) -> dict[str, float]:
        """Producer throughput and idle share since the last step (from its live counters, or the
        fleet's heartbeats)."""
        if self.fleet is not None:
            return self.fleet.metrics()
        if "producer" not in self.__dict__:
            return {}
        stats, scheduler = self.producer.stats, self.producer.scheduler
        now = time.monotonic()
        idle = scheduler.idle_seconds() if scheduler is not None else 0.0
        t_prev, samples_prev, idle_prev = self._producer_seen
        self._producer_seen = (now, stats.samples_finished, idle)
        span = max(now - t_prev, 1e-9)
        return {
            "async/producer_throughput_qps": (stats.samples_finished - samples_prev) / span,
            "async/producer_idle_fraction": min(1.0, (idle - idle_prev) / span),
            "async/in_flight_samples": float(scheduler.in_flight if scheduler is not None else 0),
            "async/weight_updates": float(stats.weight_updates),
            "async/groups_filtered": float(sum(stats.groups_filtered.values())),
            "async/samples_failed": float(stats.samples_failed),
            "async/generation_errors": float(stats.generation_errors),
        }

    def finish(self, summary: dict[str, Any]) -> None:
        """End the run's sample stream (readers see ``_END``) and write ``summary.json``."""
        self.stream.close()
        self.layout.write_json("summary.json", summary)

    def close(self) -> None:
        if self.fleet is not None:  # a run that ends by an error: its producers must not outlive it
            self.fleet.cancel()
        if "_feed" in self.__dict__:
            self._feed.close()
        if "eval_engine" in self.__dict__:
            self._run(self.eval_engine.close())
        if "engine" in self.__dict__ and self.owns_engine:
            self._loop.run(self.engine.close())
            self._loop.close()
        close_trainer = getattr(self.__dict__.get("trainer"), "close", None)
        if close_trainer is not None:  # a multi-process trainer stops its worker processes
            close_trainer()


class _PromptSupply:
    """The producer's view of the run's prompts (``DataSource`` plus rendering)."""

    def __init__(self, session: RunSession) -> None:
        self.session = session

    def next(self) -> PromptItem:
        return self.session.next_prompts(1)[0]

    def push_back(self, prompt_indices: list[int]) -> None:
        from types import SimpleNamespace

        self.session.source.push_back([SimpleNamespace(index=i) for i in prompt_indices])

    def state(self) -> dict[str, Any]:
        return self.session.source.state()

    def load_state(self, state: dict[str, Any]) -> None:
        self.session.source.load_state(state)


class RunRegistry:
    """The process's live objects of one kind (sessions, multi-LoRA runs), one per run folder:
    ``get`` builds it on first use (``factory(cfg, refs)``), ``close`` drops and closes it."""

    def __init__(self, factory) -> None:
        self.factory = factory
        self.live: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, cfg: RunConfig, refs: RunRefs):
        with self._lock:
            if refs.run_dir not in self.live:
                self.live[refs.run_dir] = self.factory(cfg, refs)
            return self.live[refs.run_dir]

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


def close_session(refs: RunRefs) -> None:
    _SESSIONS.close(refs)

