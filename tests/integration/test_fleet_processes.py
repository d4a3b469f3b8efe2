"""A fully-async run's rollout fleet with real processes: two producers (child processes of the
training flow's, each with its own transformers engine) talk to the trainer only through the run
folder. One is killed with SIGKILL mid-run: the trainer notices, gives its unwritten prompts back
to the pool, launches a replacement, and the run completes and learns, with every prompt generated
at most once per attempt and none lost (asserted on the prompt log and the segments). A third
producer, started by hand with the worker's own command while the run goes on, joins it: the
trainer trains on what it writes."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from serving import wait_for
from test_modes import _rows, _run_cfg

pytestmark = pytest.mark.integration


def assert_prompts_exactly_once(run_dir: str, storage_options: dict | None = None) -> dict[str, int]:
    """Over the whole run: each claimed prompt was written once (within its producer's fence), or
    went back to the pool and was claimed again; no group was written twice. Returns counts. It
    re-derives, from the prompt log and the segments alone, what the run's own audit says
    (miles_core/ledger.py), so a bug in the audit does not pass unseen."""
    from miles_core.rollout.fleet import ControlPlane, PromptLog, stream_name
    from miles_core.storage import SampleStream

    control, log = ControlPlane(run_dir, storage_options), PromptLog(run_dir, storage_options)
    entries = log.entries()
    written: dict[int, int] = {}  # group index -> prompt row, over every producer's readable segments
    for producer in control.heartbeats():
        fence = control.fence_of(producer)
        stream = SampleStream(run_dir, producer=stream_name(producer), storage_options=storage_options)
        for segment in stream.read():
            if fence is not None and segment.offset > fence:
                continue  # the trainer never reads past a fence
            for s in segment.samples():
                assert written.setdefault(s.group_index, s.prompt_index) == s.prompt_index
    groups_per_row: dict[int, int] = {}
    for g, row in written.items():
        groups_per_row[row] = groups_per_row.get(row, 0) + 1
    released: dict[int, int] = {}
    for e in entries:
        if e.kind == "release":
            for row in e.rows:
                released[row] = released.get(row, 0) + 1
    lost = []
    for e in entries:
        if e.kind != "claim":
            continue
        for i, row in enumerate(e.rows):
            later_release = any(r.kind == "release" and r.seq > e.seq and row in r.rows for r in entries)
            if e.group_index(i) not in written and not later_release:
                lost.append((e.producer, e.seq, row))
    assert not lost, f"claimed prompts neither written nor given back: {lost[:10]}"
    twice = {row: n for row, n in groups_per_row.items() if n > 1 + released.get(row, 0)}
    assert not twice, f"prompts generated more often than they were given back: {twice}"
    return {"claims": sum(e.kind == "claim" for e in entries), "released": sum(released.values()),
            "groups_written": len(written)}


def test_a_producer_killed_mid_run_is_replaced_and_nothing_is_lost(prefect_backend, demo_model, tmp_path):
    from flows.train import train
    from miles_core.rollout.fleet import ControlPlane
    from miles_core.session.fleet_member import SubprocessLauncher
    from miles_core.run import RunRefs
    from miles_core.storage import SampleStream

    cfg = _run_cfg(tmp_path, demo_model, "fully_async", run_id="fleet-kill",
                   rollout={"num_rollout": 14, "rollout_batch_size": 16},
                   engine={"type": "hf", "num_threads": 1},
                   train={"use_tis": True},
                   eval={"eval_interval": None},
                   mode={"rollout_producers": 2, "producer_heartbeat_timeout_s": 4,
                                  "max_concurrent_samples": 64, "max_weight_staleness": 4})
    run_dir = tmp_path / "runs" / cfg.name / "fleet-kill"
    killed: dict[str, int] = {}

    def kill_p1_after_three_steps():
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(_rows(str(run_dir), "metrics.jsonl")) >= 3,
                 300, "three training steps")
        beat = ControlPlane(str(run_dir)).heartbeat("p1")
        killed["pid"] = beat.pid
        killed["at_step"] = len(_rows(str(run_dir), "metrics.jsonl"))
        os.kill(beat.pid, signal.SIGKILL)

    by_hand = SubprocessLauncher(cfg, RunRefs("fleet-kill", str(run_dir), demo_model))

    def join_a_producer_by_hand():  # `python -m miles_core.session.fleet_member --producer-id extra ...`
        wait_for(lambda: (run_dir / "fleet" / "producers" / "p0.json").exists(), 120, "the fleet's first heartbeat")
        by_hand.launch("extra")

    killer = threading.Thread(target=kill_p1_after_three_steps, daemon=True)
    joiner = threading.Thread(target=join_a_producer_by_hand, daemon=True)
    killer.start()
    joiner.start()
    try:
        state = train(cfg, return_state=True)
    finally:
        joiner.join(timeout=5)
        extra_exit = by_hand.procs["extra"].wait(timeout=60) if "extra" in by_hand.procs else None
    killer.join(timeout=5)
    assert state.is_completed(), state
    summary = state.result()
    assert killed and killed["at_step"] < 14, "the producer was killed while the run went on"
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.1, summary

    producers = summary["producers"]
    assert set(producers) == {"p0", "p1", "p2", "extra"}, producers  # p2 replaced the killed p1
    assert producers["p1"]["fenced_at"] is not None and producers["p1"]["pid"] == killed["pid"]
    assert producers["p0"]["status"] == producers["p2"]["status"] == "stopped"
    # the producer started by hand joined: it wrote, the trainer read it, and the run's stop ended it
    assert producers["extra"]["status"] == "stopped" and extra_exit == 0, (producers["extra"], extra_exit)
    assert producers["extra"]["groups_written"] > 0, producers["extra"]
    assert SampleStream(str(run_dir), producer="rollout-extra").reader("trainer").cursor >= 0
    # (whether p2 got to write before the end depends on how fast it loads its engine here)
    audit = summary["audit"]  # every prompt of the log trained once, or given back, or still queued
    assert audit["ok"], audit["problems"]
    assert audit["counts"]["trained"] == 14 * 16 and audit["token_balance"] == 0
    assert audit["counts"].get("in flight at the end", 0) == 0
    assert assert_prompts_exactly_once(summary["run_dir"])["groups_written"] >= 14 * 16
    rows = _rows(str(run_dir), "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 15))
    assert max(r["async/producer_deaths"] for r in rows) == 1


def test_a_producer_that_keeps_failing_fails_the_run_naming_it_and_its_error(prefect_backend, demo_model, tmp_path):
    from flows.train import train

    cfg = _run_cfg(tmp_path, demo_model, "fully_async", rollout={"reward_post_process_path": "test_modes:explode"},
                   eval={"eval_interval": None, "skip_eval_before_train": True},
                   mode={"producer_restarts": 1})
    t0 = time.monotonic()
    state = train(cfg, return_state=True)
    assert state.is_failed()
    with pytest.raises(RuntimeError) as failure:
        state.result()
    text = str(failure.value)
    assert "rollout producer p1 died: it failed: RuntimeError: reward post-process exploded" in text, text
    assert "Traceback" in text and "--producer-restarts 1" in text
    assert time.monotonic() - t0 < 120
    assert not list(Path(tmp_path).glob("runs/*/*/samples/rollout-p*/.*tmp*")), "nothing partial"
