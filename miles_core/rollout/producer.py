"""The fully-async rollout producer: generates for the whole run into the sample stream.

Parts:
- ``SlotScheduler``: at most ``max_concurrent_samples`` samples in flight; whole groups or single
  samples take slots (``AsyncConfig.submit_granularity``), so with ``sample`` a finished sample's
  slot is refilled at once (backfill).
- ``RolloutProducer``: the asyncio loop. It runs on the engine's event loop; other threads drive it
  through ``request_stop`` / ``pause`` / ``resume`` (thread-safe).

One loop iteration: look for a newer weight version (and load it), wait while paused or while the
run is ``capacity`` groups ahead of the trainer (back-pressure, measured from the trainer's durable
cursor), take slots, start the next sample or group, and write finished groups to the stream
once ``segment_max_groups`` are ready, the oldest has waited ``segment_max_wait_s``, or the
producer is at its bound (the trainer may be waiting for exactly those groups).

Every sample records ``submit_version`` (the engine's version when it was submitted) and the
version of each generated span. A weight update lets in-flight requests finish under the old
weights (their spans say so); with ``partial_rollout`` it aborts them and continues each one under
the new weights as a new span. A failed generate call is retried ``generation_retries`` times,
then its sample is marked FAILED with the error and counted. Groups that dynamic filters reject
are counted per filter. On stop, unfinished groups are counted as abandoned, or, with
``partial_rollout``, written to the ``partial`` stream, which the next producer resumes first.

State (``state/producer.json``: next group index, prompt cursor, counters) is written with every
segment, so a restarted producer continues where the last segment left off.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from miles_core.engines.base import GenerateRequest, GenerateResult, RolloutEngine, SamplingParams
from miles_core.rollout.filters import GroupFilters
from miles_core.rollout.generate import CustomGenerate, GenerateContext, PromptItem, run_custom_generate
from miles_core.types import Group, Sample, SampleStatus

if TYPE_CHECKING:
    from miles_core.config import RunConfig
    from miles_core.storage.layout import RunLayout
    from miles_core.storage.stream import SampleStream, StreamWriter
    from miles_core.storage.weights import WeightStore

STATE_FILE = "state/producer.json"
PARTIAL_PRODUCER = "partial"
RECYCLE_PRODUCER = "recycle"
_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


class PromptSupply(Protocol):
    """Where the producer's prompts come from (the run's ``DataSource`` plus rendering)."""

    def next(self) -> PromptItem: ...

    def push_back(self, prompt_indices: list[int]) -> None: ...

    def state(self) -> dict[str, Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...


# ------------------------------------------------------------------------------------ scheduler


class SlotScheduler:
    """Counts samples in flight; ``acquire(n)`` waits until ``n`` more fit under ``limit``.
    ``idle_seconds()`` is the time spent with nothing in flight."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self.peak = 0
        self._changed = asyncio.Condition()
        self._idle_total = 0.0
        self._idle_since: float | None = time.monotonic()

    def idle_seconds(self) -> float:
        now = time.monotonic()
        return self._idle_total + (now - self._idle_since if self._idle_since is not None else 0.0)

    def _count(self, delta: int) -> None:
        before, self.in_flight = self.in_flight, self.in_flight + delta
        if before == 0 and self.in_flight > 0:
            self._idle_total += time.monotonic() - self._idle_since
            self._idle_since = None
        elif before > 0 and self.in_flight == 0:
            self._idle_since = time.monotonic()

    @property
    def free(self) -> int:
        return self.limit - self.in_flight

    async def acquire(self, n: int, timeout: float) -> bool:
        """Take ``n`` slots; False if they did not free up within ``timeout`` seconds."""
        if n > self.limit:
            raise ValueError(f"a unit of {n} samples can never fit in {self.limit} slots; raise max_concurrent_samples")
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.in_flight + n <= self.limit), timeout)
            except asyncio.TimeoutError:
                return False
            self._count(n)
            self.peak = max(self.peak, self.in_flight)
            return True

    async def release(self, n: int) -> None:
        async with self._changed:
            self._count(-n)
            self._changed.notify_all()


# ------------------------------------------------------------------------------------ samples


@dataclass
class _Trajectory:
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
    def of(cls, sample: Sample) -> _Trajectory:
        """The state of a saved partial sample."""
        return cls(
            sample.submit_version, list(sample.response_ids), sample.response, list(sample.rollout_logprobs),
            list(sample.span_starts), list(sample.span_versions),
        )

    def sample(self, item: PromptItem, group_index: int, sample_index: int) -> Sample:
        status = SampleStatus.FAILED if self.error else _STATUS[self.finish or "abort"]
        return Sample(
            prompt=item.text,
            prompt_ids=list(item.prompt_ids),
            response_ids=self.output_ids,
            response=self.text,
            label=item.label,
            loss_mask=[1] * len(self.output_ids),
            rollout_logprobs=self.logprobs,
            span_starts=self.span_starts or [0],
            span_versions=self.span_versions or [self.submit_version],
            submit_version=self.submit_version,
            status=status,
            group_index=group_index,
            sample_index=sample_index,
            prompt_index=item.prompt_index,
            error=self.error,
            metadata=dict(item.metadata),
        )


@dataclass(eq=False)  # hashed by identity: works live in a set
class _Work:
    """One group being generated: its prompt, index, and each sample's trajectory or result."""

    item: PromptItem
    group_index: int
    resumed: list[Sample | None]
    """Samples of a resumed partial group: finished ones are kept, aborted ones are continued."""
    tasks: list[asyncio.Task] = field(default_factory=list)


def _item_of(sample: Sample) -> PromptItem:
    return PromptItem(sample.prompt, list(sample.prompt_ids), sample.label, sample.prompt_index, dict(sample.metadata))


# ------------------------------------------------------------------------------------- producer


@dataclass
class ProducerStats:
    groups_started: int = 0
    groups_finished: int = 0
    groups_written: int = 0
    segments_written: int = 0
    samples_finished: int = 0
    samples_failed: int = 0
    generation_errors: int = 0
    groups_filtered: dict[str, int] = field(default_factory=dict)
    groups_abandoned: int = 0
    groups_saved_partial: int = 0
    groups_resumed_partial: int = 0
    groups_recycled_in: int = 0
    weight_updates: int = 0
    weight_update_seconds: float = 0.0
    backpressure_seconds: float = 0.0
    idle_seconds: float = 0.0
    run_seconds: float = 0.0
    peak_in_flight: int = 0


class RolloutProducer:
    def __init__(
        self,
        cfg: RunConfig,
        engine: RolloutEngine,
        prompts: PromptSupply,
        reward: Callable[[list[Group]], Awaitable[Any]],
        stream: SampleStream,
        layout: RunLayout,
        weights: WeightStore,
        sampling: SamplingParams,
        consumer: str = "trainer",
        custom_generate: CustomGenerate | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.cfg, self.acfg = cfg, cfg.async_rollout
        self.engine = engine
        self.prompts = prompts
        self.reward = reward
        """Scores groups in place (``score_groups`` with the run's reward, then post-processing)."""
        self.stream = stream
        self.layout = layout
        self.weights = weights
        self.sampling = sampling
        self.consumer = consumer
        self.custom_generate = custom_generate
        """Makes each sample instead of one request (multi-turn, tool use); see rollout/generate.py."""
        self.tokenizer = tokenizer
        self.n = cfg.rollout.n_samples_per_prompt
        self.capacity = max(1, round(self.acfg.buffer_capacity_factor * cfg.rollout.rollout_batch_size))
        """Groups the producer may be ahead of the consumer (in flight + unwritten + unconsumed)."""
        self.filters = GroupFilters(self.acfg.dynamic_filters)
        self.stats = ProducerStats()
        self.scheduler: SlotScheduler | None = None
        self._stop = threading.Event()
        self._gate: asyncio.Event | None = None  # set: requests may be submitted
        self._paused = False
        self._calls_in_engine = 0
        self._works: set[_Work] = set()
        self._open: _Work | None = None  # sample granularity: the group whose samples are being started
        self._queue: list[_Work] = []  # resumed partial groups, started before new prompts
        self._finished: list[Group] = []
        self._unfinished: list[Group] = []  # groups cut short by stop
        self._oldest_finished_at: float | None = None
        self._segment_groups: dict[int, int] = {}  # offset -> groups in it (for back-pressure)
        self._next_group = 0
        self._error: BaseException | None = None
        self._seen_weights_at = 0.0
        self._writer: StreamWriter | None = None

    # -------------------------------------------------------------------- control (any thread)

    def request_stop(self) -> None:
        """Ask the loop to stop (it notices within ``weight_poll_s``); ``run`` returns once in-flight
        work is settled and written."""
        self._stop.set()

    async def pause(self) -> None:
        """Stop submitting and wait until no request is in the engine (evaluation can borrow it)."""
        self._paused = True
        self._gate.clear()
        while self._calls_in_engine:
            await asyncio.sleep(0.01)

    async def resume(self) -> None:
        self._paused = False
        self._gate.set()

    # --------------------------------------------------------------------------------- the loop

    async def run(self) -> ProducerStats:
        """Produce until ``request_stop``. Raises what broke the producer (after writing its state)."""
        self._gate = asyncio.Event()
        self._gate.set()
        self.scheduler = SlotScheduler(self.acfg.max_concurrent_samples)
        started = time.monotonic()
        self._load_state()
        self._writer = self.stream.writer(max_pending=2)
        self._recycle = self.stream.sibling(RECYCLE_PRODUCER)
        self._partial = self.stream.sibling(PARTIAL_PRODUCER)
        await asyncio.to_thread(self._resume_partial_groups)
        try:
            while not self._stop.is_set():
                self._raise_if_failed()
                await self._poll_weights_and_recycled()
                await self._flush(force=False)
                if not self._gate.is_set():  # paused, or loading weights
                    await asyncio.sleep(self.acfg.weight_poll_s)
                    continue
                if self._outstanding() >= self.capacity:
                    await self._flush(force=True)  # at the bound: nothing more comes until the trainer moves
                    if not await self._wait_for_consumer():
                        continue
                await self._start_next()
            await self._settle_on_stop()
            await self._flush(force=True)
        except BaseException as e:
            self._error = self._error or e
            await asyncio.to_thread(self._save_state, "failed", _describe(e))
            raise
        finally:
            self._update_clock(started)
            for work in list(self._works):
                for task in work.tasks:
                    task.cancel()
            await asyncio.to_thread(self._writer.close)
        await asyncio.to_thread(self._save_state, "stopped")
        return self.stats

    def _update_clock(self, started: float) -> None:
        self.stats.run_seconds = time.monotonic() - started
        self.stats.idle_seconds = self.scheduler.idle_seconds()
        self.stats.peak_in_flight = self.scheduler.peak

    async def _start_next(self) -> None:
        """Take slots for the next unit (a group, or one sample) and start it."""
        unit = self.n if self.acfg.submit_granularity == "group" else 1
        if not await self.scheduler.acquire(unit, timeout=min(self.acfg.weight_poll_s, self.acfg.segment_max_wait_s)):
            return
        if unit == self.n:
            work = await self._new_work()
            work.tasks = [self._spawn(self._sample(work, j), release=1) for j in range(self.n)]
            self._spawn(self._finish_group(work))
            return
        if self._open is None:
            self._open = await self._new_work()
        work = self._open
        work.tasks.append(self._spawn(self._sample(work, len(work.tasks)), release=1))
        if len(work.tasks) == self.n:
            self._open = None
            self._spawn(self._finish_group(work))

    async def _new_work(self) -> _Work:
        if self._queue:
            work = self._queue.pop(0)
        else:
            item = await asyncio.to_thread(self.prompts.next)
            work = _Work(item, self._next_group, [None] * self.n)
            self._next_group += 1
        self._works.add(work)
        self.stats.groups_started += 1
        return work

    def _spawn(self, coro, release: int = 0) -> asyncio.Task:
        return asyncio.ensure_future(self._guard(coro, release))

    async def _guard(self, coro, release: int):
        """Run a producer coroutine; an unexpected error stops the producer (it reaches ``run``)."""
        try:
            return await coro
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._error = self._error or e
            self._stop.set()
            raise
        finally:
            if release:
                await self.scheduler.release(release)

    async def _sample(self, work: _Work, j: int) -> Sample:
        """Generate sample ``j`` of ``work``: retries, spans under each weight version, abort."""
        resumed = work.resumed[j]
        if resumed is not None and resumed.status is not SampleStatus.ABORTED:
            return resumed
        if self.custom_generate is not None:
            return await self._custom_sample(work, j)
        traj = _Trajectory.of(resumed) if resumed is not None else _Trajectory(self.engine.weight_version)
        attempts = 0
        while True:
            await self._gate.wait()
            if self._stop.is_set():  # never submit after stop; the sample is unfinished
                traj.finish = "abort"
                break
            remaining = self.sampling.max_new_tokens - len(traj.output_ids)
            request = GenerateRequest(
                list(work.item.prompt_ids) + traj.output_ids,
                replace(self.sampling, max_new_tokens=remaining, seed=self._seed(work.group_index, j, traj)),
                rid=f"g{work.group_index}-s{j}",
            )
            self._calls_in_engine += 1
            try:
                (result,) = await self.engine.generate([request])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the engine failed this request: retry, then count it
                attempts += 1
                self.stats.generation_errors += 1
                if attempts > self.acfg.generation_retries:
                    traj.error = f"generation failed {attempts} times; last: {type(e).__name__}: {e}"
                    break
                await asyncio.sleep(min(0.1 * 2 ** (attempts - 1), 2.0))
                continue
            finally:
                self._calls_in_engine -= 1
            traj.add(result)
            continuing = result.finish_reason == "abort" and self.acfg.partial_rollout and not self._stop.is_set()
            if not continuing or remaining - len(result.output_ids) <= 0:
                break
        return traj.sample(work.item, work.group_index, j)

    async def _custom_sample(self, work: _Work, j: int) -> Sample:
        """A sample from the custom generate function, with the same retries and counting."""
        traj = _Trajectory(self.engine.weight_version)
        for attempt in range(1, self.acfg.generation_retries + 2):
            await self._gate.wait()
            if self._stop.is_set():
                traj.finish = "abort"
                break
            sampling = replace(self.sampling, seed=self._seed(work.group_index, j, traj))
            ctx = GenerateContext(self.engine, self.tokenizer, sampling, work.group_index, j)
            self._calls_in_engine += 1
            try:
                return await run_custom_generate(self.custom_generate, ctx, work.item)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.stats.generation_errors += 1
                traj.error = f"custom generate failed {attempt} times; last: {type(e).__name__}: {e}"
                await asyncio.sleep(min(0.1 * 2 ** (attempt - 1), 2.0))
            finally:
                self._calls_in_engine -= 1
        return traj.sample(work.item, work.group_index, j)

    def _seed(self, group_index: int, j: int, traj: _Trajectory) -> int | None:
        """A per-request seed (reproducible runs) when the sampling params carry one."""
        if self.sampling.seed is None:
            return None
        return self.sampling.seed + (group_index * self.n + j) * 1_009 + len(traj.output_ids)

    async def _unstarted(self, work: _Work, j: int) -> Sample:
        """A sample the producer never submitted (stop came first): aborted, with no output."""
        return _Trajectory(self.engine.weight_version, finish="abort").sample(work.item, work.group_index, j)

    async def _finish_group(self, work: _Work) -> None:
        try:
            group = Group(list(await asyncio.gather(*work.tasks)))
            if self._stop.is_set() and any(s.status is SampleStatus.ABORTED for s in group.samples):
                self._unfinished.append(group)  # settled by _settle_on_stop
                return
            self.stats.samples_finished += len(group.samples)
            self.stats.samples_failed += sum(s.status is SampleStatus.FAILED for s in group.samples)
            await self.reward([group])
            self.stats.groups_finished += 1
            if not self.filters.keep(group):
                self.stats.groups_filtered = dict(self.filters.dropped)
                return
            if not self._finished:
                self._oldest_finished_at = time.monotonic()
            self._finished.append(group)
        finally:
            self._works.discard(work)

    # ------------------------------------------------------------------------ stream and state

    async def _flush(self, force: bool) -> None:
        """Write finished groups as one segment when enough are ready, or they waited long enough."""
        if not self._finished:
            return
        waited = time.monotonic() - (self._oldest_finished_at or time.monotonic())
        if not force and len(self._finished) < self.acfg.segment_max_groups and waited < self.acfg.segment_max_wait_s:
            return
        groups, self._finished = sorted(self._finished, key=lambda g: g.group_index), []
        size = self.acfg.segment_max_groups
        for start in range(0, len(groups), size):
            chunk = groups[start : start + size]
            offset = await asyncio.to_thread(self._writer.append, chunk)
            self._segment_groups[offset] = len(chunk)
            self.stats.groups_written += len(chunk)
            self.stats.segments_written += 1
        await asyncio.to_thread(self._save_state, "running")

    def _outstanding(self) -> int:
        """Groups ahead of the consumer: in flight, finished but unwritten, written but unconsumed."""
        return len(self._works) + len(self._finished) + sum(self._segment_groups.values())

    async def _wait_for_consumer(self) -> bool:
        """Back-pressure: wait until the consumer's cursor frees room; False if it did not (yet)."""
        t0 = time.monotonic()
        cursor = await asyncio.to_thread(lambda: self.stream.reader(self.consumer).cursor)
        for offset in [o for o in self._segment_groups if o <= cursor]:
            del self._segment_groups[offset]
        if self._outstanding() < self.capacity:
            return True
        await asyncio.sleep(0.05)
        self.stats.backpressure_seconds += time.monotonic() - t0
        return False

    async def _poll_weights_and_recycled(self) -> None:
        now = time.monotonic()
        if now - self._seen_weights_at < self.acfg.weight_poll_s:
            return
        self._seen_weights_at = now
        latest = await asyncio.to_thread(self.weights.latest)
        if latest is not None and latest > self.engine.weight_version:
            await self._update_weights(latest)
        if self.acfg.unused_samples_handler == "retry":
            await asyncio.to_thread(self._take_recycled)

    async def _update_weights(self, version: int) -> None:
        """Load ``version``: in-flight requests finish under the old weights, or (partial rollout)
        are aborted now and continue under the new ones."""
        t0 = time.monotonic()
        self._gate.clear()
        try:
            if self.acfg.partial_rollout:
                await self.engine.abort()
            await self.engine.update_weights(self.weights.uri(version), version)
        finally:
            if not self._paused:
                self._gate.set()
        self.stats.weight_updates += 1
        self.stats.weight_update_seconds += time.monotonic() - t0

    def _take_recycled(self) -> None:
        """Prompts of groups the consumer rejected come back to the prompt supply, first in line."""
        reader = self._recycle.reader("producer")
        segments = reader.read()
        if not segments:
            return
        indices = []
        for segment in segments:
            seen = {}
            for s in segment.samples():
                seen.setdefault(s.group_index, s.prompt_index)
            indices += list(seen.values())
        self.prompts.push_back(indices)
        self.stats.groups_recycled_in += len(indices)
        reader.commit(segments[-1].offset)

    def _resume_partial_groups(self) -> None:
        """Unfinished groups saved by the previous producer are started before any new prompt."""
        from miles_core.types import regroup

        reader = self._partial.reader("producer")
        segments = reader.read()
        for segment in segments:
            for group in regroup(segment.samples()):
                by_index: list[Sample | None] = [None] * self.n
                for s in group.samples:
                    if s.sample_index < self.n:
                        by_index[s.sample_index] = s
                self._queue.append(_Work(_item_of(group.samples[0]), group.group_index, by_index))
                self.stats.groups_resumed_partial += 1
        if segments:
            reader.commit(segments[-1].offset)

    def _load_state(self) -> None:
        state = self.layout.read_json(STATE_FILE) or {}
        if "prompts" in state:
            self.prompts.load_state(state["prompts"])
        existing = self.stream.offsets()
        self._next_group = int(state.get("next_group_index", 0))
        if existing:  # groups written after the last state save must not reuse their indices
            last = self.stream.read_segment(existing[-1])
            self._next_group = max(self._next_group, int(max(last.table.column("group_index").to_pylist())) + 1)
            cursor = self.stream.reader(self.consumer).cursor
            for offset in existing:
                if offset > cursor:
                    segment = self.stream.read_segment(offset)
                    self._segment_groups[offset] = len(set(segment.table.column("group_index").to_pylist()))

    def _save_state(self, status: str, error: str | None = None) -> None:
        from dataclasses import asdict

        if self.scheduler is not None:
            self.stats.idle_seconds = self.scheduler.idle_seconds()
        self.layout.write_json(STATE_FILE, {
            "status": status,
            "error": error,
            "next_group_index": self._next_group,
            "prompts": self.prompts.state(),
            "stats": asdict(self.stats),
            "in_flight_samples": self.scheduler.in_flight if self.scheduler else 0,
            "outstanding_groups": self._outstanding(),
            "engine_version": self.engine.weight_version,
            "updated_at": time.time(),
        })

    async def _settle_on_stop(self) -> None:
        """Stop: abort what is in flight (saved as partial, or counted as abandoned)."""
        self._gate.set()  # let waiting samples see the stop
        if self._open is not None:  # sample granularity: a group whose samples are not all started
            work = self._open
            work.tasks += [self._spawn(self._unstarted(work, j)) for j in range(len(work.tasks), self.n)]
            self._spawn(self._finish_group(work))
            self._open = None
        await self.engine.abort()
        deadline = time.monotonic() + 30
        while self._works and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._raise_if_failed()
        if self._unfinished and self.acfg.partial_rollout:  # the next producer resumes them first
            await asyncio.to_thread(self._partial.append, sorted(self._unfinished, key=lambda g: g.group_index))
            self.stats.groups_saved_partial += len(self._unfinished)
        else:
            self.stats.groups_abandoned += len(self._unfinished)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


def _describe(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()
