"""Held-out evaluation of a run: on any engine given (``evaluate_on``), or on the run's separate
evaluation engine, which loads the version asked for from the weight store (``evaluate_version``).

Each evaluation generates for and scores every held-out dataset (``EvalConfig.resolved``); its row
(``eval_row``) has the first dataset's metrics under the plain keys and, with ``eval.datasets``,
every dataset's as ``<name>/<metric>``, plus ``step`` and ``eval_seconds``; recorded rows go to the
run's history (``eval.jsonl``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from miles_core.config import EvalDatasetConfig, RunConfig
from miles_core.rollout.generate import PromptItem, generate_groups, sampling_params
from miles_core.session.history import RunHistory
from miles_core.memory import release_freed_memory
from miles_core.session.parts import (
    EngineLoop,
    LentWeights,
    built_once,
    eval_prompts,
    is_built,
    setup_policy_engine,
    weights_uri,
)
from miles_core.session.refs import RunRefs

if TYPE_CHECKING:
    from miles_core.storage.weights import WeightStore


class Evaluator:
    def __init__(self, cfg: RunConfig, refs: RunRefs, loop: EngineLoop, weights: WeightStore, history: RunHistory,
                 tokenizer: Callable[[], Any], lent: LentWeights | None = None) -> None:
        """``tokenizer``: gives the tokenizer (shared with the run's rollout side, built when first asked);
        ``lent``: frozen weights of this process the separate engine generates with (a LoRA base)."""
        self.cfg, self.refs, self.loop, self.weights, self.history = cfg, refs, loop, weights, history
        self._tokenizer = tokenizer
        self._lent = lent
        self._engine_lock = threading.Lock()

    @property
    def datasets(self) -> list[EvalDatasetConfig]:
        """The held-out datasets, in order, every setting filled in."""
        return self.cfg.eval.resolved(self.cfg.data, self.cfg.rollout)

    @built_once
    def items(self) -> dict[str, list[PromptItem]]:
        """Each held-out dataset's prompts, rendered and tokenized, by dataset name."""
        tokenizer = self._tokenizer()
        return {d.name: eval_prompts(d, tokenizer) for d in self.datasets}

    @built_once
    def reward_fns(self) -> dict[str, Any]:
        """Each held-out dataset's reward function, by dataset name."""
        from miles_core.rewards import get_reward

        return {d.name: get_reward(d.reward, self.cfg.rollout.rm_url) for d in self.datasets}

    @built_once
    def engine(self):
        """The separate evaluation engine (``eval.engine = "separate"``, ``eval.engine_config``); with
        LoRA, the run's adapter of it (on the trainer's frozen base where it shares it)."""
        return setup_policy_engine(self.cfg, self.refs, self.cfg.eval.engine_config, lent=self._lent)

    def reserve(self, step: int, version: int) -> None:
        """Pin ``version`` for the evaluation after ``step`` when it is scheduled, so retention keeps it
        until that evaluation has loaded it (``evaluate_version`` unpins it when done)."""
        if version > 0:
            self.weights.pin(version, f"eval-step-{step}")

    def evaluate_version(self, step: int, version: int, record: bool = True) -> dict[str, float]:
        """Evaluate weights ``version`` on the separate engine, which loads it; the version is pinned
        meanwhile (retention keeps it). Evaluations take turns on the engine; training and rollouts
        go on. ``record``: add the result to the run's history."""
        reader = f"eval-step-{step}"
        if version > 0:
            self.weights.pin(version, reader)
        try:
            with self._engine_lock:
                if self.engine.weight_version != version:
                    self.loop.run(self.engine.update_weights(weights_uri(self.weights, self.refs, version), version))
                return self.evaluate_on(self.engine, step, record)
        finally:
            if version > 0:
                self.weights.unpin(version, reader)

    def evaluate_on(self, engine, step: int, record: bool = True) -> dict[str, float]:
        """Evaluate ``engine``'s weights on every held-out dataset; one row."""
        from miles_core.metrics import eval_row

        t0 = time.perf_counter()
        per_dataset = {d.name: self._evaluate_dataset(engine, d) for d in self.datasets}
        release_freed_memory()  # the generation's caches (an evaluation beside training: before a step's peak)
        metrics = eval_row(per_dataset, named=bool(self.cfg.eval.datasets))
        metrics.update(step=float(step), eval_seconds=time.perf_counter() - t0)
        if record:
            self.history.add_eval(metrics)
        return metrics

    def _evaluate_dataset(self, engine, dataset: EvalDatasetConfig) -> dict[str, float]:
        """Generate for and score one held-out dataset; its ``eval_metrics``."""
        from miles_core.metrics import eval_metrics
        from miles_core.rewards import score_groups

        r = self.cfg.rollout
        params = sampling_params(dataset.max_response_len, dataset.temperature, top_p=dataset.top_p, stop=r.rollout_stop,
                                 stop_token_ids=r.rollout_stop_token_ids)
        items = self.items[dataset.name]
        groups = self.loop.run(generate_groups(engine, items, dataset.n_samples_per_prompt, params, 0,
                                               seed=self.cfg.seed))
        self.loop.run(score_groups(self.reward_fns[dataset.name], groups, timeout_s=r.reward_timeout_s))
        return eval_metrics(groups, engine.weight_version)

    def close(self) -> None:
        if is_built(self, "engine"):
            self.loop.run(self.engine.close())
