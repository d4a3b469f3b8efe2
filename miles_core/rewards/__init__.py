"""Reward functions by name, and the driver that scores groups of samples.

- A reward function is per sample, ``fn(sample: Sample) -> float``, or per group (marked with
  ``@group_reward``), ``fn(samples: list[Sample]) -> list[float]``; either may be ``async``.
  Sync functions run in a worker thread so they never block the event loop.
- ``register_reward(*names)`` registers one under names; ``get_reward(spec)`` returns a registered
  one or imports ``"package.module:function"``. Built-ins: ``toy`` (exact match of the addition
  task, ``miles_core.data.toy``), ``math`` and ``gsm8k`` (``miles_core.rewards.math``), imported
  on first use.
- ``score_groups(fn, groups, timeout_s=60)`` fills ``sample.reward``. It never raises for a
  reward's failure: a sample whose reward raises (or is not a finite number: NaN and infinities
  never reach the advantages) gets status FAILED, ``reward`` None and ``error``
  ``"reward: <ExcType>: <message>"``; a per-group function that raises fails its whole group.
  Samples already ABORTED or FAILED (by generation) are skipped. ``RewardStats`` counts it all.
- Every call has a deadline (``timeout_s``, ``rollout.reward_timeout_s``): a call that has not
  returned by then fails its sample (a per-group call: its group) with ``reward: timed out after
  N s``, and scoring goes on with the next one. A sync call cannot be interrupted: its thread (one
  per group being scored, a daemon) is left behind, and whatever the call returns later is ignored.
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
import threading
import time
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


async def score_groups(fn: RewardFn, groups: list[Group], max_concurrency: int = 64,
                       timeout_s: float = 60.0) -> RewardStats:
    """Score every scorable sample of ``groups`` in place; never raises for a reward's failure.

    ``max_concurrency`` bounds how many groups are scored at once (for a sync per-sample function,
    each group's samples are scored one after another in one worker thread); ``timeout_s`` is each
    call's deadline."""
    stats = RewardStats()
    limit = asyncio.Semaphore(max_concurrency)
    per_group = getattr(fn, "per_group", False)
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))

    async def score(samples: list[Sample]) -> None:
        async with limit:
            if per_group:
                await _score_group(fn, samples, is_async, timeout_s)
            elif is_async:
                await asyncio.gather(*(_score_one_async(fn, s, timeout_s) for s in samples))
            else:
                await _score_in_thread(fn, samples, timeout_s)

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


class RewardTimeout(Exception):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"timed out after {timeout_s:g} s (rollout.reward_timeout_s)")


class _Batch:
    """Sync per-sample calls over some samples, one after another on a thread of their own; the
    event loop watches the call in progress and gives up on the batch when one passes its deadline."""

    def __init__(self, fn: Callable[[Sample], Any], samples: list[Sample]) -> None:
        self.fn, self.samples = fn, samples
        self.lock = threading.Lock()
        self.index, self.started = 0, time.monotonic()  # the call in progress
        self.abandoned = False

    def run(self, done: Callable[[], None]) -> None:
        try:
            for i, sample in enumerate(self.samples):
                with self.lock:
                    if self.abandoned:
                        return
                    self.index, self.started = i, time.monotonic()
                try:
                    value, error = self.fn(sample), None
                except Exception as e:
                    value, error = None, e
                with self.lock:
                    if self.abandoned:  # the deadline passed: the sample is failed already
                        return
                    _settle(sample, value, error)
        finally:
            done()

    def give_up(self, timeout_s: float) -> int:
        """Fail the call in progress with a timeout; returns the index of the next sample to score."""
        with self.lock:
            self.abandoned = True
            _fail(self.samples[self.index], RewardTimeout(timeout_s))
            return self.index + 1


async def _score_in_thread(fn: Callable[[Sample], Any], samples: list[Sample], timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    while samples:
        finished = asyncio.Event()
        batch = _Batch(fn, samples)
        threading.Thread(target=batch.run, args=(_waker(loop, finished.set),), name="reward", daemon=True).start()
        while not finished.is_set():
            with batch.lock:
                left = batch.started + timeout_s - time.monotonic()
            if left <= 0:
                samples = samples[batch.give_up(timeout_s):]  # the rest go on in a new thread
                break
            try:
                await asyncio.wait_for(finished.wait(), left)
            except asyncio.TimeoutError:
                pass
        else:
            return


def _waker(loop: asyncio.AbstractEventLoop, callback: Callable[[], Any]) -> Callable[[], None]:
    """``callback`` on ``loop``, from another thread (a thread left behind may finish after the loop closed)."""

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    return wake


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a daemon thread of its own (a call that never returns holds no pool's thread)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 (handed to the awaiting side)
            result, error = None, e
        _waker(loop, lambda: future.done() or (future.set_exception(error) if error else future.set_result(result)))()

    threading.Thread(target=run, name="reward", daemon=True).start()
    return await future


def reward_errors(groups: list[Group]) -> list[str]:
    """Every sample of ``groups`` whose reward failed, as ``"group g sample i: reward: ..."``."""
    return [f"group {s.group_index} sample {s.sample_index}: {s.error}" for g in groups for s in g.samples
            if s.status is SampleStatus.FAILED and (s.error or "").startswith("reward:")]


def _settle(sample: Sample, value: Any, error: Exception | None) -> None:
    if error is None:
        try:
            _set_reward(sample, value)
            return
        except Exception as e:
            error = e
    _fail(sample, error)


async def _score_one_async(fn: Callable[[Sample], Any], sample: Sample, timeout_s: float) -> None:
    try:
        _set_reward(sample, await asyncio.wait_for(fn(sample), timeout_s))
    except asyncio.TimeoutError:
        _fail(sample, RewardTimeout(timeout_s))
    except Exception as e:
        _fail(sample, e)


async def _score_group(fn: Callable[[list[Sample]], Any], samples: list[Sample], is_async: bool,
                       timeout_s: float) -> None:
    try:
        call = fn(samples) if is_async else _in_thread(fn, samples)
        rewards = list(await asyncio.wait_for(call, timeout_s))
        if len(rewards) != len(samples):
            raise ValueError(f"per-group reward returned {len(rewards)} scores for {len(samples)} samples")
    except asyncio.TimeoutError:
        for s in samples:
            _fail(s, RewardTimeout(timeout_s))
        return
    except Exception as e:
        for s in samples:
            _fail(s, e)
        return
    for s, value in zip(samples, rewards):
        _settle(s, value, None)


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
