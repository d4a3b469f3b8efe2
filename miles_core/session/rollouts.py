"""The generating side of a run: its policy engine, prompts and reward, built from (config, run folder).

``RolloutSide`` is a sync or async run's rollouts (``rollout(step)``: one segment per step), and the
parts of a producer (``producer(...)``: a ``RolloutProducer`` over this side's engine, reward and
sampling), whether a fleet member in a process of its own or a multi-LoRA run's shared producer.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from miles_core.config import RunConfig
from miles_core.memory import release_freed_memory
from miles_core.rollout.generate import PromptItem, generate_groups, rollout_metrics, sampling_params
from miles_core.session.parts import (
    SOURCE_STATE,
    EngineLoop,
    LentWeights,
    RunFiles,
    built_once,
    is_built,
    load_weights,
    prompt_rows,
    render,
    setup_policy_engine,
    setup_tokenizer,
)
from miles_core.session.refs import RolloutRef, RunRefs
from miles_core.rewards import MAX_ERRORS_KEPT, reward_errors
from miles_core.types import Group

if TYPE_CHECKING:
    from miles_core.rewards import RewardStats
    from miles_core.rollout.producer import RolloutProducer


class RolloutSide:
    """Built lazily: a process that only trains never loads an engine."""

    def __init__(self, cfg: RunConfig, refs: RunRefs, files: RunFiles, loop: EngineLoop,
                 lent: LentWeights | None = None) -> None:
        self.cfg, self.refs, self.files, self.loop = cfg, refs, files, loop
        self.lent = lent
        """Weights of this process the engine generates with (a trainer's, ``trainer_weights``); None:
        its own copy."""

    @built_once
    def tokenizer(self):
        return setup_tokenizer(self.refs)

    @built_once
    def engine(self):
        """The policy's engine; a rebuilt side loads the newest published weights (one on a sync run's
        trainer's weights has the trainer's)."""
        engine = setup_policy_engine(self.cfg, self.refs, lent=self.lent)
        follows_trainer = self.lent is not None and self.lent.version is not None
        latest = self.files.weights.latest()
        if latest is not None and not follows_trainer:
            self.loop.run(engine.update_weights(self.files.weights.uri(latest), latest))
        return engine

    @built_once
    def source(self):
        """The training prompts; a rebuilt side goes on from the prompt cursor of the last rollout."""
        from miles_core.data.source import DataSource

        rows = prompt_rows(self.cfg.data, "train")
        source = DataSource(rows, seed=self.cfg.seed, shuffle=self.cfg.rollout.rollout_shuffle)
        saved = self.files.layout.read_json(SOURCE_STATE)
        if saved is not None:
            source.load_state(saved)
        return source

    @built_once
    def reward_fn(self):
        from miles_core.rewards import get_reward

        return get_reward(self.cfg.rollout.reward, self.cfg.rollout.rm_url)

    @built_once
    def reward_post_process(self):
        from miles_core.rewards import load_post_process

        return load_post_process(self.cfg.rollout.reward_post_process_path)

    @built_once
    def sampling(self):
        r = self.cfg.rollout
        return sampling_params(
            r.rollout_max_response_len, r.rollout_temperature, r.rollout_top_p, r.rollout_top_k,
            r.rollout_stop, r.rollout_stop_token_ids,
        )

    @built_once
    def custom_generate(self):
        from miles_core.rollout.generate import load_custom_generate

        return load_custom_generate(self.cfg.rollout.custom_generate_function_path)

    def run(self, coro):
        """Run ``coro`` on the engines' loop."""
        return self.loop.run(coro)

    # -- prompts and reward

    def next_prompts(self, n: int) -> list[PromptItem]:
        """The next ``n`` training prompts, rendered and tokenized."""
        return render(self.source.next_batch(n), self.cfg.data, self.tokenizer)

    def render_rows(self, indices: list[int]) -> list[PromptItem]:
        """The training prompts with these row indices, rendered and tokenized (a fleet's claims)."""
        return render(self.source.rows(indices), self.cfg.data, self.tokenizer)

    async def score(self, groups: list[Group]) -> RewardStats:
        """Score groups in place with the run's reward, then its reward post-processing."""
        from miles_core.rewards import post_process_rewards, score_groups

        stats = await score_groups(self.reward_fn, groups, timeout_s=self.cfg.rollout.reward_timeout_s)
        await post_process_rewards(self.reward_post_process, groups)
        return stats

    # -- sync and async runs

    def rollout(self, step: int) -> RolloutRef:
        """Sample a batch of prompts, generate n responses each, score them, append one segment.
        A custom rollout function (``rollout.rollout_function_path``) does the generating and scoring."""
        r = self.cfg.rollout
        t0 = time.perf_counter()
        if r.rollout_function_path is not None:
            groups = self._custom_rollout(step)
            errors = reward_errors(groups)
            failed, reward_times = len(errors), {}
        else:
            items = self.next_prompts(r.rollout_batch_size)
            seed = self.cfg.seed * 1_000_003 + step * 10_007
            groups = self.run(generate_groups(
                self.engine, items, r.n_samples_per_prompt, self.sampling, step * r.rollout_batch_size, seed,
                custom=self.custom_generate, tokenizer=self.tokenizer,
            ))
            stats = self.run(self.score(groups))
            failed, errors, reward_times = stats.failed, stats.errors, stats.seconds_metrics()
        t_gen = time.perf_counter() - t0
        release_freed_memory()  # the generation's caches, before the training step allocates
        offset = self.files.stream.append([s for g in groups for s in g.samples])
        source_state = self.source.state()
        self.files.layout.write_json(SOURCE_STATE, source_state)
        metrics = rollout_metrics(groups)
        metrics.update(
            rollout_seconds=time.perf_counter() - t0,
            rollout_tokens_per_s=metrics["response_tokens"] / max(t_gen, 1e-9),
            reward_failed=float(failed),
            **reward_times,
        )
        return RolloutRef(step=step, offset=offset, num_samples=sum(len(g.samples) for g in groups),
                          metrics=metrics, source_state=source_state, reward_errors=errors[:MAX_ERRORS_KEPT])

    def _custom_rollout(self, step: int) -> list[Group]:
        from miles_core.rollout.custom import RolloutContext, run_rollout_function

        ctx = RolloutContext(self.cfg, self.engine, self.tokenizer, self.next_prompts, self.sampling, self.score)
        return self.run(run_rollout_function(self.cfg.rollout.rollout_function_path, ctx, step))

    def push_weights(self, uri: str, version: int) -> float:
        """Load weights ``version`` from ``uri`` into the engine (if it is not there); the seconds it took."""
        return load_weights(self.loop, self.engine, uri, version)

    # -- fully async

    def producer(self, prompts, stream, weights, **options: Any) -> RolloutProducer:
        """A ``RolloutProducer`` over this side's engine, reward, sampling and tokenizer, taking prompts
        from ``prompts``, writing ``stream``, loading new versions from ``weights`` (None: never);
        ``options`` are ``RolloutProducer``'s keyword arguments (routes, capacity, link, ...)."""
        from miles_core.rollout.producer import RolloutProducer
        from miles_core.rollout.sampler import Generation

        gen = Generation(self.engine, replace(self.sampling, seed=self.cfg.seed * 1_000_003), self.score,
                         self.custom_generate, self.tokenizer)
        return RolloutProducer(self.cfg, gen, prompts, stream, self.files.layout, weights, **options)

    def close(self) -> None:
        if is_built(self, "engine"):
            self.run(self.engine.close())
