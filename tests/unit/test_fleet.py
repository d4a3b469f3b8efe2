"""The rollout fleet's control plane in storage: the prompt log (claims exactly once under
concurrency, releases, reclaiming a dead producer's prompts), heartbeats and their expiry, stop,
pause and fences, a producer's error reaching the trainer, and the trainer's merge of several
producers' streams. Local files and memory:// here; the same against moto's S3 in the integration
tier (tests/integration/test_fleet_workers.py runs a fleet through S3; test_prompt_log_on_s3 there races claimers)."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from miles_core.config import FullyAsyncMode
from miles_core.rollout.buffer import DefaultDataBuffer
from miles_core.rollout.consumer import GroupFeed
from miles_core.rollout.fleet import (
    GROUP_STRIDE,
    ControlPlane,
    FleetMonitor,
    Heartbeat,
    ProducerFenced,
    PromptLog,
    stream_name,
)
from miles_core.storage import SampleStream
from miles_core.types import Group, Sample, SampleStatus


def counter_draw(size: int):
    """Rows 0..size-1 per epoch, in order; the cursor is (epoch, position)."""

    def draw(cursor, n):
        epoch, position = (0, 0) if cursor is None else cursor
        rows = []
        for _ in range(n):
            rows.append(position)
            position += 1
            if position == size:
                epoch, position = epoch + 1, 0
        return rows, [epoch, position]

    return draw


@pytest.fixture(params=["file", "memory"])
def run_dir(request, tmp_path):
    if request.param == "file":
        return str(tmp_path / "run")
    return f"memory://fleet-{uuid.uuid4().hex[:8]}/run"


def test_claims_take_the_data_in_order_and_number_groups_uniquely(run_dir):
    log = PromptLog(run_dir, draw=counter_draw(10))
    a = log.claim("p0", 4)
    b = log.claim("p1", 4)
    c = log.claim("p0", 4)
    assert (a.rows, b.rows, c.rows) == ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1])  # crosses into epoch 1
    assert c.cursor == [1, 2]
    assert a.group_index(3) == 3 and b.group_index(0) == GROUP_STRIDE and c.group_index(1) == 2 * GROUP_STRIDE + 1
    # a second log object (another process) sees the same entries, and continues after them
    other = PromptLog(run_dir, draw=counter_draw(10))
    assert [e.rows for e in other.entries()] == [a.rows, b.rows, c.rows]
    assert other.claim("p2", 2).rows == [2, 3]


def test_concurrent_claimers_never_take_the_same_prompt_and_skip_none(run_dir):
    """Eight claimers (each its own log object, as eight producers would be) race for 400 prompts."""
    size, per_claim, claims_each, claimers = 1000, 5, 10, 8

    def claimer(k: int) -> list[tuple[int, list[int]]]:
        log = PromptLog(run_dir, draw=counter_draw(size))
        return [(c.seq, c.rows) for c in (log.claim(f"p{k}", per_claim) for _ in range(claims_each))]

    with ThreadPoolExecutor(claimers) as pool:
        results = [r for batch in pool.map(claimer, range(claimers)) for r in batch]
    rows = [row for _, rs in results for row in rs]
    assert sorted(rows) == list(range(claimers * claims_each * per_claim))  # every prompt once, none skipped
    assert sorted(seq for seq, _ in results) == list(range(claimers * claims_each))  # one entry per seq


def test_released_rows_are_claimed_again_first_exactly_once(run_dir):
    log = PromptLog(run_dir, draw=counter_draw(100))
    log.claim("p0", 3)  # 0 1 2
    log.release([1, 2], reason="producer p0 died", producer="p0")
    racers = [PromptLog(run_dir, draw=counter_draw(100)) for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        claims = list(pool.map(lambda lg: lg.claim("px", 1), racers))
    taken = sorted(r for c in claims for r in c.rows)
    assert taken == [1, 2, 3, 4], "the released rows go first, once each; then new data"
    assert log.entries()[1].kind == "release" and log.entries()[1].reason == "producer p0 died"


def test_a_log_entry_is_never_overwritten_and_stray_files_are_ignored(tmp_path):
    run_dir = str(tmp_path / "run")
    log = PromptLog(run_dir, draw=counter_draw(10))
    log.claim("p0", 2)
    (tmp_path / "run" / "fleet" / "claims" / ".000000001.json.tmp-abcd").write_text("{partial")
    second = PromptLog(run_dir, draw=counter_draw(10)).claim("p1", 2)
    assert second.seq == 1 and second.rows == [2, 3]


# ------------------------------------------------------------------------------- control plane


def test_stop_pause_and_fence_travel_through_storage(run_dir):
    trainer, producer = ControlPlane(run_dir), ControlPlane(run_dir)
    assert not producer.stop_requested() and producer.pause_holders() == [] and producer.fence_of("p0") is None
    trainer.pause("eval-step-4")
    assert producer.pause_holders() == ["eval-step-4"]
    trainer.unpause("eval-step-4")
    assert producer.pause_holders() == []
    trainer.request_stop("done")
    assert producer.stop_requested()
    trainer.fence("p1", 6, "no heartbeat")
    assert producer.fence_of("p1") == 6 and producer.fence_of("p0") is None


def test_heartbeats_count_up_and_read_back(run_dir):
    control = ControlPlane(run_dir)
    hb = Heartbeat("p0", "running", weight_version=3, outstanding=5)
    control.beat(hb)
    control.beat(hb)
    back = ControlPlane(run_dir).heartbeat("p0")
    assert back.beat == 2 and back.weight_version == 3 and back.outstanding == 5 and back.pid > 0


class Clock:
    """A monotonic clock the test moves by hand (no sleeping)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _monitor(run_dir, log, clock, written=lambda p, o: set(), timeout=10.0, ended=lambda p: None):
    return FleetMonitor(ControlPlane(run_dir), log, written, heartbeat_timeout_s=timeout, start_timeout_s=30,
                        poll_s=0.0, ended=ended, clock=clock)


def test_a_silent_producer_is_dead_after_the_timeout_and_its_unwritten_prompts_go_back(run_dir):
    clock = Clock()
    log = PromptLog(run_dir, draw=counter_draw(100))
    p0 = log.claim("p0", 4)  # rows 0-3, groups 0-3
    log.claim("p1", 4)
    monitor = _monitor(run_dir, log, clock, written=lambda p, o: {p0.group_index(0), p0.group_index(2)})
    control = ControlPlane(run_dir)
    for name in ("p0", "p1"):
        monitor.watch(name)
    hb0, hb1 = Heartbeat("p0", "running"), Heartbeat("p1", "running")
    control.beat(hb0), control.beat(hb1)
    assert monitor.poll() == []
    clock.now += 6
    control.beat(hb1)  # p1 keeps beating, p0 goes quiet
    assert monitor.poll() == []
    clock.now += 6  # p0 silent for 12 s > 10 s
    control.beat(hb1)
    [dead] = monitor.poll(last_offset=lambda p: 4)
    assert dead.producer == "p0" and "no heartbeat for 12.0 s" in dead.dead
    assert monitor.alive == ["p1"] and monitor.fences == {"p0": 4} and control.fence_of("p0") == 4
    release = log.entries()[-1]
    assert release.kind == "release" and release.rows == [1, 3], "written groups are not generated again"
    assert PromptLog(run_dir, draw=counter_draw(100)).claim("p1", 3).rows == [1, 3, 8]


def test_time_the_trainer_itself_could_not_read_storage_does_not_count_against_producers(run_dir):
    """A storage outage blinds everyone: a heartbeat read that took 15 s (retried through the outage)
    is not 15 s of silence from the producers; silence after it still counts."""
    clock = Clock()
    log = PromptLog(run_dir, draw=counter_draw(10))
    monitor = _monitor(run_dir, log, clock)
    control = ControlPlane(run_dir)
    monitor.watch("p0")
    hb = Heartbeat("p0", "running")
    control.beat(hb)
    assert monitor.poll() == []
    read = monitor.control.heartbeats

    def slow_read():
        clock.now += 15  # the endpoint was down: the read was retried until it came back
        return read()

    monitor.control.heartbeats = slow_read
    clock.now += 1
    assert monitor.poll() == [] and monitor.alive == ["p0"]
    monitor.control.heartbeats = read
    clock.now += 11  # then 11 s of real silence: dead
    [dead] = monitor.poll()
    assert dead.producer == "p0" and "no heartbeat for 12.0 s" in dead.dead


def test_a_producer_that_wrote_failed_is_dead_with_its_traceback(run_dir):
    clock = Clock()
    log = PromptLog(run_dir, draw=counter_draw(10))
    monitor = _monitor(run_dir, log, clock)
    monitor.watch("p0")
    try:
        raise ValueError("the reward server said 502")
    except ValueError:
        import traceback

        tb = traceback.format_exc()
    ControlPlane(run_dir).beat(Heartbeat("p0", "failed", error="ValueError: the reward server said 502", traceback=tb))
    [dead] = monitor.poll()
    text = monitor.describe(dead)
    assert "rollout producer p0 died: it failed: ValueError: the reward server said 502" in text
    assert 'raise ValueError("the reward server said 502")' in text  # the traceback travels with it


def test_a_producer_the_launcher_reports_ended_is_dead_without_waiting_for_its_heartbeat(run_dir):
    clock = Clock()
    ended = {"p0": None}
    monitor = _monitor(run_dir, PromptLog(run_dir), clock, ended=lambda p: ended.get(p))
    monitor.watch("p0")
    ControlPlane(run_dir).beat(Heartbeat("p0", "running"))
    assert monitor.poll() == []
    ended["p0"] = "its process 123 was killed by signal SIGKILL"
    [dead] = monitor.poll()
    assert dead.dead == "its process 123 was killed by signal SIGKILL"


def test_a_producer_that_never_beats_is_dead_after_the_start_timeout_and_a_new_one_joins(run_dir):
    clock = Clock()
    monitor = _monitor(run_dir, PromptLog(run_dir), clock)
    monitor.watch("p0")
    clock.now += 29
    assert monitor.poll() == []
    ControlPlane(run_dir).beat(Heartbeat("p7", "running"))  # started by hand: it joins
    clock.now += 2
    [dead] = monitor.poll()
    assert dead.producer == "p0" and "no heartbeat 31 s after launch" in dead.dead
    assert monitor.alive == ["p7"] and monitor.producers() == ["p0", "p7"]


# ---------------------------------------------------------------------------------- the merge


def _group(index: int, n: int = 2) -> Group:
    return Group([Sample(prompt=f"p{index}", prompt_ids=[1], response_ids=[2, 3], response="x", label="",
                         reward=float(j), loss_mask=[1, 1], rollout_logprobs=[-0.1, -0.2], span_starts=[0],
                         span_versions=[0], submit_version=0, status=SampleStatus.COMPLETED, group_index=index,
                         sample_index=j, prompt_index=index) for j in range(n)])


def test_the_trainer_merges_producer_streams_in_a_fixed_order_with_a_cursor_each(tmp_path):
    run_dir = str(tmp_path / "run")
    base = SampleStream(run_dir)
    streams = {p: base.sibling(stream_name(p)) for p in ("p0", "p1")}
    streams["p1"].append([_group(GROUP_STRIDE + 0), _group(GROUP_STRIDE + 1)])
    streams["p0"].append([_group(0)])
    streams["p0"].append([_group(1), _group(2)])
    cfg = FullyAsyncMode()
    fences = {"p0": None, "p1": None}

    def feed():
        return GroupFeed(base, DefaultDataBuffer(cfg, capacity=64, first_version=0), cfg,
                         streams=lambda: [(streams[p], fences[p]) for p in sorted(streams)])

    first = feed()
    batch = first.next_batch(3, 0)
    # p0's segments in offset order, then p1's: the same groups whatever order they were written in
    assert [g.group_index for g in batch.groups] == [0, 1, 2]
    first.commit()
    assert streams["p0"].reader("trainer").cursor == 1 and streams["p1"].reader("trainer").cursor == -1
    # a restarted trainer reads each stream from its own durable cursor
    again = feed()
    assert [g.group_index for g in again.next_batch(2, 0).groups] == [GROUP_STRIDE, GROUP_STRIDE + 1]


def test_a_fenced_stream_is_read_up_to_its_fence_only(tmp_path):
    run_dir = str(tmp_path / "run")
    base = SampleStream(run_dir)
    s0 = base.sibling(stream_name("p0"))
    s0.append([_group(0)])
    s0.append([_group(1)])  # written by a producer the trainer had declared dead at offset 0
    cfg = FullyAsyncMode()
    feed = GroupFeed(base, DefaultDataBuffer(cfg, capacity=64, first_version=0), cfg,
                     streams=lambda: [(s0, 0)], poll_s=0.001)
    assert [g.group_index for g in feed.next_batch(1, 0).groups] == [0]
    polls: list[int] = []
    more = feed.next_batch(1, 0, stop=lambda: polls.append(1) or len(polls) > 5)
    assert more.groups == [] and len(polls) > 5, "offset 1 is past the fence: never read"

    warned: list[str] = []
    feed.warn, feed.cfg = warned.append, FullyAsyncMode(no_progress_s=0.001)
    feed.next_batch(1, 0, stop=lambda: bool(warned))
    assert warned[0].endswith(f"read up to rollout-p0 offset 1 of {run_dir}/samples)"), warned[0]


# ------------------------------------------------------------------------- resume: nothing twice


def test_a_dead_producers_prompts_go_back_once_whoever_releases_first(run_dir):
    """A producer that gave back part of its claim itself, then was declared dead: the trainer gives
    back only the rest; a release of its own after that gives back nothing more."""
    log = PromptLog(run_dir, draw=counter_draw(100))
    claim = log.claim("p0", 4)  # rows 0..3, groups 0..3
    log.filtered("p0", claim.group_index(0), 0, "nonzero_reward_std")  # settled, not back in the pool
    log.release_own({claim.group_index(3): 3}, reason="producer p0 stopped", producer="p0")
    fenced = log.release_unwritten("p0", settled={claim.group_index(1)}, reason="producer p0 died")
    assert fenced.rows == [2] and fenced.groups == [claim.group_index(2)] and fenced.fenced
    assert log.release_own({claim.group_index(2): 2}, reason="late", producer="p0") is None
    assert log.release_unwritten("p0", settled=set(), reason="again") is None, "fenced once"
    with pytest.raises(ProducerFenced, match="claims nothing more"):  # what it took now would never come back
        PromptLog(run_dir, draw=counter_draw(100)).claim("p0", 1)
    assert log.last().pending == [3, 2]
    assert sorted(PromptLog(run_dir, draw=counter_draw(100)).claim("p1", 3).rows) == [2, 3, 4]


def test_partial_groups_of_an_earlier_start_are_adopted_once_and_the_rest_goes_back(tmp_path):
    """p0 claimed groups 0..3, wrote group 0, saved 1 and 2 as partial at its stop and lost 3. The
    next start (heir p1) continues 1 and 2 under their own indices and gives back only 3's prompt.
    Settling again (a crash half-way) adopts nothing twice; if p1 dies in turn, its fence gives back
    the adopted prompts, and its own partial stream is what a third start continues."""
    from miles_core.rollout.fleet import settle_earlier

    run_dir = str(tmp_path / "run")
    log = PromptLog(run_dir, draw=counter_draw(100))
    base = SampleStream(run_dir)
    claim = log.claim("p0", 4)
    base.sibling(stream_name("p0")).append([_group(claim.group_index(0))])
    base.sibling("partial-p0").append([_group(claim.group_index(1)), _group(claim.group_index(2))])
    monitor = _monitor(run_dir, log, lambda: 0.0, written=lambda p, last: _written(base, p, last))

    assert settle_earlier(monitor, base, ["p0"], heir="p1") == (1, 2)
    (adopt,) = log.adopted_by("p1")
    assert adopt.groups == [claim.group_index(1), claim.group_index(2)] and adopt.source == "p0"
    assert log.last().pending == [3]  # only the lost group's prompt is back in the pool
    assert set(log.owned("p1")) == {claim.group_index(1), claim.group_index(2)}
    assert set(log.owned("p0")) == {claim.group_index(0), claim.group_index(3)}

    again = _monitor(run_dir, PromptLog(run_dir, draw=counter_draw(100)), lambda: 0.0,
                     written=lambda p, last: _written(base, p, last))
    assert settle_earlier(again, base, ["p0"], heir="p2") == (0, 0), "nothing adopted or given back twice"

    # p1 continued group 1 and saved it again at its stop, never got to group 2
    base.sibling("partial-p1").append([_group(claim.group_index(1))])
    third = _monitor(run_dir, PromptLog(run_dir, draw=counter_draw(100)), lambda: 0.0,
                     written=lambda p, last: _written(base, p, last))
    assert settle_earlier(third, base, ["p0", "p1"], heir="p2") == (1, 1)
    assert [c.groups for c in third.log.adopted_by("p2")] == [[claim.group_index(1)]]
    assert third.log.last().pending == [3, 2]


def _written(base: SampleStream, producer: str, last: int) -> set[int]:
    from miles_core.rollout.fleet import written_groups

    return written_groups(base.sibling(stream_name(producer)), last)


def test_a_resumed_feed_trains_each_remaining_group_once(tmp_path):
    """A checkpoint keeps each stream's cursor and the groups used after it; a feed built after a
    crash (cursors put back, ``done`` from the checkpoint) trains exactly the groups the checkpoint
    had not, including the ones the lost steps trained."""
    run_dir = str(tmp_path / "run")
    base = SampleStream(run_dir)
    s0 = base.sibling(stream_name("p0"))
    s0.append([_group(0), _group(1), _group(2)])
    s0.append([_group(3), _group(4)])
    cfg = FullyAsyncMode()

    def feed(done=None):
        return GroupFeed(base, DefaultDataBuffer(cfg, capacity=64, first_version=0), cfg,
                         streams=lambda: [(s0, None)], done=done, poll_s=0.001)

    first = feed()
    assert [g.group_index for g in first.next_batch(2, 0).groups] == [0, 1]
    first.commit()
    state = first.state()  # the checkpoint: segment 0 is not wholly used, so the cursor stays before it
    assert state == {"rollout-p0": {"cursor": -1, "used": [0, 1]}}
    # the producer's back-pressure does not count the two used groups of the unfinished segment
    assert SampleStream(run_dir).sibling(stream_name("p0")).reader("trainer").progress() == (-1, 2)
    first.next_batch(2, 0)
    first.commit()  # a step after the checkpoint, lost with the crash: its cursor moved past segment 0
    assert s0.reader("trainer").cursor == 0
    s0.reader("trainer").commit(state["rollout-p0"]["cursor"])  # what restore_feed does
    resumed = feed(done=set(state["rollout-p0"]["used"]))
    assert [g.group_index for g in resumed.next_batch(3, 0).groups] == [2, 3, 4]
    assert resumed.totals["done_before"] == 2
    resumed.commit()
    assert s0.reader("trainer").cursor == 1


def test_producer_throughput_is_measured_on_each_producers_own_clock():
    """Trainer steps shorter than a heartbeat see the same counters twice: the rate stays what it
    was (no false 0), and the next heartbeat gives the rate since the last one (no burst)."""
    from miles_core.rollout.throughput import ThroughputMeter

    meter = ThroughputMeter()
    for just_started in (0.0, 0.01):  # not measured yet: no time, or too little to say anything
        assert "async/producer_throughput_qps" not in meter({"p0": {"run_seconds": just_started}}, in_flight=0)

    def stats(run_s: float, finished: int, idle_s: float = 0.0) -> dict:
        return {"run_seconds": run_s, "samples_finished": finished, "idle_seconds": idle_s}

    first = meter({"p0": stats(2.0, 40, 0.5)}, in_flight=3)
    assert first["async/producer_throughput_qps"] == 20.0 and first["async/producer_idle_fraction"] == 0.25
    assert first["async/in_flight_samples"] == 3.0
    again = meter({"p0": stats(2.0, 40, 0.5)}, in_flight=3)  # no heartbeat since
    assert again["async/producer_throughput_qps"] == 20.0
    later = meter({"p0": stats(4.0, 100, 0.5), "p1": stats(1.0, 10, 1.0)}, in_flight=0)
    assert later["async/producer_throughput_qps"] == 30.0 + 10.0  # p0: 60 samples in 2 s; p1 from its start
    assert later["async/producer_idle_fraction"] == (0.0 + 1.0) / 2
    failed = {**stats(4.0, 100, 0.5), "samples_failed": 3}
    gone = meter({"p0": failed, "p1": stats(1.0, 10, 1.0)}, in_flight=0, running=["p1"])  # p0 stopped
    assert gone["async/producer_throughput_qps"] == 10.0  # its rate no longer counts
    assert gone["async/samples_failed"] == 3.0  # its counters do


class _SignalLost:
    """A launcher whose producers did not act on their signal (a CI run saw one go on polling for
    20 s after two SIGTERMs). Such a producer still polls the run folder: ``stop`` waits, as the
    fleet does, for it to find the stop request there; if it never does, it is killed."""

    def __init__(self, control: ControlPlane) -> None:
        self.control, self.killed, self.cancelled = control, [], []

    def launch(self, producer: str) -> None:
        pass

    def ended(self, producer: str) -> None:
        return None

    def cancel(self, producer: str) -> None:
        self.cancelled.append(producer)  # the signal is sent, and lost

    def stop(self, producer: str, timeout: float = 10.0) -> bool:
        from miles_core.processes import wait_until

        if wait_until(self.control.stop_requested, timeout):
            return False  # it saw the request at its next poll and stopped cleanly
        self.killed.append(producer)
        return True

    def abandon(self, producer: str, reason: str) -> None:
        pass


def test_a_cancelled_fleet_says_stop_in_the_run_folder_before_it_waits_to_kill(tmp_path):
    from miles_core.config import RunConfig
    from miles_core.rollout.supervisor import Fleet
    from miles_core.session.refs import RunRefs

    run_dir = str(tmp_path / "run")
    cfg = RunConfig(mode={"type": "fully_async", "rollout_producers": 2})
    launcher = _SignalLost(ControlPlane(run_dir))
    warnings: list[str] = []
    fleet = Fleet(cfg, RunRefs("r", run_dir, str(tmp_path / "model")), launcher, SampleStream(run_dir),
                  warn=warnings.append)
    fleet._launch(), fleet._launch()
    fleet.cancel(timeout=30)
    assert launcher.cancelled == ["p0", "p1"]
    assert launcher.killed == [] and warnings == []  # both stopped by the run folder's word, none killed
    assert ControlPlane(run_dir).stop_requested()
