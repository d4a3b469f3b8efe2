"""Multi-LoRA on one rollout stream: producer routes, per-reader cursors, views and version stamps.

One producer generates for several adapters (``PolicyRoute``s over ``AdapterPolicy`` views of one
engine); each adapter's trainer reads the stream with its own cursor and view. The engine is the
scripted double and the stream the real one on a local folder, as in test_async_rollout.py (whose
harness this reuses); the last test swaps adapters in the real transformers engine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

import pytest
import torch
from doubles.scripted_engine import ScriptedEngine
from test_async_rollout import Harness

from miles_core.config import FullyAsyncMode
from miles_core.engines.base import GenerateRequest
from miles_core.engines.policy import AdapterPolicy
from miles_core.rollout.buffer import DefaultDataBuffer, group_lag
from miles_core.rollout.consumer import GroupFeed, adapter_view, shared_view
from miles_core.rollout.fleet import Heartbeat
from miles_core.rollout.producer import PolicyRoute, RolloutProducer
from miles_core.rollout.worker import ProducerLink
from miles_core.storage import RunLayout, SampleStream
from miles_core.types import Group, Sample, regroup


class MultiHarness(Harness):
    """The async harness with the multi-LoRA producer options (routes, no weight polling, ...)."""

    def __init__(self, tmp_path, engine: ScriptedEngine, producer_kw: dict[str, Any], **kw: Any) -> None:
        self.producer_kw = producer_kw
        super().__init__(tmp_path, engine=engine, **kw)

    def new_producer(self) -> RolloutProducer:
        # weights=None: no weight polling, the adapters are pushed to the engine by the test
        return RolloutProducer(self.cfg, self.generation(), self.supply(), self.stream, self.layout, None,
                               link=ProducerLink(self.control, Heartbeat("p0", "running"), heartbeat_s=0.02),
                               **self.producer_kw)

    def reader_feed(self, reader: str, view=None, read_ahead: bool = False) -> GroupFeed:
        buffer = DefaultDataBuffer(self.cfg.mode, capacity=64)
        feed = GroupFeed(self.stream, buffer, self.cfg.mode, lambda: [(self.stream, None)], reader=reader,
                         producer_check=self.check, read_ahead=read_ahead, view=view)
        self.feeds.append(feed)
        return feed

    def slowest(self, readers: set[str]) -> int:
        """Back-pressure of a multi-LoRA run: the lowest cursor among the readers still alive."""
        return min(self.stream.reader(r).cursor for r in readers)

    def raw_groups(self) -> dict[int, Group]:
        """The groups as written (no view)."""
        return {g.group_index: g for seg in self.stream.read() for g in regroup(seg.samples())}


@pytest.fixture
def multi(tmp_path):
    made: list[MultiHarness] = []

    def make(engine: ScriptedEngine, custom_generate=None, segment_max_groups: int = 1, **producer_kw: Any):
        """A harness whose producer gets ``producer_kw``; one group per segment unless told (cursors
        then count groups); staleness limit 2 (used once the trainer version passes 0)."""
        h = MultiHarness(tmp_path / f"h{len(made)}", engine, producer_kw, custom_generate=custom_generate,
                         segment_max_groups=segment_max_groups, max_weight_staleness=2)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def two_adapters(h: MultiHarness, a: AdapterPolicy, b: AdapterPolicy, va: int, vb: int) -> None:
    """Push versions of adapters a and b (on the producer's loop, where the engine's events live)."""
    h.loop.run(a.update_weights(f"weights/a/v{va}", va))
    h.loop.run(b.update_weights(f"weights/b/v{vb}", vb))


def _adapter_of(group_index: int) -> str:
    return "ab"[group_index % 2]


# ------------------------------------------------------------------------------------ routes


def test_groups_alternate_between_routes_and_carry_their_adapters_versions(multi):
    engine = ScriptedEngine()
    pa, pb = AdapterPolicy(engine, "a"), AdapterPolicy(engine, "b")
    h = multi(engine, routes=[PolicyRoute("a", pa), PolicyRoute("b", pb)], segment_max_groups=2)
    two_adapters(h, pa, pb, 3, 5)
    h.publish(7)  # weights=None: nobody polls the weight store, the base stays as it is
    h.start()
    batch = h.reader_feed("trainer").next_batch(6, trainer_version=0)
    h.stop()
    assert {g.group_index for g in batch.groups} == set(range(6))
    for g in batch.groups:
        name = _adapter_of(g.group_index)  # a, b, a, b, ... by group index
        version = {"a": 3, "b": 5}[name]
        for s in g.samples:
            assert s.adapter == name
            assert s.submit_version == version and s.span_versions == [version]
            assert "adapter_versions" not in s.metadata  # no version_stamp given
    for req in engine.requests:  # rid g<group>-s<sample>: every request went to its group's adapter
        assert req.adapter == _adapter_of(int(req.rid[1:].split("-")[0])), req.rid
    assert {r.adapter for r in engine.requests} == {"a", "b"}
    assert engine.loads == [] and engine.weight_version == 0
    assert h.layout.read_json("state/producer.json")["engine_version"] == {"a": 3, "b": 5}


def test_custom_generate_gets_its_routes_engine_and_samples_get_the_version_stamp(multi):
    seen: list[tuple[int, str]] = []

    async def generate(ctx, item):
        (r,) = await ctx.engine.generate([GenerateRequest(list(item.prompt_ids), ctx.sampling, rid="x")])
        seen.append((ctx.group_index, ctx.engine.adapter))
        s = ctx.new_sample(item)
        s.response_ids, s.loss_mask, s.rollout_logprobs = r.output_ids, [1] * len(r.output_ids), r.logprobs
        s.span_starts, s.span_versions = [0], [r.weight_version]
        return s

    engine = ScriptedEngine()
    pa, pb = AdapterPolicy(engine, "a"), AdapterPolicy(engine, "b")
    h = multi(engine, custom_generate=generate, routes=[PolicyRoute("a", pa), PolicyRoute("b", pb)],
              version_stamp=lambda: {"a": pa.weight_version, "b": pb.weight_version})
    two_adapters(h, pa, pb, 2, 9)
    h.start()
    batch = h.reader_feed("trainer").next_batch(4, trainer_version=0)
    h.stop()
    assert seen and all(adapter == _adapter_of(g) for g, adapter in seen)
    for s in (s for g in batch.groups for s in g.samples):
        assert s.adapter == _adapter_of(s.group_index)
        assert s.span_versions == [{"a": 2, "b": 9}[s.adapter]] == [s.submit_version]
        assert s.metadata["adapter_versions"] == {"a": 2, "b": 9}


# ------------------------------------------------------------------------------------ cursors


def test_each_reader_has_its_own_cursor_and_the_slowest_live_one_holds_the_producer(multi):
    live = {"adapter-fast", "adapter-slow"}
    # one group per segment, so cursors count groups; capacity: 4 groups ahead of the slowest reader
    # the producer's thread reads a copy (made under the GIL): the test discards from ``live`` meanwhile
    h = multi(ScriptedEngine(), capacity=4, consumer=lambda: h.slowest(set(live)))
    h.start()
    h.wait_until(lambda: h.producer.stats.groups_written == 4)
    fast, slow = h.reader_feed("adapter-fast"), h.reader_feed("adapter-slow")
    first = fast.next_batch(4, 0)
    fast.commit()
    h.held_again()
    assert sorted(g.group_index for g in first.groups) == [0, 1, 2, 3]
    assert h.producer.stats.groups_started == 4, "the slow reader (cursor -1) holds the producer"

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        blocked = pool.submit(fast.next_batch, 2, 0)
        h.held_again()
        assert not blocked.done(), "the fast reader is capacity (4) groups ahead of the slow one: it waits"
        slow.next_batch(2, 0)
        slow.commit()  # slow cursor 1: room for 2 more groups
        second = blocked.result(timeout=10)
    fast.commit()
    assert sorted(g.group_index for g in second.groups) == [4, 5]
    h.wait_until(lambda: h.producer.stats.groups_started >= 6)  # room for 2 more, on a loaded machine too
    assert h.producer.stats.groups_started == 6, "no more than the slow reader's room"
    assert h.stream.reader("adapter-slow").cursor == 1 and h.stream.reader("adapter-fast").cursor == 5

    live.discard("adapter-slow")  # its trainer failed: it no longer holds anyone back
    third = []
    for _ in range(5):  # handed-out groups count until committed: at most 4 per batch here
        third += fast.next_batch(2, 0).groups
        fast.commit()
    assert sorted(g.group_index for g in third) == list(range(6, 16))
    h.wait_until(lambda: h.producer.stats.groups_started == 20)  # 4 ahead of the fast reader (cursor 15)
    h.held_again()
    assert h.producer.stats.groups_started == 20

    stats = h.stop()
    fast.next_batch(stats.groups_written - 16, 0)  # the fast reader goes on to the end of the stream
    fast.commit()
    assert h.stream.reader("adapter-fast").cursor == h.stream.offsets()[-1] == stats.groups_written - 1 >= 19
    assert h.stream.reader("adapter-slow").cursor == 1


# --------------------------------------------------------------------------------- shared mode


def test_shared_mode_measures_staleness_against_each_adapters_own_version(multi):
    engine = ScriptedEngine()
    pa, pb = AdapterPolicy(engine, "a"), AdapterPolicy(engine, "b")
    readers = {"adapter-a", "adapter-b"}
    h = multi(engine, routes=[PolicyRoute("a", pa), PolicyRoute("b", pb)], capacity=4,
              consumer=lambda: h.slowest(readers),
              version_stamp=lambda: {"a": pa.weight_version, "b": pb.weight_version})
    two_adapters(h, pa, pb, 1, 1)
    h.start()
    h.wait_until(lambda: h.producer.stats.groups_written == 4)  # groups 0-3, stamped a=1, b=1; then held
    h.loop.run(pa.update_weights("weights/a/v4", 4))  # a trains three steps meanwhile
    fa, fb = h.reader_feed("adapter-a", view=shared_view("a")), h.reader_feed("adapter-b", view=shared_view("b"))

    # b (version 1) trains on groups 0-3: lag 0 for it
    b1 = fb.next_batch(4, trainer_version=1)
    fb.commit()
    assert sorted(g.group_index for g in b1.groups) == [0, 1, 2, 3] and not b1.rejected
    assert b1.metrics["async/staleness_max"] == 0
    # a (version 4, max_weight_staleness 2): groups 0-3 are 3 of a's versions old, rejected for a only;
    # the producer then makes groups 4-7, stamped a=4, b=1
    a1 = fa.next_batch(4, trainer_version=4)
    assert sorted(r.group.group_index for r in a1.rejected) == [0, 1, 2, 3]
    assert [(r.reason, r.lag) for r in a1.rejected] == [("stale", 3)] * 4
    assert fa.totals["stale"] == fa.totals["dropped"] == 4 and fb.totals["dropped"] == 0
    assert sorted(g.group_index for g in a1.groups) == [4, 5, 6, 7]
    assert a1.metrics["async/staleness_max"] == 0 and a1.metrics["async/rejected_stale"] == 4

    raw = h.raw_groups()
    assert [raw[g].samples[0].metadata["adapter_versions"] for g in (0, 3, 4, 7)] == [
        {"a": 1, "b": 1}, {"a": 1, "b": 1}, {"a": 4, "b": 1}, {"a": 4, "b": 1}]
    by_b = next(g for g in a1.groups if g.group_index == 5)  # generated by b at b's version 1
    for seen, written in zip(by_b.samples, raw[5].samples):
        assert seen.adapter == "b" and seen.span_versions == [4] and seen.submit_version == 4  # a's own, at start
        assert written.span_versions == [1] and written.submit_version == 1  # the stream is untouched
        assert seen.rollout_logprobs == written.rollout_logprobs  # behaviour policy's: TIS corrects
    by_a = next(g for g in a1.groups if g.group_index == 4)
    assert by_a.samples[0].span_versions == [4] and by_a.samples[0] == raw[4].samples[0]  # a's own: as is
    # without the view, b's groups would count as 3 versions old for a (generated at b's version 1)
    assert group_lag(raw[5], 4) == 3

    # b moves to version 3: groups 4-7 are 2 of b's versions old (a's groups by the stamp b=1)
    h.loop.run(pb.update_weights("weights/b/v3", 3))
    b2 = fb.next_batch(4, trainer_version=3)
    assert sorted(g.group_index for g in b2.groups) == [4, 5, 6, 7] and not b2.rejected
    assert b2.metrics["async/staleness_max"] == 2
    assert next(g for g in b2.groups if g.group_index == 4).samples[0].span_versions == [1]
    h.stop()


# ----------------------------------------------------------------------------- per-adapter mode


def _written(name: str, group_index: int) -> Group:
    return Group([Sample(f"p{group_index}", [1, 2], [3], group_index=group_index, sample_index=j, adapter=name)
                  for j in range(2)])


@pytest.mark.parametrize("read_ahead", [False, True])
def test_adapter_view_takes_only_its_own_groups_and_passes_shared_segments(tmp_path, read_ahead):
    stream = SampleStream(RunLayout(str(tmp_path / "runs"), "t", "r1").run_dir)
    layout = [[(0, "a"), (1, "b")], [(2, "a"), (3, "b")], [(4, "b"), (5, "b")], [(6, "a"), (7, "a")]]
    offsets = [stream.append([_written(name, g) for g, name in seg]) for seg in layout]
    cfg = FullyAsyncMode(max_weight_staleness=0)
    feeds = {name: GroupFeed(stream, DefaultDataBuffer(cfg, 64), cfg, lambda: [(stream, None)],
                             reader=f"adapter-{name}", view=adapter_view(name), read_ahead=read_ahead)
             for name in "ab"}
    try:
        got = {name: feed.next_batch(4, trainer_version=0) for name, feed in feeds.items()}
        assert [g.group_index for g in got["a"].groups] == [0, 2, 6, 7]
        assert [g.group_index for g in got["b"].groups] == [1, 3, 4, 5]
        for name, feed in feeds.items():
            assert all(s.adapter == name for g in got[name].groups for s in g.samples)
            assert not got[name].rejected and feed.totals["dropped"] == feed.totals["stale"] == 0
            assert got[name].metrics["async/dropped_total"] == 0
            assert stream.reader(f"adapter-{name}").cursor == -1, "its own groups are not trained yet"
            feed.commit()
            assert stream.reader(f"adapter-{name}").cursor == offsets[-1], "past segments shared with the other"
        assert feeds["a"].totals["not_mine"] == feeds["b"].totals["not_mine"] == 4

        # a segment with none of a's groups: a's cursor passes it at once, with nothing to train
        last = stream.append([_written("b", 8)])
        deadline = time.monotonic() + 0.3
        idle = feeds["a"].next_batch(1, 0, stop=lambda: time.monotonic() > deadline)
        assert idle.groups == [] and stream.reader("adapter-a").cursor == last
        assert feeds["a"].totals["not_mine"] == 5
    finally:
        for feed in feeds.values():
            feed.close()


# --------------------------------------------------------------------- hot swap in the HF engine


def test_hot_swapping_an_adapter_in_the_hf_engine_leaves_the_other_and_the_base_alone(tiny_model_dir, tmp_path):
    from contract.engine_contract import requests, seeded_params
    from test_engine_hf import make_adapter, start_batch

    from miles_core.config import HFEngineConfig
    from miles_core.engines.hf import HFEngine

    engine = HFEngine(str(tiny_model_dir), HFEngineConfig())
    alpha, beta = AdapterPolicy(engine, "alpha"), AdapterPolicy(engine, "beta")
    folders = {k: make_adapter(tiny_model_dir, tmp_path / k, seed=s) for k, s in (("a1", 1), ("b1", 2), ("a2", 3))}
    probe = requests(engine.tokenizer, seeded_params())

    def base_weights() -> dict[str, torch.Tensor]:
        return {n: p for n, p in engine.model.named_parameters() if "lora_" not in n}

    async def body():
        base_before = await engine.generate(probe)
        await alpha.update_weights(folders["a1"], 1)
        await beta.update_weights(folders["b1"], 1)
        base = {n: (p.detach().clone(), p.data_ptr()) for n, p in base_weights().items()}
        a1, b1 = await asyncio.gather(alpha.generate(probe), beta.generate(probe))
        # both adapters busy in one running batch; a's new version loads once it ends, b keeps serving
        long = [GenerateRequest(r.prompt_ids, seeded_params(max_new_tokens=60), rid=f"{name}-{r.rid}", adapter=name)
                for name in ("alpha", "beta") for r in probe]
        running = await start_batch(engine, long)
        swap = asyncio.create_task(alpha.update_weights(folders["a2"], 2))
        b_during = asyncio.create_task(beta.generate(probe))
        in_flight, _, b_during = await asyncio.wait_for(asyncio.gather(running, swap, b_during), 60)
        a2, b2 = await asyncio.gather(alpha.generate(probe), beta.generate(probe))
        return base_before, base, a1, b1, in_flight, b_during, a2, b2, await engine.generate(probe)

    try:
        base_before, base, a1, b1, in_flight, b_during, a2, b2, base_after = asyncio.run(body())
        assert set(base_weights()) == set(base) and engine.adapters == ["alpha", "beta"]
        changed = [n for n, p in base_weights().items() if not torch.equal(p, base[n][0]) or p.data_ptr() != base[n][1]]
    finally:
        asyncio.run(engine.close())
    assert {r.weight_version for r in in_flight} == {1}, "the swap waited for the running batch"
    assert {r.weight_version for r in a1} == {1} and {r.weight_version for r in a2} == {2}
    assert [r.logprobs for r in a2] != [r.logprobs for r in a1], "a's new version is a new policy"
    for after in (b_during, b2):  # b: same version, same results, before, during and after the swap
        assert {r.weight_version for r in after} == {1}
        assert [r.output_ids for r in after] == [r.output_ids for r in b1]
        assert [x for r in after for x in r.logprobs] == pytest.approx([x for r in b1 for x in r.logprobs], abs=1e-5)
    assert alpha.weight_version == 2 and beta.weight_version == 1 and engine.weight_version == 0
    assert changed == [], "the base was never reloaded: same tensors, bit for bit, in the same memory"
    assert [r.output_ids for r in base_after] == [r.output_ids for r in base_before]
