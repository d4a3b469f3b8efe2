"""Reward functions by name, and the driver that scores groups of samples.

- A reward function is per sample, ``fn(sample: Sample) -> float``, or per group (marked with
  ``@group_reward``), ``fn(samples: list[Sample]) -> list[float]``; either may be ``async``.
  Sync functions run in a worker thread so they never block the event loop.
- ``register_reward(*names)`` registers one under names; ``get_reward(spec)`` returns a registered
  one or imports ``"package.module:function"``. Built-ins: ``toy`` (exact match of the addition
  task, ``miles_core.data.toy``), ``math`` and ``gsm8k`` (``miles_core.rewards.math``), ``format``
  (the answer stated as the math reward reads one), imported on first use; ``remote`` (``remote_rm``)
  posts each sample to ``rollout.rm_url`` (``miles_core.rewards.remote``).
- ``score_groups(fn, groups, timeout_s=60)`` fills ``sample.reward``. It never raises for a
  reward's failure: a sample whose reward raises (or is not a finite number: NaN and infinities
  never reach the advantages) gets status FAILED, ``reward`` None and ``error``
  ``"reward: <ExcType>: <message>"``; a per-group function that raises fails its whole group.
  Samples already ABORTED or FAILED (by generation) are skipped. ``RewardStats`` counts it all.
- Samples are scored concurrently, each call on its own (a per-group function: one call per group),
  so a step's scoring takes about its slowest call. Every call has a deadline (``timeout_s``,
  ``rollout.reward_timeout_s``): a call that has not returned by then fails its sample (a per-group
  call: its group) with ``reward: timed out after N s``, logged as it happens. A sync call cannot be
  interrupted: its thread (a daemon) is left behind, and whatever it returns later is ignored; work
  that can take long belongs in a worker process (``rewards.isolated``, as the math reward's).
  ``RewardStats`` has each call's time (``reward_seconds_p50``/``_p99``/``_max`` in a step's metrics).
  While scoring runs past ``SLOW_SCORING_LOG_S``, a warning says every so often how many calls
  are done, running and waiting, so a slow reward service is visible before its deadline.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
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
SLOW_SCORING_LOG_S = 15.0
"""While scoring takes longer than this, say every this many seconds how many calls still run."""
_SKIPPED = (SampleStatus.ABORTED, SampleStatus.FAILED)
_REGISTRY: dict[str, Callable[..., Any]] = {}
log = logging.getLogger(__name__)


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
    return sorted([*_REGISTRY, REMOTE[0]])


REMOTE = ("remote", "remote_rm")
"""Names of the remote reward (``rewards.remote``): it needs an endpoint, ``rollout.rm_url``."""


def get_reward(spec: str, rm_url: str | None = None) -> RewardFn:
    """A registered reward by name, the remote reward at ``rm_url`` (``remote``, Miles' ``remote_rm``),
    or the function ``"package.module:function"`` names."""
    if spec in REMOTE:
        if rm_url is None:
            raise ValueError(f"reward {spec!r} posts each sample to an endpoint: set rollout.rm_url (--rm-url URL)")
        from miles_core.rewards.remote import RemoteReward

        return RemoteReward(rm_url)
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
    call_seconds: list[float] = field(default_factory=list)
    """How long each call took (a timed-out one: its deadline)."""

    def seconds_metrics(self) -> dict[str, float]:
        """``reward_seconds_p50``, ``_p99`` and ``_max`` of the calls (none: nothing)."""
        from miles_core.metrics import quantile

        if not self.call_seconds:
            return {}
        return {"reward_seconds_p50": quantile(self.call_seconds, 0.5),
                "reward_seconds_p99": quantile(self.call_seconds, 0.99), "reward_seconds_max": max(self.call_seconds)}


async def score_groups(fn: RewardFn, groups: list[Group], max_concurrency: int = 64,
                       timeout_s: float = 60.0) -> RewardStats:
    """Score every scorable sample of ``groups`` in place; never raises for a reward's failure.

    Every sample is scored on its own (a per-group function: every group), up to ``max_concurrency``
    calls at once, so one slow answer holds only its own call and a step's scoring takes about the
    slowest call, not their sum; ``timeout_s`` is each call's deadline, and each timeout is logged
    as it happens."""
    stats = RewardStats()
    limit = asyncio.Semaphore(max_concurrency)
    per_group = getattr(fn, "per_group", False)
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))

    running = done = 0

    async def timed(call: Callable[[], Awaitable[None]]) -> None:
        nonlocal running, done
        async with limit:
            t0 = time.perf_counter()
            running += 1
            try:
                await call()
            finally:
                running, done = running - 1, done + 1
            stats.call_seconds.append(time.perf_counter() - t0)

    todo = []
    for group in groups:
        samples = [s for s in group.samples if s.status not in _SKIPPED]
        stats.skipped += len(group.samples) - len(samples)
        if samples:
            todo.append(samples)
    calls = []
    for samples in todo:
        if per_group:
            calls.append(timed(lambda ss=samples: _score_group(fn, ss, is_async, timeout_s)))
        else:
            score_one = _score_one_async if is_async else _score_one_in_thread
            calls += [timed(lambda s=s: score_one(fn, s, timeout_s)) for s in samples]
    scoring = asyncio.ensure_future(asyncio.gather(*calls))
    t0 = time.monotonic()
    try:
        while not (await asyncio.wait({scoring}, timeout=SLOW_SCORING_LOG_S))[0]:
            log.warning("reward %s: %d of %d calls done after %.0f s, %d running, %d waiting for a slot (each "
                        "has %g s, rollout.reward_timeout_s)", _name(fn), done, len(calls), time.monotonic() - t0,
                        running, len(calls) - done - running, timeout_s)
    finally:
        scoring.cancel()  # only if this wait was interrupted: it is done otherwise
    scoring.result()
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


def _time_out(fn: Any, samples: list[Sample], timeout_s: float) -> None:
    """Fail ``samples``, whose call to ``fn`` passed its deadline, and log it as it happens."""
    for s in samples:
        _fail(s, RewardTimeout(timeout_s))
    where = ", ".join(f"group {s.group_index} sample {s.sample_index}" for s in samples[:3])
    log.warning("reward %s timed out after %g s on %s (rollout.reward_timeout_s)", _name(fn), timeout_s, where)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


async def _score_one_in_thread(fn: Callable[[Sample], Any], sample: Sample, timeout_s: float) -> None:
    """A sync per-sample call on a daemon thread of its own: one that passes its deadline fails its
    sample and is left behind (a thread cannot be stopped; what it returns later is ignored)."""
    try:
        value = await asyncio.wait_for(_in_thread(fn, sample), timeout_s)
    except asyncio.TimeoutError:
        _time_out(fn, [sample], timeout_s)
        return
    except Exception as e:
        _fail(sample, e)
        return
    _settle(sample, value, None)


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
        _time_out(fn, [sample], timeout_s)
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
        _time_out(fn, samples, timeout_s)
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


@register_reward("format")
def answer_format(sample: Sample) -> float:
    """1.0 when the response states its final answer in a form the math reward reads as one (a box,
    a GSM8K ``#### `` line, or "the answer is ..."), else 0.0 (``rewards.math.marks_an_answer``);
    no label needed. Add it to another reward with a custom function or a reward post-process."""
    from miles_core.rewards.math import marks_an_answer

    return 1.0 if marks_an_answer(sample.response) else 0.0


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
