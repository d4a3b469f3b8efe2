"""Fully-async rollout: the producer, the trainer's feed and the buffer, on a scripted engine.

The engine is a test double with latency and failures under test control (tests/doubles); the
prompt log, sample stream, cursors and weight store are the real ones on a local folder. The
producer claims its prompts from the run's prompt log and writes its own stream, as a fleet
member does; the feed reads that stream and gives rejected prompts back to the log."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

import pytest
import torch
from doubles.scripted_engine import ScriptedEngine
from waiting import wait_for

from miles_core.config import FullyAsyncMode, RunConfig
from miles_core.engines.base import SamplingParams
from miles_core.loop import LoopThread
from miles_core.rewards import score_groups
from miles_core.rollout.buffer import DefaultDataBuffer, make_buffer
from miles_core.rollout.consumer import GroupFeed
from miles_core.rollout.fleet import ControlPlane, Heartbeat, PromptLog, recycle_to, stream_name
from miles_core.rollout.generate import PromptItem
from miles_core.rollout.producer import RolloutProducer
from miles_core.rollout.sampler import Generation
from miles_core.rollout.worker import ClaimedPrompts, ProducerLink
from miles_core.storage import RunLayout, SampleStream, WeightStore
from miles_core.types import Group, Sample, SampleStatus

N = 2  # samples per prompt


def draw(cursor, n):
    """Prompt rows 0, 1, 2, ... (the cursor is the next row)."""
    start = cursor or 0
    return list(range(start, start + n)), start + n


class Prompts:
    """Renders claimed prompt rows (``ClaimedPrompts``' render); breaks at row ``fail_at``."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.served: list[int] = []
        self.fail_at = fail_at

    def render(self, rows: list[int]) -> list[PromptItem]:
        if self.fail_at in rows:
            raise RuntimeError(f"prompt source broke at {self.fail_at}")
        self.served += rows
        return [PromptItem(f"p{i}", [1 + i % 50, 2, 3], str(i), i, {"i": i}) for i in rows]


class CharTokenizer:
    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 50 for c in text]}


def _reward(sample: Sample) -> float:
    return float(len(sample.response_ids) % 2)


async def score(groups: list[Group]) -> None:
    await score_groups(_reward, groups)


class Harness:
    """A producer on its own event-loop thread, and the trainer's feed, over one run folder."""

    def __init__(self, tmp_path, engine: ScriptedEngine | None = None, prompts: Prompts | None = None,
                 max_new_tokens: int = 6, custom_generate=None, block: int = 64, **async_kw: Any) -> None:
        self.custom_generate = custom_generate
        self.block = block
        """Prompts per claim: one claim's group indices are consecutive (the next claim's start
        ``GROUP_STRIDE`` further on)."""
        async_kw.setdefault("weight_poll_s", 0.02)
        async_kw.setdefault("segment_max_wait_s", 0.05)
        async_kw.setdefault("segment_max_groups", 2)
        async_kw.setdefault("control_poll_s", 0.01)
        self.cfg = RunConfig(
            mode=FullyAsyncMode(**async_kw),
            rollout={"rollout_batch_size": 4, "n_samples_per_prompt": N},
        )
        self.layout = RunLayout(str(tmp_path / "runs"), "t", "r1")
        self.stream = SampleStream(self.layout.run_dir).sibling(stream_name("p0"))
        self.log = PromptLog(self.layout.run_dir, draw=draw)
        self.recycle_log = PromptLog(self.layout.run_dir)  # the trainer's: its own reader of the log
        self.control = ControlPlane(self.layout.run_dir)
        self.weights = WeightStore(self.layout.weights)
        self.loop = LoopThread("test-producer")
        self.engine = engine or ScriptedEngine()
        self.prompts = prompts or Prompts()
        self.sampling = SamplingParams(max_new_tokens=max_new_tokens, seed=7)
        self.producer = self.new_producer()
        self.future: concurrent.futures.Future | None = None
        self.feeds: list[GroupFeed] = []

    def new_producer(self, link: ProducerLink | None = None, supply: ClaimedPrompts | None = None,
                     **options: Any) -> RolloutProducer:
        supply = supply or self.supply()
        link = link or ProducerLink(self.control, Heartbeat("p0", "running"), heartbeat_s=0.02)
        return RolloutProducer(self.cfg, self.generation(), supply, self.stream, self.layout, self.weights,
                               link=link, **options)

    def generation(self) -> Generation:
        return Generation(self.engine, self.sampling, score, self.custom_generate, CharTokenizer())

    def supply(self, producer: str = "p0") -> ClaimedPrompts:
        return ClaimedPrompts(self.log, producer, self.prompts.render, self.block)

    def start(self) -> Harness:
        self.future = asyncio.run_coroutine_threadsafe(self.producer.run(), self.loop.loop)
        return self

    def check(self) -> None:
        if self.future is not None and self.future.done() and self.future.exception() is not None:
            raise self.future.exception()

    def feed(self, first_version: int = 0, read_ahead: bool = False) -> GroupFeed:
        buffer = DefaultDataBuffer(self.cfg.mode, capacity=64, first_version=first_version)
        feed = GroupFeed(SampleStream(self.layout.run_dir), buffer, self.cfg.mode, lambda: [(self.stream, None)],
                         lambda groups: recycle_to(self.recycle_log, groups), producer_check=self.check,
                         read_ahead=read_ahead)
        self.feeds.append(feed)
        return feed

    def stop(self, timeout: float = 20):
        self.producer.link.cancel.set()  # as a fleet member's process does when it is interrupted
        stats = self.future.result(timeout)
        return stats

    def publish(self, version: int) -> None:
        self.weights.publish(version, {"w": torch.full((2,), float(version))})

    def wait_until(self, predicate, timeout: float = 10.0) -> None:
        def reached():
            self.check()
            return predicate()

        wait_for(reached, timeout, "the condition", poll=0.01)

    def held_again(self) -> None:
        """Wait until the producer has found itself at its bound once more: it looked at the
        consumer's cursor and had no room (what it has started then is all it may start)."""
        before = self.producer.stats.backpressure_seconds
        self.wait_until(lambda: self.producer.stats.backpressure_seconds > before)

    def close(self) -> None:
        for feed in self.feeds:
            feed.close()
        if self.future is not None and not self.future.done():
            self.producer.link.cancel.set()
            try:
                self.future.result(10)
            except Exception:
                pass
        self.loop.close()


@pytest.fixture
def harness(tmp_path):
    made: list[Harness] = []

    def make(**kw: Any) -> Harness:
        h = Harness(tmp_path, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


# ------------------------------------------------------------------------------------ drain


def test_trainer_drains_sorted_groups_with_rewards_and_versions(harness):
    h = harness().start()
    feed = h.feed()
    batch = feed.next_batch(4, trainer_version=0)
    assert [g.group_index for g in batch.groups] == sorted(g.group_index for g in batch.groups)
    assert len(batch.groups) == 4 and all(len(g.samples) == N for g in batch.groups)
    for g in batch.groups:
        assert [s.sample_index for s in g.samples] == list(range(N))
        for s in g.samples:
            assert s.reward is not None and s.status is SampleStatus.COMPLETED
            assert s.submit_version == 0 and s.span_versions == [0] and s.span_starts == [0]
            assert len(s.rollout_logprobs) == len(s.response_ids) > 0
    h.stop()
    feed_cursor = h.stream.reader("trainer").cursor
    assert feed_cursor == -1, "nothing is committed before the trainer says the batch is trained"


def test_commit_moves_the_cursor_past_fully_used_segments(harness):
    h = harness(segment_max_groups=2).start()
    feed = h.feed()
    batch = feed.next_batch(3, trainer_version=0)
    feed.commit()
    h.stop()
    segments = {seg.offset: {s.group_index for s in seg.samples()} for seg in h.stream.read()}
    used = {g.group_index for g in batch.groups}
    whole = [o for o, gs in sorted(segments.items()) if gs <= used]
    assert h.stream.reader("trainer").cursor == whole[-1]


@pytest.mark.parametrize("read_ahead", [False, True])
def test_second_batch_continues_without_repeats(harness, read_ahead):
    h = harness().start()
    feed = h.feed(read_ahead=read_ahead)
    first = feed.next_batch(4, 0)
    feed.commit()
    second = feed.next_batch(4, 0)
    seen = [g.group_index for g in first.groups + second.groups]
    assert len(set(seen)) == 8


# ------------------------------------------------------------------------------- scheduling


@pytest.mark.parametrize("granularity,limit,expected_peak", [("sample", 5, 5), ("group", 5, 4)])
def test_in_flight_bound_is_never_exceeded(harness, granularity, limit, expected_peak):
    engine = ScriptedEngine(token_latency=0.02)  # long enough that the groups overlap on a busy machine
    h = harness(engine=engine, max_concurrent_samples=limit, submit_granularity=granularity,
                buffer_capacity_factor=8).start()
    h.feed().next_batch(12, 0)
    stats = h.stop()
    assert engine.peak_running <= limit
    assert stats.peak_in_flight <= limit
    # whole groups of 2 fit twice into 5 slots; single samples fill all 5
    assert engine.peak_running == expected_peak


def test_sample_granularity_backfills_a_slot_as_soon_as_a_sample_finishes(harness):
    # sample 0 of every group is long, sample 1 short: with backfill, short samples of later groups
    # run while the long ones of earlier groups are still going
    engine = ScriptedEngine(token_latency=0.002, script=lambda req: [1] * (12 if req.rid.endswith("s0") else 1))
    h = harness(engine=engine, max_concurrent_samples=2, submit_granularity="sample", buffer_capacity_factor=8,
                max_new_tokens=16).start()
    h.feed().next_batch(3, 0)
    h.stop()
    order = [r.rid for r in engine.requests]
    # after g0-s0 (long) and g0-s1 (short) start, the freed slot goes to g1-s0 before g0-s0 ends
    assert order[:3] == ["g0-s0", "g0-s1", "g1-s0"]


def test_back_pressure_holds_the_producer_at_capacity(harness):
    # capacity = 1.0 * rollout_batch_size = 4 groups ahead of the trainer
    h = harness(buffer_capacity_factor=1.0).start()
    stats = h.producer.stats
    h.held_again()  # a consumer that reads nothing
    assert stats.groups_started == 4
    feed = h.feed()
    feed.next_batch(4, 0)
    h.held_again()
    assert stats.groups_started == 4, "groups handed to the trainer count until it commits"
    feed.commit()  # trained: the producer goes on
    h.wait_until(lambda: stats.groups_started >= 8)
    h.held_again()
    assert stats.groups_started == 8
    h.stop()


# ------------------------------------------------------------------------------- staleness


def _stale_setup(harness, handler: str):
    # claims of 4: a recycled prompt is claimed again as soon as the producer needs more
    h = harness(max_weight_staleness=1, unused_samples_handler=handler, buffer_capacity_factor=2, block=4).start()
    feed = h.feed()
    h.wait_until(lambda: h.producer.stats.groups_written >= 4)
    return h, feed


def test_stale_groups_are_dropped_and_counted(harness):
    h, feed = _stale_setup(harness, "drop")
    # the trainer is at version 3; everything so far was generated at version 0 (lag 3 > 1)
    h.publish(3)
    batch = feed.next_batch(4, trainer_version=3)
    assert batch.metrics["async/rejected_stale"] >= 4
    assert feed.totals["dropped"] == feed.totals["stale"] >= 4
    assert all(min(s.span_versions) >= 2 for g in batch.groups for s in g.samples)
    assert batch.metrics["async/staleness_max"] <= 1
    assert batch.metrics["async/rejected_response_len_mean"] > 0  # length distribution of the rejected
    assert feed.totals["recycled"] == 0 and not [c for c in h.log.entries() if c.kind == "release"], \
        "dropped: no prompt goes back to the log"
    h.stop()


def test_stale_groups_are_recycled_to_the_producer(harness):
    h, feed = _stale_setup(harness, "retry")
    h.publish(3)
    first = feed.next_batch(4, trainer_version=3)
    feed.commit()
    rejected_prompts = {r.group.samples[0].prompt_index for r in first.rejected}
    assert rejected_prompts and feed.totals["recycled"] == len(first.rejected)
    h.wait_until(lambda: any(h.prompts.served.count(p) > 1 for p in rejected_prompts))  # claimed again
    more = feed.next_batch(8, trainer_version=3)
    regenerated = {g.samples[0].prompt_index for g in first.groups + more.groups}
    assert rejected_prompts & regenerated, "recycled prompts come back, generated again"
    h.stop()


def test_nothing_is_stale_before_the_trainers_first_update(harness):
    h = harness(max_weight_staleness=0).start()
    # a resumed run: the trainer starts at version 5, the engine still at 0 -> lag 5, but no update yet
    feed = h.feed(first_version=5)
    batch = feed.next_batch(4, trainer_version=5)
    assert len(batch.groups) == 4 and not batch.rejected
    rejected = feed.buffer.take(10, trainer_version=6).rejected  # after the first update: stale
    assert all(r.reason == "stale" for r in rejected)
    h.stop()


def test_aborted_groups_are_rejected(harness):
    buffer = DefaultDataBuffer(FullyAsyncMode(), capacity=8)
    ok = Group([Sample("p", [1], [2], span_versions=[0])])
    aborted = Group([Sample("p", [1], [2], status=SampleStatus.ABORTED, group_index=1)])
    buffer.put([aborted, ok])
    taken = buffer.take(2, trainer_version=0)
    assert taken.groups == [ok]
    assert [(r.reason, r.group.group_index) for r in taken.rejected] == [("aborted", 1)]


# ---------------------------------------------------------------------------------- weights


def test_new_weights_reach_the_engine_and_in_flight_finish_under_the_old(harness):
    engine = ScriptedEngine(token_latency=0.01)
    h = harness(engine=engine, max_new_tokens=8).start()
    h.wait_until(lambda: engine.requests)
    h.publish(1)
    h.wait_until(lambda: engine.weight_version == 1)
    feed = h.feed()
    groups = feed.next_batch(8, trainer_version=1).groups
    feed.commit()
    groups += feed.next_batch(8, trainer_version=1).groups
    stats = h.stop()
    assert stats.weight_updates == 1 and engine.loads[-1][1] == 1
    versions = {(s.submit_version, tuple(s.span_versions)) for g in groups for s in g.samples}
    assert (0, (0,)) in versions, "requests in flight at the update finish under v0 and say so"
    assert (1, (1,)) in versions
    assert all(len(s.span_versions) == 1 for g in groups for s in g.samples)


class HeldLoadEngine(ScriptedEngine):
    """``update_weights`` waits until the test lets it go (a real model's load behind long generations)."""

    def __init__(self) -> None:
        super().__init__()
        self.loading, self.release = threading.Event(), threading.Event()

    async def update_weights(self, uri: str, version: int) -> None:
        self.loading.set()
        await asyncio.to_thread(self.release.wait, 30)
        await super().update_weights(uri, version)


class CountingLink(ProducerLink):
    """Sets ``beat_while_held`` once the producer has beaten twice while ``held()`` was true."""

    def __init__(self, held, run_dir: str) -> None:
        super().__init__(ControlPlane(run_dir), Heartbeat("p0", "running"), heartbeat_s=0.001)
        self.held, self.beats_while_held, self.beat_while_held = held, 0, threading.Event()

    def beat(self, **fields: Any) -> None:
        super().beat(**fields)
        if self.held():
            self.beats_while_held += 1
            if self.beats_while_held >= 2:
                self.beat_while_held.set()


def test_a_producer_keeps_beating_while_its_engine_loads_weights(harness):
    """A load that outlasts the heartbeat timeout (SmolLM2 behind 256-token generations on a busy core
    took over 10 s) must not make the trainer declare a live producer dead: the load runs beside the
    loop, which keeps beating, and nothing new is submitted until it is done."""
    engine = HeldLoadEngine()
    h = harness(engine=engine, control_poll_s=0.001)
    link = CountingLink(lambda: engine.loading.is_set() and not engine.release.is_set(), h.layout.run_dir)
    h.producer = h.new_producer(link)
    h.start()
    h.wait_until(lambda: engine.requests)
    h.publish(1)
    assert engine.loading.wait(10), "the producer never loaded v1"
    submitted = len(engine.requests)
    assert link.beat_while_held.wait(10), f"{link.beats_while_held} heartbeats while the engine loaded"
    assert len(engine.requests) == submitted, "no request is submitted while the weights load"
    engine.release.set()
    h.wait_until(lambda: engine.weight_version == 1)  # (no more requests need follow: no feed consumes here)
    stats = h.stop()
    assert stats.weight_updates == 1


class HeldGenerationEngine(ScriptedEngine):
    """Its generations wait until the test lets them go (long answers in flight when a pause comes)."""

    def __init__(self) -> None:
        super().__init__()
        self.generating, self.released = threading.Event(), threading.Event()
        self.calls = self.returned = 0
        self._go: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def generate(self, requests):
        self.calls += 1
        if self._go is None:
            self._go, self._loop = asyncio.Event(), asyncio.get_running_loop()
        self.generating.set()
        await self._go.wait()
        try:
            return await super().generate(requests)
        finally:
            self.returned += 1

    def let_go(self) -> None:
        self.released.set()
        self._loop.call_soon_threadsafe(self._go.set)


class NoticingLink(CountingLink):
    """Counts heartbeats only after a poll that told the producer of a pause."""

    def __init__(self, held, run_dir: str) -> None:
        self.noticed = False
        super().__init__(lambda: self.noticed and held(), run_dir)

    def poll(self, producer, beat_now: bool = False):
        signal = super().poll(producer, beat_now)
        self.noticed = self.noticed or bool(signal.pause_holders)
        return signal


def test_a_producer_keeps_beating_while_a_pause_waits_for_its_generations(harness):
    """A pause (an evaluation borrowing the engine) waits for the generations in flight; on a real
    model they can outlast the heartbeat timeout, so the drain runs beside the loop, which keeps
    beating. The producer says it is paused only once nothing of it is in the engine, and starts
    nothing until the holder lets go."""
    engine = HeldGenerationEngine()
    h = harness(engine=engine, control_poll_s=0.001)
    link = NoticingLink(lambda: not engine.released.is_set(), h.layout.run_dir)
    h.producer = h.new_producer(link)
    h.start()
    assert engine.generating.wait(10), "no generation started"
    link.control.pause("eval-step-1")
    assert link.beat_while_held.wait(10), f"{link.beats_while_held} heartbeats while the pause drained"
    assert link.control.heartbeat("p0").paused_for == [], "not paused while generations are in the engine"
    engine.let_go()
    h.wait_until(lambda: link.control.heartbeat("p0").paused_for == ["eval-step-1"])
    assert engine.calls == engine.returned, "paused with nothing in the engine"
    calls_when_paused = engine.calls
    link.control.unpause("eval-step-1")
    h.wait_until(lambda: engine.calls > calls_when_paused)  # generating again
    stats = h.stop()
    assert stats.samples_finished > 0


def test_partial_rollout_continues_under_new_weights_with_stamped_spans(harness):
    engine = ScriptedEngine(token_latency=0.02, script=lambda req: [1] * (10 - (len(req.prompt_ids) - 3)))
    h = harness(engine=engine, max_new_tokens=10, partial_rollout=True).start()
    h.wait_until(lambda: len(engine.requests) >= 2 and engine.tokens_out >= 6)  # a few tokens into the first requests
    h.publish(1)
    batch = h.feed().next_batch(4, trainer_version=1)
    h.stop()
    spanned = [s for g in batch.groups for s in g.samples if len(s.span_versions) == 2]
    assert spanned, "requests in flight at the update were continued"
    for s in spanned:
        assert s.span_versions == [0, 1] and s.submit_version == 0
        assert 0 < s.span_starts[1] < len(s.response_ids) == 10  # the whole response, over two spans
        assert len(s.rollout_logprobs) == 10
        assert s.status is SampleStatus.TRUNCATED


def test_pause_holds_generation_and_resume_continues(harness):
    engine = ScriptedEngine(token_latency=0.002)
    h = harness(engine=engine, buffer_capacity_factor=100).start()
    h.wait_until(lambda: len(engine.requests) > 4)
    h.control.pause("eval-step-1")  # an evaluation borrows the engine, through the run folder
    h.wait_until(lambda: h.control.heartbeat("p0").paused_for == ["eval-step-1"])
    assert engine._running == 0
    count, beat = len(engine.requests), h.control.heartbeat("p0").beat
    h.wait_until(lambda: h.control.heartbeat("p0").beat >= beat + 3)  # it goes on beating, paused
    assert len(engine.requests) == count
    h.control.unpause("eval-step-1")
    h.wait_until(lambda: len(engine.requests) > count)
    h.stop()


# ----------------------------------------------------------------------------------- errors


def test_generation_errors_are_retried_then_counted(harness):
    attempts: dict[str, int] = {}

    def fail(req):
        attempts[req.rid] = attempts.get(req.rid, 0) + 1
        if req.rid == "g0-s0" and attempts[req.rid] <= 2:
            return ConnectionError("engine hiccup")  # recovers on the third try
        if req.rid == "g1-s1":
            return ConnectionError("engine down for this one")
        return None

    h = harness(engine=ScriptedEngine(fail=fail), generation_retries=2).start()
    written = lambda: {s.group_index for seg in h.stream.read() for s in seg.samples()}  # noqa: E731
    h.wait_until(lambda: {0, 1} <= written())
    stats = h.stop()
    by_rid = {f"g{s.group_index}-s{s.sample_index}": s for seg in h.stream.read() for s in seg.samples()}
    assert by_rid["g0-s0"].status is SampleStatus.COMPLETED
    failed = by_rid["g1-s1"]
    assert failed.status is SampleStatus.FAILED and "3 times" in failed.error and "engine down" in failed.error
    assert attempts["g1-s1"] == 3
    assert stats.samples_failed == 1 and stats.generation_errors == 2 + 3


def test_an_engine_that_does_not_answer_stops_the_producer_naming_it(harness):
    """A request's retries all unanswered is the engine's fault, not the sample's: the producer
    stops with that error (a fleet replaces it) instead of writing failed samples forever."""
    from miles_core.engines.http import EngineUnreachable

    h = harness(engine=ScriptedEngine(fail=lambda req: EngineUnreachable("http://e:1/generate: no answer")),
                generation_retries=1).start()
    feed = h.feed()
    with pytest.raises(EngineUnreachable, match=r"its engine did not answer request g\d+-s\d+ 2 times; last: "
                                                r"http://e:1/generate: no answer"):
        feed.next_batch(4, 0)
    assert h.layout.read_json("state/producer.json")["status"] == "failed"


def test_producer_death_reaches_the_trainer_with_its_own_exception(harness):
    h = harness(prompts=Prompts(fail_at=5)).start()
    feed = h.feed()
    with pytest.raises(RuntimeError, match="prompt source broke at 5"):
        for _ in range(5):
            feed.next_batch(4, 0)
    state = h.layout.read_json("state/producer.json")
    assert state["status"] == "failed" and "prompt source broke" in state["error"]


def test_a_producer_found_dead_is_dealt_with_while_the_others_keep_the_trainer_fed(harness):
    h = harness().start()
    h.wait_until(lambda: sum(len(seg.samples()) for seg in h.stream.read()) >= 4 * h.cfg.rollout.n_samples_per_prompt)
    h.stop()  # four groups are on disk: the feed never has to wait for them
    dead = RuntimeError("producer p1 was killed by signal SIGKILL")

    def check():
        raise dead

    feed = h.feed()
    feed.producer_check = check
    with pytest.raises(RuntimeError) as raised:
        feed.next_batch(4, 0)
    assert raised.value is dead


def test_trainer_warns_while_it_waits(harness):
    engine = ScriptedEngine(token_latency=0.05)
    h = harness(engine=engine, no_progress_s=0.1, max_new_tokens=6).start()
    warnings: list[str] = []
    feed = h.feed()
    feed.warn = warnings.append
    batch = feed.next_batch(2, 0)
    assert warnings and "waited" in warnings[0]
    assert batch.wait_seconds > 0.1
    h.stop()


# ------------------------------------------------------------------------------------- stop


def test_clean_stop_leaves_whole_segments_and_counts_abandoned(harness):
    engine = ScriptedEngine(token_latency=0.02)
    h = harness(engine=engine, max_new_tokens=8, buffer_capacity_factor=100).start()
    h.wait_until(lambda: h.producer.stats.groups_written >= 2)
    stats = h.stop()
    assert stats.groups_abandoned > 0, "groups in flight at stop are counted, not silently lost"
    groups = [s.group_index for seg in h.stream.read() for s in seg.samples()]
    assert len(groups) == stats.groups_written * N
    state = h.layout.read_json("state/producer.json")
    assert state["status"] == "stopped" and state["stats"]["groups_abandoned"] == stats.groups_abandoned


def test_partial_trajectories_survive_the_producer(harness):
    engine = ScriptedEngine(token_latency=0.02)
    h = harness(engine=engine, max_new_tokens=8, partial_rollout=True, buffer_capacity_factor=100).start()
    h.wait_until(lambda: engine.tokens_out >= 4)
    stats = h.stop()
    assert stats.groups_saved_partial > 0 and stats.groups_abandoned == 0
    saved = [s for seg in h.stream.sibling("partial").read() for s in seg.samples()]
    assert any(s.status is SampleStatus.ABORTED and s.response_ids for s in saved), [(s.group_index, s.status, len(s.response_ids)) for s in saved]

    # the next producer resumes them first and finishes them
    h.producer = h.new_producer()
    h.start()
    h.wait_until(lambda: h.producer.stats.groups_written >= stats.groups_saved_partial)
    second = h.stop()
    assert second.groups_resumed_partial == stats.groups_saved_partial
    finished = {s.group_index: s for seg in h.stream.read() for s in seg.samples()}
    resumed = {s.group_index for s in saved}
    assert resumed <= set(finished)
    assert all(finished[g].status is not SampleStatus.ABORTED for g in resumed)


class AdoptingPrompts(ClaimedPrompts):
    """Claimed prompts of a producer that took over partial groups another one saved (``adopted``;
    the prompt log's adopt entries say the same)."""

    def __init__(self, h: Harness, source: str, groups: set[int]) -> None:
        super().__init__(h.log, "p1", h.prompts.render, h.block)
        self.source, self.groups = source, groups

    def adopted(self) -> list[tuple[str, set[int]]]:
        return [(self.source, self.groups)]


def test_a_producer_continues_the_partial_groups_it_adopted(harness):
    """Producer "p0" of an earlier start saved partial groups in its own partial stream; a producer
    of the next start adopted them (the prompt log says which): it continues and finishes each,
    under its group index, before any new prompt; groups of that stream it did not adopt stay."""
    from miles_core.types import regroup

    engine = ScriptedEngine(token_latency=0.02)
    h = harness(engine=engine, max_new_tokens=8, partial_rollout=True, buffer_capacity_factor=100).start()
    h.wait_until(lambda: engine.tokens_out >= 4)
    stats = h.stop()
    saved = [g for seg in h.stream.sibling("partial").read() for g in regroup(seg.samples())]
    assert len(saved) == stats.groups_saved_partial > 0
    h.stream.sibling("partial-p0").append([s for g in saved for s in g.samples])  # as p0 would have
    adopted = {g.group_index for g in saved[1:]} if len(saved) > 1 else {saved[0].group_index}
    h.producer = h.new_producer(supply=AdoptingPrompts(h, "p0", adopted), partial_stream="partial-p1")
    h.start()
    h.wait_until(lambda: h.producer.stats.groups_written >= len(adopted))
    second = h.stop()
    assert second.groups_resumed_partial == len(adopted)
    finished = {s.group_index: s for seg in h.stream.read() for s in seg.samples()}
    assert adopted <= set(finished) and all(finished[g].status is not SampleStatus.ABORTED for g in adopted)
    done = {(s.group_index, s.sample_index): s for seg in h.stream.read() for s in seg.samples()}
    kept = [(g.group_index, s) for g in saved if g.group_index in adopted for s in g.samples if s.response_ids]
    assert kept, "some adopted sample had tokens already"
    for gi, s in kept:  # continued, not started again: the saved tokens begin the finished response
        assert done[(gi, s.sample_index)].response_ids[: len(s.response_ids)] == s.response_ids


def test_restarted_producer_continues_group_indices_and_prompts(harness):
    h = harness(buffer_capacity_factor=100).start()
    h.wait_until(lambda: h.producer.stats.groups_written >= 4)
    h.stop()
    written = {s.group_index for seg in h.stream.read() for s in seg.samples()}
    h.producer = h.new_producer()
    h.start()
    h.wait_until(lambda: h.producer.stats.groups_written >= 2)
    h.stop()
    later = [s.group_index for seg in h.stream.read() for s in seg.samples() if s.group_index not in written]
    assert later and min(later) > max(written)


# ---------------------------------------------------------------------------------- filters


def test_dynamic_filters_drop_and_count(harness):
    # every sample has 4 tokens: all rewards equal (0), so nonzero_reward_std drops every group
    h = harness(dynamic_filters=["nonzero_reward_std"]).start()
    h.wait_until(lambda: h.producer.stats.groups_finished >= 4)
    stats = h.stop()
    assert stats.groups_written == 0
    assert stats.groups_filtered["nonzero_reward_std"] == stats.groups_finished


def test_unknown_filter_and_custom_buffer_errors_are_clear():
    from miles_core.rollout.filters import GroupFilters

    with pytest.raises(ValueError, match="unknown dynamic filter 'nope'"):
        GroupFilters(["nope"])
    with pytest.raises(ValueError, match="custom data buffer 'no_such_mod:Buf'"):
        make_buffer(FullyAsyncMode(), 4, path="no_such_mod:Buf")


def test_custom_data_buffer_is_used(harness):
    buffer = make_buffer(FullyAsyncMode(), 4, path=f"{__name__}:LifoBuffer")
    assert isinstance(buffer, LifoBuffer)


class LifoBuffer:
    """A custom buffer: newest groups first."""

    def __init__(self, cfg: FullyAsyncMode, capacity: int) -> None:
        self.capacity = capacity
        self.groups: list[Group] = []

    def put(self, groups):
        self.groups += groups

    def take(self, n, trainer_version):
        from miles_core.rollout.buffer import Taken

        taken, self.groups = self.groups[-n:], self.groups[:-n]
        return Taken(taken[::-1], [])

    def __len__(self):
        return len(self.groups)




# ---------------------------------------------------------------------------- extension points


def test_custom_generate_function_makes_multi_turn_samples(harness):
    from examples.multi_turn import generate

    engine = ScriptedEngine(script=lambda req: [1] * 20)  # never stops by itself: turn 1 hits its budget
    h = harness(engine=engine, custom_generate=generate, max_new_tokens=8).start()
    batch = h.feed().next_batch(2, 0)
    h.stop()
    for s in (s for g in batch.groups for s in g.samples):
        # turn 1: 4 policy tokens; tool "=": 1 token (masked); turn 2: the remaining 3
        assert s.loss_mask == [1, 1, 1, 1, 0, 1, 1, 1]
        assert s.span_starts == [0, 5] and s.span_versions == [0, 0]
        assert len(s.rollout_logprobs) == 8 and s.rollout_logprobs[4] == 0.0
        assert s.status is SampleStatus.TRUNCATED and s.reward is not None
    assert len(engine.requests) >= 2 * len(batch.groups) * N, "two engine calls per sample"


def test_custom_generate_errors_are_retried_then_counted(harness):
    async def broken(ctx, item):
        raise ValueError("tool server unreachable")

    h = harness(custom_generate=broken, generation_retries=1).start()
    h.wait_until(lambda: h.producer.stats.groups_written >= 1)
    stats = h.stop()
    sample = h.stream.read()[0].samples()[0]
    assert sample.status is SampleStatus.FAILED and "tool server unreachable" in sample.error
    assert stats.samples_failed >= N and stats.generation_errors >= 2 * N


def test_custom_generate_is_used_by_generate_groups():
    from examples.multi_turn import generate

    from miles_core.rollout.generate import generate_groups

    engine = ScriptedEngine(script=lambda req: [1] * 20)
    items = [PromptItem("p", [1, 2], None, 0, {})]
    groups = asyncio.run(generate_groups(engine, items, 3, SamplingParams(max_new_tokens=6), 10, seed=1,
                                         custom=generate, tokenizer=CharTokenizer()))
    assert [s.group_index for s in groups[0].samples] == [10, 10, 10]
    assert [s.sample_index for s in groups[0].samples] == [0, 1, 2]
    assert groups[0].samples[0].loss_mask == [1, 1, 1, 0, 1, 1]


def test_custom_rollout_function_example_keeps_the_informative_groups():
    from miles_core.rollout.custom import RolloutContext, run_rollout_function

    # responses of 1..4 tokens: reward len % 2 varies within a group only if lengths differ
    engine = ScriptedEngine(script=lambda req: [1] * (1 + (req.sampling.seed or 0) % (4 if req.prompt_ids[0] % 2 else 1)))
    drawn: list[int] = []

    def next_prompts(n):
        items = [PromptItem(f"p{i}", [1 + i, 2], None, i, {}) for i in range(len(drawn), len(drawn) + n)]
        drawn.extend(range(len(drawn), len(drawn) + n))
        return items

    cfg = RunConfig(rollout={"rollout_batch_size": 3, "n_samples_per_prompt": 4})
    ctx = RolloutContext(cfg, engine, CharTokenizer(), next_prompts, SamplingParams(max_new_tokens=8), score)
    groups = asyncio.run(run_rollout_function("examples.custom_rollout:rollout", ctx, step=2))
    assert len(drawn) == 6 and len(groups) == 3  # drew twice the batch, kept the batch
    assert all(len({s.reward for s in g.samples}) > 1 for g in groups), "the informative groups are kept"
    assert {g.group_index for g in groups} <= set(range(12, 18))


def test_custom_rollout_function_results_are_checked():
    from miles_core.rollout.custom import RolloutContext, run_rollout_function

    ctx = RolloutContext(RunConfig(), ScriptedEngine(), None, lambda n: [], SamplingParams(), score)
    with pytest.raises(TypeError, match="must return a non-empty list of Group"):
        asyncio.run(run_rollout_function(f"{__name__}:returns_dicts", ctx, 0))
    with pytest.raises(ValueError, match="1 samples have no reward.*ctx.score"):
        asyncio.run(run_rollout_function(f"{__name__}:unscored", ctx, 0))


def returns_dicts(ctx, step):
    return [{"prompt": "x"}]


async def unscored(ctx, step):
    return [Group([Sample("p", [1], [2])])]
