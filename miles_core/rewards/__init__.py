"""Reward functions by name, and the driver that scores groups of samples.

- A reward function is per sample, ``fn(sample: Sample) -> float``, or per group (marked with
  ``@group_reward``), ``fn(samples: list[Sample]) -> list[float]``; either may be ``async``.
  Sync functions run in a worker thread so they never block the event loop.
- ``register_reward(*names)`` registers one under names; ``get_reward(spec)`` returns a registered
  one or imports ``"package.module:function"``. Built-ins: ``toy`` (exact match of the addition
  task, ``miles_core.data.toy``), ``math`` and ``gsm8k`` (``miles_core.rewards.math``), imported
  on first use.
- ``score_groups(fn, groups)`` fills ``sample.reward``. It never raises for a reward's failure:
  a sample whose reward raises (or is not a finite number) gets status FAILED, ``reward`` None and
  ``error`` ``"reward: <ExcType>: <message>"``; a per-group function that raises fails its whole
  group. Samples already ABORTED or FAILED (by generation) are skipped. ``RewardStats`` counts it all.
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
# Not `import math`: importing the submodule miles_core.rewards.math rebinds that package attribute.
from math import isfinite
from typing import Any, TypeVar, Union

from miles_core.types import Group, Sample, SampleStatus

RewardFn = Union[
    Callable[[Sample], Union[float, Awaitable[float]]],
    Callable[[list[Sample]], Union[list[float], Awaitable[list[float]]]],
]
F = TypeVar("F", bound=Callable[..., Any])

MAX_ERRORS_KEPT = 5
MAX_ERROR_CHARS = 500
_SKIPPED = (SampleStatus.ABORTED, SampleStatus.FAILED)
_REGISTRY: dict[str, Callable[..., Any]] = {}


def group_reward(fn: F) -> F:
    """Mark ``fn`` as a per-group reward: ``fn(samples) -> list[float]``, one score per sample."""
    fn.per_group = True  # type: ignore[attr-defined]
    return fn


def register_reward(*names: str) -> Callable[[F], F]:
    """Decorator: make ``fn`` available to ``get_reward`` under each of ``names``."""

    def decorate(fn: F) -> F:
        for name in names:
            _REGISTRY[name] = fn
        return fn

    return decorate


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


def get_reward(spec: str) -> RewardFn:
    """A registered reward by name, or the function ``"package.module:function"`` names."""
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if ":" not in spec:
        raise ValueError(
            f"unknown reward {spec!r}; use a registered name ({', '.join(registered_rewards())}) "
            "or 'package.module:function' for a custom one"
        )
    from miles_core.plugins import load_object

    return load_object(spec, "reward")


# -------------------------------------------------------------------------------------- driver


@dataclass
class RewardStats:
    scored: int = 0
    """Samples that got a reward."""
    failed: int = 0
    """Samples whose reward failed (now status FAILED)."""
    skipped: int = 0
    """Samples not scored because generation had already aborted or failed."""
    errors: list[str] = field(default_factory=list)
    """The first few reward errors, each prefixed with its group and sample index."""


async def score_groups(fn: RewardFn, groups: list[Group], max_concurrency: int = 64) -> RewardStats:
    """Score every scorable sample of ``groups`` in place; never raises for a reward's failure.

    ``max_concurrency`` bounds how many groups are scored at once (for a sync per-sample function,
    each group's samples are scored one after another in one worker thread)."""
    stats = RewardStats()
    limit = asyncio.Semaphore(max_concurrency)
    per_group = getattr(fn, "per_group", False)
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))

    async def score(samples: list[Sample]) -> None:
        async with limit:
            if per_group:
                await _score_group(fn, samples, is_async)
            elif is_async:
                await asyncio.gather(*(_score_one_async(fn, s) for s in samples))
            else:
                await asyncio.to_thread(lambda: [_score_one(fn, s) for s in samples])

    todo = []
    for group in groups:
        samples = [s for s in group.samples if s.status not in _SKIPPED]
        stats.skipped += len(group.samples) - len(samples)
        if samples:
            todo.append(samples)
    await asyncio.gather(*(score(samples) for samples in todo))
    for samples in todo:
        for s in samples:
            if s.status is SampleStatus.FAILED:
                stats.failed += 1
                if len(stats.errors) < MAX_ERRORS_KEPT:
                    stats.errors.append(f"group {s.group_index} sample {s.sample_index}: {s.error}")
            else:
                stats.scored += 1
    return stats


def _score_one(fn: Callable[[Sample], Any], sample: Sample) -> None:
    try:
        _set_reward(sample, fn(sample))
    except Exception as e:
        _fail(sample, e)


async def _score_one_async(fn: Callable[[Sample], Any], sample: Sample) -> None:
    try:
        _set_reward(sample, await fn(sample))
    except Exception as e:
        _fail(sample, e)


async def _score_group(fn: Callable[[list[Sample]], Any], samples: list[Sample], is_async: bool) -> None:
    try:
        rewards = await fn(samples) if is_async else await asyncio.to_thread(fn, samples)
        rewards = list(rewards)
        if len(rewards) != len(samples):
            raise ValueError(f"per-group reward returned {len(rewards)} scores for {len(samples)} samples")
    except Exception as e:
        for s in samples:
            _fail(s, e)
        return
    for s, value in zip(samples, rewards):
        try:
            _set_reward(s, value)
        except Exception as e:
            _fail(s, e)


def _set_reward(sample: Sample, value: Any) -> None:
    if not isinstance(value, numbers.Real):  # int, float, bool and numpy scalars are fine
        raise TypeError(f"reward function returned {value!r} ({type(value).__name__}); expected a float")
    reward = float(value)
    if not isfinite(reward):
        raise ValueError(f"reward function returned {reward}; expected a finite float")
    sample.reward = reward


def _fail(sample: Sample, error: Exception) -> None:
    sample.reward = None
    sample.status = SampleStatus.FAILED
    sample.error = f"reward: {type(error).__name__}: {error}"[:MAX_ERROR_CHARS]


# ------------------------------------------------------------------------------------ built-ins


@register_reward("toy")
def toy(sample: Sample) -> float:
    """Exact match of the addition task's answer (``miles_core.data.toy.toy_reward``)."""
    from miles_core.data.toy import toy_reward

    if sample.label is None:
        raise ValueError("the toy reward needs a label; the sample has none")
    return toy_reward(sample.response, sample.label)


@register_reward("math", "gsm8k")
def math_answer(sample: Sample) -> float:
    """Final-answer match for math word problems (``miles_core.rewards.math.math_reward``)."""
    from miles_core.rewards.math import math_reward

    return math_reward(sample.response, sample.label)


# -------------------------------------------------------------------------------- post-process


def load_post_process(path: str | None) -> Callable[[list[Group]], Any] | None:
    """The ``rollout.reward_post_process_path`` function, or None."""
    if path is None:
        return None
    from miles_core.plugins import load_object

    return load_object(path, "reward post-process function")


async def post_process_rewards(fn: Callable[[list[Group]], Any] | None, groups: list[Group]) -> None:
    """Let ``fn(groups)`` (sync or async) change rewards in place after scoring."""
    if fn is None:
        return
    result = fn(groups)
    if inspect.isawaitable(result):
        await result
    bad = [f"group {s.group_index} sample {s.sample_index}" for g in groups for s in g.samples
           if s.reward is not None and not isinstance(s.reward, (int, float))]
    if bad:
        raise TypeError(f"reward post-process left non-numeric rewards on {bad[:5]}")
