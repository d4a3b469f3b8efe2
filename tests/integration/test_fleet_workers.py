"""A rollout fleet across work pools, as in a cluster, on a real Prefect server on PostgreSQL and a
real S3 endpoint (moto's server): the ``train/fully-async`` deployment on work pool ``train`` and
``rollout/fleet`` on work pool ``rollout`` (both from ``prefect.yaml``, ``prefect deploy``), one
``prefect worker`` for training and two for rollouts (one producer each). The run launches its two
producers as flow runs of ``rollout/fleet`` (children of the training run) and trains on what they
stream through S3; they talk to it only through the run folder there.

- One "inference machine" dies (its worker and its producer process, SIGKILL): the run notices
  within the heartbeat timeout, marks that flow run CRASHED, gives its unwritten prompts back,
  launches a replacement (a new worker picks it up), completes and learns, with every prompt
  generated at most once per attempt and none lost.
- Cancelling a training run cancels its producers' flow runs (CANCELLED), with nothing partial.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serving import REPO, served, wait_for

pytestmark = pytest.mark.integration

PREFECT = str(Path(sys.executable).parent / "prefect")


@pytest.fixture(scope="module")
def s3():
    from miles_core.storage.local_s3 import LocalS3

    with LocalS3() as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def pools(postgres_backend):
    def prefect(*args: str) -> str:
        done = subprocess.run([PREFECT, "--no-prompt", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=180, env={**os.environ, "PREFECT_API_URL": postgres_backend,
                                                "MILES_REPO": str(REPO)})
        assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    prefect("work-pool", "create", "train", "--type", "process")
    prefect("work-pool", "create", "rollout", "--type", "process")
    prefect("deploy", "--name", "fully-async", "--pool", "train")
    prefect("deploy", "--name", "fleet")  # prefect.yaml puts it on pool "rollout"
    return postgres_backend


def _worker(pool: str, api_url: str, limit: int):
    """A worker of ``pool``; its machine's S3 credentials are in its environment (flow-run parameters
    never carry them)."""
    return served(["-m", "prefect", "worker", "start", "--pool", pool, "--type", "process", "--limit", str(limit)],
                  api_url, tail=30, env={"MILES_REPO": str(REPO), "AWS_ACCESS_KEY_ID": "testing",
                                         "AWS_SECRET_ACCESS_KEY": "testing"})


def _cfg(s3, model_dir: str, name: str, **rollout):
    from miles_core.config import RunConfig

    bucket = s3.make_bucket(f"fleet-{name}")
    return RunConfig.model_validate({
        "name": name, "model": {"path": str(Path(model_dir).resolve())},
        "data": {"type": "toy"},
        "rollout": {"num_rollout": 14, "rollout_batch_size": 16, "n_samples_per_prompt": 8,
                    "rollout_max_response_len": 6, **rollout},
        "train": {"lr": 1e-4, "micro_batch_size": 64, "use_tis": True},
        "engine": {"type": "hf", "num_threads": 1},
        "eval": {"eval_interval": None, "num_prompts": 256},
        "mode": {"type": "fully_async", "rollout_producers": 2, "rollout_deployment": "rollout/fleet", "max_weight_staleness": 4,
                          "producer_heartbeat_timeout_s": 5, "max_concurrent_samples": 64},
        "storage": {"root": bucket, "storage_options": s3.storage_options},
    })


def _flow_runs(parent_tag: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[parent_tag])))


def test_producers_on_their_own_pool_survive_a_dead_machine_and_the_run_learns(pools, s3, demo_model):
    from deployments.api import start_run
    from miles_core.rollout.fleet import ControlPlane

    cfg = _cfg(s3, demo_model, "fleet-workers", num_rollout=16)
    with _worker("train", pools, 1) as trainer, _worker("rollout", pools, 1) as a, _worker("rollout", pools, 1) as b:
        run = start_run(cfg, deployment="train/fully-async")
        wait_for(lambda: len(run.metrics()) >= 3, 300, "three training steps")
        control = ControlPlane(run.run_dir, cfg.storage.storage_options)
        beats = control.heartbeats()
        assert set(beats) == {"p0", "p1"} and all(hb.flow_run_id for hb in beats.values()), beats
        # the machine of producer p1 dies: its worker and its producer process, without a word
        victim = beats["p1"]
        [machine] = [w for w in (a, b) if _is_ancestor(w.pid, victim.pid)]
        os.kill(machine.pid, signal.SIGKILL)
        os.kill(victim.pid, signal.SIGKILL)
        with _worker("rollout", pools, 1):  # a new inference machine comes up and takes the replacement
            summary = run.wait(timeout=400)
        assert trainer.poll() is None, "the training worker exited"
    assert run.status() == "COMPLETED", run.status()
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.2, summary
    producers = summary["producers"]
    assert {"p0", "p1", "p2"} <= set(producers) and producers["p1"]["fenced_at"] is not None
    children = {r.name: r for r in _flow_runs(f"miles.run:{summary['run_id']}")}
    states = {name: r.state_type.value for name, r in children.items()}
    assert states[f"{cfg.name}-p1"] == "CRASHED" and states[f"{cfg.name}-p0"] == "COMPLETED", states
    audit = summary["audit"]  # every prompt of the log trained once, or given back, or still queued
    assert audit["ok"], audit["problems"]
    assert audit["counts"]["trained"] == 16 * cfg.rollout.rollout_batch_size and audit["token_balance"] == 0


def _is_ancestor(worker_pid: int, pid: int) -> bool:
    """Whether ``pid`` descends from ``worker_pid`` (the process worker runs flow runs as children)."""
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid == worker_pid:
            return True
    return False


def test_cancelling_the_training_run_cancels_its_producers_leaving_nothing_partial(pools, s3, demo_model):
    from deployments.api import start_run
    from miles_core.rollout.fleet import ControlPlane, stream_name
    from miles_core.storage import SampleStream

    cfg = _cfg(s3, demo_model, "fleet-cancel", num_rollout=10_000)
    with _worker("train", pools, 1), _worker("rollout", pools, 1), _worker("rollout", pools, 1):
        run = start_run(cfg, deployment="train/fully-async")
        wait_for(lambda: len(run.metrics()) >= 3, 300, "three training steps")
        tag = f"miles.run:{Path(run.run_dir).name}"
        assert len(_flow_runs(tag)) == 2
        state = run.cancel(timeout=60)
        assert state.is_cancelled(), state
        t0 = time.monotonic()
        wait_for(lambda: all(r.state_type.value == "CANCELLED" for r in _flow_runs(tag)), 10,
                 "both producer flow runs to end CANCELLED within 10 s of the training run")
        print(f"producers CANCELLED {time.monotonic() - t0:.1f} s after the training run")
    opts = cfg.storage.storage_options
    for producer, beat in ControlPlane(run.run_dir, opts).heartbeats().items():
        assert beat.status == "stopped", (producer, beat)
        stream = SampleStream(run.run_dir, producer=stream_name(producer), storage_options=opts)
        assert sum(len(s) for s in stream.read()) == beat.stats["groups_written"] * 8  # every segment decodes


def test_prompt_log_on_s3_claims_each_prompt_once_under_concurrency(s3):
    """The unit tier's race (tests/unit/test_fleet.py) through a real S3 endpoint: create-only
    PUTs (If-None-Match: *) are what makes a log entry unique."""
    from concurrent.futures import ThreadPoolExecutor

    from miles_core.rollout.fleet import PromptLog
    from unit.test_fleet import counter_draw  # the unit test's draw function

    run_dir = s3.make_bucket("fleet-log-race") + "/run"
    opts = s3.storage_options

    def claimer(k: int) -> list[int]:
        log = PromptLog(run_dir, opts, draw=counter_draw(1000))
        return [r for _ in range(5) for r in log.claim(f"p{k}", 4).rows]

    with ThreadPoolExecutor(6) as pool:
        rows = [r for batch in pool.map(claimer, range(6)) for r in batch]
    assert sorted(rows) == list(range(6 * 5 * 4))
    PromptLog(run_dir, opts).release(rows[:3], reason="test")  # then two more claimers race for them
    with ThreadPoolExecutor(2) as pool:
        again = list(pool.map(lambda k: PromptLog(run_dir, opts, draw=counter_draw(1000)).claim(f"q{k}", 2).rows,
                              range(2)))
    assert sorted(r for rs in again for r in rs) == sorted(rows[:3] + [120]), "released rows first, once each"
