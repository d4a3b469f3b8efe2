"""What the parts of a run share: its files, the engines' event loop, lazy building, prompts.

- ``RunFiles.open(cfg, refs)``: the run folder (``RunLayout``), its sample stream and its weight
  store, on the run's storage.
- ``EngineLoop``: the asyncio loop engines of one process run on (a ``LoopThread``, started on first
  use), so an engine's locks and events always live on one loop, whichever thread calls.
- ``built_once``: a lazily built part, built by one thread while racing threads wait.
- ``setup_policy_engine``: an engine for the run's policy (its LoRA adapter of it, with LoRA), on
  the trainer's own weights where it can (``LentWeights``, ``trainer_weights``); ``load_weights``: a
  version into an engine.
- ``prompt_rows`` / ``render`` / ``eval_prompts``: prompt rows of a dataset, rendered and tokenized.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_core.config import (
    EvalDatasetConfig,
    FileDataConfig,
    HFEngineConfig,
    RunConfig,
    ToyDataConfig,
    TorchTrainerConfig,
)
from miles_core.rollout.generate import PromptItem

if TYPE_CHECKING:
    from miles_core.loop import LoopThread
    from miles_core.session.refs import RunRefs
    from miles_core.storage.layout import RunLayout
    from miles_core.storage.stream import SampleStream
    from miles_core.storage.weights import WeightStore

SOURCE_STATE = "state/data_source.json"
"""The prompt cursor after the last sync or async rollout (a rebuilt rollout side goes on from it)."""

_BUILD_LOCK = threading.RLock()


def built_once(method):
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


def is_built(obj: Any, name: str) -> bool:
    """Whether ``obj``'s ``built_once`` part ``name`` has been built (closing leaves unbuilt ones alone)."""
    return name in obj.__dict__


@dataclass
class RunFiles:
    """A run's storage: the run folder, its sample stream (``samples/rollout``) and weight store."""

    layout: RunLayout
    stream: SampleStream
    weights: WeightStore

    @classmethod
    def open(cls, cfg: RunConfig, refs: RunRefs) -> RunFiles:
        from miles_core.storage.fs import outage_retry
        from miles_core.storage.layout import RunLayout
        from miles_core.storage.stream import SampleStream
        from miles_core.storage.weights import WeightStore

        opts, retry = cfg.storage.storage_options, outage_retry(cfg.storage.max_outage_s)
        layout = RunLayout(cfg.storage.root, cfg.name, refs.run_id, opts, retry=retry)
        stream = SampleStream(refs.run_dir, producer="rollout", storage_options=opts, retry=retry,
                              compression=cfg.storage.segment_compression)
        weights = WeightStore(layout.weights, storage_options=opts, retry=retry, dtype=cfg.storage.snapshot_dtype,
                              tied_once=cfg.engines_tie_weights())
        return cls(layout, stream, weights)


class EngineLoop:
    """The event loop this process's engines live on, started on first use."""

    def __init__(self, name: str = "miles-engine") -> None:
        self.name = name
        self._thread: LoopThread | None = None
        self._lock = threading.Lock()

    @property
    def thread(self) -> LoopThread:
        with self._lock:
            if self._thread is None:
                from miles_core.loop import LoopThread

                self._thread = LoopThread(self.name)
            return self._thread

    @property
    def loop(self):
        return self.thread.loop

    def run(self, coro, timeout: float | None = None):
        """Run ``coro`` on the loop and wait for its result (exceptions propagate)."""
        return self.thread.run(coro, timeout)

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.close()


@dataclass(frozen=True)
class LentWeights:
    """A module of this process whose weight tensors an in-process engine generates with, instead of a
    copy of them (``HFEngine.share_weights``): one model's memory less per engine."""

    module: Callable[[], Any]
    """Builds (once) and returns the module: a trainer's model, or a multi-LoRA run's adapter bank's base."""
    version: Callable[[], int] | None = None
    """Weights that change under the engine: the version they are now (a sync run's trainer, which
    steps only between rollouts); None: weights that never change (a LoRA base)."""


def can_lend_weights(engine_cfg, device: str) -> bool:
    """Whether an engine of ``engine_cfg`` may generate with the weights of a model on ``device`` in
    this process: an in-process engine that allows it (``share_trainer_weights``), on that device."""
    return isinstance(engine_cfg, HFEngineConfig) and engine_cfg.share_trainer_weights and engine_cfg.device == device


def trainer_weights(cfg: RunConfig, engine_cfg, trainer: Callable[[], Any], rollout: bool) -> LentWeights | None:
    """The trainer's weights for an engine of ``engine_cfg`` in its process, where they cannot change
    during one of the engine's generations: a LoRA run's frozen base (any engine of the run), or a
    sync run's weights for its rollout engine (``rollout``), which generates only between steps and
    follows the trainer's versions. None: the engine keeps a copy of its own. (A multi-LoRA run lends
    its adapter bank's base instead: ``MultiLoraRun``.)"""
    backend = cfg.train.backend  # the one-process torch trainer: DeepSpeed moves weights into buffers of its own
    if cfg.multi_lora is not None or not isinstance(backend, TorchTrainerConfig) \
            or not can_lend_weights(engine_cfg, backend.device):
        return None
    if cfg.lora is not None:
        return LentWeights(lambda: trainer().model)
    if rollout and cfg.mode.type == "sync":
        return LentWeights(lambda: trainer().model, lambda: trainer().version)
    return None


def setup_policy_engine(cfg: RunConfig, refs: RunRefs, engine_cfg=None, lent: LentWeights | None = None):
    """An engine serving the run's starting model (``engine_cfg``: default the run's ``engine``);
    with LoRA, the run's adapter of it, so pushes load the adapter by name. ``lent``: the engine
    generates with those weights instead of a copy of its own."""
    from miles_core.engines import setup_engine

    from miles_core.storage.fs import is_local, open_fs

    run_fs, run_path = open_fs(refs.run_dir, cfg.storage.storage_options)
    log_dir = f"{run_path}/engine-logs" if is_local(run_fs) else None  # a launched server's log
    engine = setup_engine(engine_cfg or cfg.engine, refs.model_dir, cfg.model.dtype, cfg.seed,
                          cfg.storage.storage_options, lora=cfg.lora is not None or cfg.multi_lora is not None,
                          log_dir=log_dir)
    if lent is not None:
        engine.share_weights(lent.module(), live_version=lent.version)
    if cfg.lora is not None:
        from miles_core.engines.policy import AdapterPolicy

        engine = AdapterPolicy(engine, cfg.lora.adapter_name)
    return engine


def weights_uri(weights: WeightStore, refs: RunRefs, version: int) -> str:
    """Where the policy of ``version`` is: its snapshot, or the starting model for version 0."""
    return weights.uri(version) if version > 0 else refs.model_dir


def load_weights(loop: EngineLoop, engine, uri: str, version: int) -> float:
    """Load weights ``version`` from ``uri`` into ``engine`` unless it has them; the seconds it took."""
    t0 = time.perf_counter()
    if version != engine.weight_version:
        loop.run(engine.update_weights(uri, version))
    return time.perf_counter() - t0


def setup_tokenizer(refs: RunRefs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(refs.model_dir)


def prompt_rows(data_cfg: FileDataConfig | ToyDataConfig, split: str, limit: int | None = None):
    from miles_core.data.datasets import load_prompt_rows, rows_from_dicts

    if isinstance(data_cfg, ToyDataConfig):
        from miles_core.data.toy import toy_problems

        dicts = toy_problems(data_cfg, split, limit)
        return rows_from_dicts(dicts, "prompt", "label", f"toy:{split}")
    rows = load_prompt_rows(data_cfg)
    return rows[:limit] if limit is not None else rows


def eval_prompts(dataset: EvalDatasetConfig, tokenizer) -> list[PromptItem]:
    """The first ``num_prompts`` of a held-out dataset, rendered; errors name the dataset and file."""
    try:
        rows = prompt_rows(dataset.data, "test", dataset.num_prompts)
        return render(rows, dataset.data, tokenizer)
    except (ValueError, FileNotFoundError) as e:
        kind = FileNotFoundError if isinstance(e, FileNotFoundError) else ValueError  # a missing file stays one
        where = getattr(dataset.data, "path", "toy task")
        raise kind(f"eval dataset {dataset.name!r} ({where}): {e}") from e


def render(rows, data_cfg, tokenizer) -> list[PromptItem]:
    from miles_core.data.datasets import render_prompt

    # The tokenizer adds its special tokens (a <bos> where its post-processor puts one, as the model
    # saw in pretraining), except to a chat template's text, which carries them already.
    special = isinstance(data_cfg, ToyDataConfig) or not data_cfg.apply_chat_template
    items = []
    for row in rows:
        text = row.prompt if isinstance(data_cfg, ToyDataConfig) else render_prompt(row, data_cfg, tokenizer)
        ids = tokenizer(text, add_special_tokens=special)["input_ids"]
        items.append(PromptItem(text, ids, row.label, row.index, dict(row.metadata)))
    return items
