"""Each sample of the fully-async producer, from its requests to a ``Sample``.

Parts:
- ``Generation``: how samples are made and scored (a ``RolloutSide``'s engine, sampling params,
  reward, custom generate function and tokenizer).
- ``EngineDoor``: when the producer's requests may enter the engine, and how many are in it. It is
  closed while the producer is paused (an evaluation borrows the engine) or loads new weights,
  and open again once neither holds it.
- ``GroupWork``: one group being generated (its prompt, index, route, and each sample's task).
- ``Trajectory``: one sample being generated, possibly over several spans, each under the weight
  version that generated it.
- ``Sampler``: generates sample ``j`` of a group: one request (continued under new weights as a
  new span with ``partial_rollout``), or the custom generate function. A failed engine call is
  retried ``generation_retries`` times, then its sample is marked FAILED with the error; when the
  engine itself did not answer (``EngineUnreachable``: refused, reset, silent past its health
  deadline; not a request's own timeout), ``EngineUnreachable`` stops the producer instead.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from miles_core.engines.base import GenerateRequest, GenerateResult, RolloutEngine, SamplingParams
from miles_core.engines.http import EngineTimeout, EngineUnreachable
from miles_core.rollout.generate import FINISH_STATUS, CustomGenerate, GenerateContext, PromptItem, run_custom_generate
from miles_core.types import Group, Sample, SampleStatus

if TYPE_CHECKING:
    from miles_core.config import FullyAsyncMode
    from miles_core.rollout.producer import PolicyRoute
    from miles_core.rollout.throughput import ProducerStats

ADAPTER_VERSIONS = "adapter_versions"
"""Metadata key of the version stamp: every adapter's version when the sample's group started."""


@dataclass(frozen=True)
class Generation:
    """How the producer makes and scores samples."""

    engine: RolloutEngine
    """The shared engine: ``abort``, ``pause`` and weight loads go to it (every route's engine is a view of it)."""
    sampling: SamplingParams
    reward: Callable[[list[Group]], Awaitable[Any]]
    """Scores groups in place (``score_groups`` with the run's reward, then post-processing)."""
    custom_generate: CustomGenerate | None = None
    """Makes each sample instead of one request (multi-turn, tool use); see rollout/generate.py."""
    tokenizer: Any = None


class EngineDoor:
    """Open: requests may enter the engine. ``close(why)`` until ``reopen(why)`` for every reason
    given; ``async with door`` counts a call in the engine, ``drained()`` waits until none is."""

    def __init__(self) -> None:
        self.count = 0
        self._open = asyncio.Event()
        self._open.set()
        self._held_by: set[str] = set()
        self._changed = asyncio.Condition()

    def is_open(self) -> bool:
        return self._open.is_set()

    async def wait_open(self) -> None:
        await self._open.wait()

    def close(self, why: str) -> None:
        self._held_by.add(why)
        self._open.clear()

    def reopen(self, why: str) -> None:
        self._held_by.discard(why)
        if not self._held_by:
            self._open.set()

    def open_for_stop(self) -> None:
        """Let waiting samples through to see the stop (they submit nothing after it)."""
        self._open.set()

    async def __aenter__(self) -> None:
        async with self._changed:
            self.count += 1

    async def __aexit__(self, *exc: object) -> None:
        async with self._changed:
            self.count -= 1
            self._changed.notify_all()

    async def drained(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.count == 0)


@dataclass(eq=False)  # hashed by identity: works live in a set
class GroupWork:
    """One group being generated: its prompt, index, and each sample's trajectory or result."""

    item: PromptItem
    group_index: int
    resumed: list[Sample | None]
    """Samples of a resumed partial group: finished ones are kept, aborted ones are continued."""
    route: PolicyRoute
    tasks: list[asyncio.Task] = field(default_factory=list)
    finishing: asyncio.Task | None = None
    """Gathers, scores and files the group once every sample has a task."""

    @classmethod
    def resume(cls, group: Group, n: int, route: PolicyRoute) -> GroupWork:
        """A saved partial group, to be continued: each sample at its own index."""
        by_index: list[Sample | None] = [None] * n
        for s in group.samples:
            if s.sample_index < n:
                by_index[s.sample_index] = s
        first = group.samples[0]
        item = PromptItem(first.prompt, list(first.prompt_ids), first.label, first.prompt_index, dict(first.metadata))
        return cls(item, group.group_index, by_index, route)


@dataclass
class Trajectory:
    """One sample being generated, possibly over several spans (partial rollout)."""

    submit_version: int
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    span_starts: list[int] = field(default_factory=list)
    span_versions: list[int] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None

    def add(self, result: GenerateResult) -> None:
        if result.output_ids or not self.span_starts:
            if self.span_starts and not self.output_ids:  # an empty first span is replaced
                self.span_starts, self.span_versions = [], []
            self.span_starts.append(len(self.output_ids))
            self.span_versions.append(result.weight_version)
        self.output_ids += result.output_ids
        self.text += result.text
        self.logprobs += result.logprobs
        self.finish = result.finish_reason

    @classmethod
    def of(cls, sample: Sample) -> Trajectory:
        """The state of a saved partial sample."""
        return cls(
            sample.submit_version, list(sample.response_ids), sample.response, list(sample.rollout_logprobs),
            list(sample.span_starts), list(sample.span_versions),
        )

    def sample(self, work: GroupWork, sample_index: int) -> Sample:
        status = SampleStatus.FAILED if self.error else FINISH_STATUS[self.finish or "abort"]
        return Sample(
            prompt=work.item.text,
            prompt_ids=list(work.item.prompt_ids),
            response_ids=self.output_ids,
            response=self.text,
            label=work.item.label,
            loss_mask=[1] * len(self.output_ids),
            rollout_logprobs=self.logprobs,
            span_starts=self.span_starts or [0],
            span_versions=self.span_versions or [self.submit_version],
            submit_version=self.submit_version,
            status=status,
            group_index=work.group_index,
            sample_index=sample_index,
            prompt_index=work.item.prompt_index,
            adapter=work.route.name,
            error=self.error,
            metadata=dict(work.item.metadata),
        )


class _GaveUp(Exception):
    """A sample's engine calls failed more times than ``generation_retries`` allows."""


class Sampler:
    """Generates the samples of groups through an ``EngineDoor``; nothing is submitted after ``stop``."""

    def __init__(self, gen: Generation, n: int, acfg: FullyAsyncMode, door: EngineDoor, stop: threading.Event,
                 stats: ProducerStats) -> None:
        self.gen, self.n, self.acfg = gen, n, acfg
        self.door, self.stop, self.stats = door, stop, stats

    async def sample(self, work: GroupWork, j: int) -> Sample:
        """Generate sample ``j`` of ``work``: retries, spans under each weight version, abort."""
        resumed = work.resumed[j]
        if resumed is not None and resumed.status is not SampleStatus.ABORTED:
            return resumed
        if self.gen.custom_generate is not None:
            return await self._custom_sample(work, j)
        engine = work.route.engine
        traj = Trajectory.of(resumed) if resumed is not None else Trajectory(engine.weight_version)
        while True:
            remaining = self.gen.sampling.max_new_tokens - len(traj.output_ids)
            request = GenerateRequest(
                list(work.item.prompt_ids) + traj.output_ids,
                replace(self.gen.sampling, max_new_tokens=remaining, seed=self._seed(work.group_index, j, traj)),
                rid=f"g{work.group_index}-s{j}",
            )
            try:
                results = await self._call_with_retries(lambda: engine.generate([request]), f"request {request.rid}")
            except _GaveUp as e:
                traj.error = f"generation {e}"
                break
            if results is None:  # stopped before it was submitted: the sample is unfinished
                traj.finish = "abort"
                break
            (result,) = results
            traj.add(result)
            continuing = result.finish_reason == "abort" and self.acfg.partial_rollout and not self.stop.is_set()
            if not continuing or remaining - len(result.output_ids) <= 0:
                break
        return traj.sample(work, j)

    async def unstarted(self, work: GroupWork, j: int) -> Sample:
        """A sample the producer never submitted (stop came first): aborted, with no output."""
        return Trajectory(work.route.engine.weight_version, finish="abort").sample(work, j)

    async def _custom_sample(self, work: GroupWork, j: int) -> Sample:
        """A sample from the custom generate function, with the same retries and counting."""
        traj = Trajectory(work.route.engine.weight_version)
        sampling = replace(self.gen.sampling, seed=self._seed(work.group_index, j, traj))
        ctx = GenerateContext(work.route.engine, self.gen.tokenizer, sampling, work.group_index, j)
        try:
            sample = await self._call_with_retries(
                lambda: run_custom_generate(self.gen.custom_generate, ctx, work.item),
                f"custom generate of g{work.group_index}-s{j}")
        except _GaveUp as e:
            traj.error = f"custom generate {e}"
            return traj.sample(work, j)
        if sample is None:
            traj.finish = "abort"
            return traj.sample(work, j)
        sample.adapter = work.route.name
        if ADAPTER_VERSIONS in work.item.metadata:  # a sample built without ctx.new_sample
            sample.metadata.setdefault(ADAPTER_VERSIONS, work.item.metadata[ADAPTER_VERSIONS])
        return sample

    async def _call_with_retries(self, call: Callable[[], Awaitable[Any]], what: str) -> Any:
        """``await call()`` once the door is open, counted in the engine; a failure is retried
        ``generation_retries`` times with back-off, then ``_GaveUp`` (or ``EngineUnreachable``
        when the engine itself stopped answering: the producer stops). None: stopped first."""
        attempts = 0
        while True:
            await self.door.wait_open()
            if self.stop.is_set():  # never submit after stop
                return None
            try:
                async with self.door:
                    return await call()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the engine failed this call: retry, then count it
                attempts += 1
                self.stats.generation_errors += 1
                if attempts > self.acfg.generation_retries:
                    if isinstance(e, EngineUnreachable) and not isinstance(e, EngineTimeout):  # the engine is gone
                        raise EngineUnreachable(f"rollout producer: its engine did not answer {what} "
                                                f"{attempts} times; last: {e}") from e
                    raise _GaveUp(f"failed {attempts} times; last: {type(e).__name__}: {e}") from e
            await asyncio.sleep(min(0.1 * 2 ** (attempts - 1), 2.0))

    def _seed(self, group_index: int, j: int, traj: Trajectory) -> int | None:
        """A per-request seed (reproducible runs) when the sampling params carry one."""
        seed = self.gen.sampling.seed
        if seed is None:
            return None
        return seed + (group_index * self.n + j) * 1_009 + len(traj.output_ids)
