"""The storage contract against a real S3 endpoint over HTTP (moto_server on 127.0.0.1, via s3fs),
plus what only a network endpoint can do: restart mid-stream, stay down."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from contract.storage_contract import StorageContract, make_samples
from waiting import wait_for
from miles_core.storage import SampleStream
from miles_core.storage.fs import RetryPolicy, StorageUnavailableError
from miles_core.storage.local_s3 import LocalS3

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def local_s3():
    with LocalS3() as s3:
        yield s3


@pytest.fixture
def storage_options(local_s3):
    return local_s3.storage_options


@pytest.fixture
def root(local_s3) -> str:
    """A fresh bucket per test."""
    return local_s3.make_bucket(f"t-{uuid.uuid4().hex[:16]}")


class TestS3Storage(StorageContract):
    pass


@pytest.fixture
def restartable_s3():
    """A private endpoint, since restarting it wipes every bucket on it."""
    with LocalS3() as s3:
        yield s3


def test_endpoint_restart_mid_stream_loses_nothing_written_after_it(restartable_s3):
    """The endpoint goes down for 1 s while a producer appends and a reader polls; both retry with
    back-off and carry on. What moto can model: refused connections during the outage, then an
    empty endpoint (moto keeps no state across a restart, so every object written before it is
    gone and the test re-creates the bucket at once; ``retry_missing_bucket`` covers the few ms
    before that). What it cannot: a durable store that comes back with its data, or a lost
    response to a PUT that did land. So the check is: the reader gets segments 0..k-1 before the
    restart and every segment the producer writes after it, each exactly once and in order, and
    the producer's offsets continue (k..n-1) instead of restarting at 0."""
    s3 = restartable_s3
    bucket = s3.make_bucket("restart-bkt")
    retry = RetryPolicy(attempts=8, initial_delay=0.1, max_delay=2.0, deadline=30.0, retry_missing_bucket=True)
    producer = SampleStream(f"{bucket}/run", storage_options=s3.storage_options, retry=retry)
    reader = SampleStream(f"{bucket}/run", storage_options=s3.storage_options, retry=retry).reader("trainer")
    k, n = 3, 10
    for g in range(k):
        producer.append(make_samples(1, g))
    seen = [s.samples()[0].group_index for s in reader.read()]
    assert seen == list(range(k))

    def restart():
        s3.restart(downtime=1.0)
        s3.make_bucket("restart-bkt")

    errors: list[BaseException] = []

    def produce():
        try:
            for g in range(k, n):
                producer.append(make_samples(1, g))
                time.sleep(0.2)
            producer.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=restart), threading.Thread(target=produce)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not reader.finished and time.monotonic() < deadline and not errors:
        segments = reader.wait(timeout=0.5, poll=0.05)
        seen.extend(s.samples()[0].group_index for s in segments)
    for t in threads:
        t.join(60)
    assert not errors, errors
    # everything written after the outage arrives once, in order; nothing before it is re-read
    assert seen[:k] == list(range(k))
    tail, after_restart = seen[k:], producer.offsets()
    assert tail and tail == list(range(tail[0], n))
    assert after_restart[0] >= k and set(after_restart) <= set(tail)  # offsets continued: no rewrite of 0..k-1


def test_endpoint_that_stays_down_gives_a_clear_error(restartable_s3):
    s3 = restartable_s3
    bucket = s3.make_bucket("down-bkt")
    options = s3.storage_options
    stream = SampleStream(f"{bucket}/run", storage_options=options,
                          retry=RetryPolicy(attempts=3, initial_delay=0.1, deadline=5.0))
    stream.append(make_samples(1))
    s3.stop()
    start = time.monotonic()
    with pytest.raises(StorageUnavailableError) as info:
        stream.append(make_samples(1))
    assert time.monotonic() - start < 15
    message = str(info.value)
    assert stream.segment_uri(1) in message and s3.endpoint in message and "3 attempt" in message


def test_a_segment_listed_before_its_bucket_went_names_the_bucket(restartable_s3):
    """A reader lists segments, then the endpoint restarts empty before it reads them: the read
    names the missing bucket and the endpoint, not a missing segment (which would blame the writer)."""
    from miles_core.storage.fs import BucketMissingError

    s3 = restartable_s3
    bucket = s3.make_bucket("listed-bkt")
    stream = SampleStream(f"{bucket}/run", storage_options=s3.storage_options)
    stream.append(make_samples(1))
    assert stream.offsets() == [0]
    s3.restart()
    with pytest.raises(BucketMissingError) as info:
        stream.read_segment(0)
    message = str(info.value)
    assert f"bucket 'listed-bkt' does not exist on storage endpoint {s3.endpoint}" in message, message
    assert stream.segment_uri(0) in message, message


def test_checkpoints_and_weight_rollback_on_s3(root, storage_options):
    """What resuming a run needs from S3: checkpoint listing by marker (glob), pruning, and LATEST
    moved back by compare-and-swap (If-Match) with the newer versions deleted."""
    from contract.storage_contract import state_dict
    from miles_core.storage import RunLayout, WeightStore
    from miles_core.storage.fs import atomic_write, join
    from miles_core.storage.layout import CHECKPOINT_STATE, TRAINER_STATE, checkpoint_dir

    layout = RunLayout(root, "toy", "run1", storage_options)
    for step in (3, 6, 9):
        atomic_write(layout.fs, join(layout.path, checkpoint_dir(step), TRAINER_STATE), b"trainer state")
        if step != 9:  # 9: a save that did not finish
            layout.write_json(f"{checkpoint_dir(step)}/{CHECKPOINT_STATE}", {"step": step})
    assert layout.checkpoints() == [3, 6] and layout.latest_checkpoint() == 6
    assert layout.prune_checkpoints(1) == [3] and layout.checkpoints() == [6]

    store = WeightStore(layout.weights, storage_options=storage_options)
    for v in (2, 4, 6):
        store.publish(v, state_dict(float(v)))
    assert store.rollback(2) == [6, 4]
    assert store.versions() == [2] and store._read_latest_hint() == 2
    store.publish(4, state_dict(40.0))
    assert store.latest() == 4


def test_a_fully_async_run_survives_an_s3_outage_longer_than_a_request_retry(prefect_backend, tiny_model_dir,
                                                                            local_s3, tmp_path):
    """The S3 endpoint (behind a proxy that cuts the line, its state kept) goes away for 30 s in the
    middle of a fully-async run: the trainer and its producer process both wait it out
    (``storage.max_outage_s``, 120 s by default; one request's retries alone give up after 10 s)
    and the run completes with every step, every prompt of the log written or given back."""
    from doubles.tcp_proxy import TcpProxy
    from flows.train import train
    from miles_core.config import RunConfig

    bucket = local_s3.make_bucket(f"outage-{uuid.uuid4().hex[:8]}")
    proxy = TcpProxy(local_s3.port)
    through_proxy = {**local_s3.storage_options, "endpoint_url": proxy.url}
    cfg = RunConfig.model_validate({
        "name": "outage", "mode": "fully_async", "run_id": "outage",
        "model": {"path": str(tiny_model_dir)},
        "data": {"type": "toy", "num_prompts": 512},
        "rollout": {"num_rollout": 12, "rollout_batch_size": 4, "n_samples_per_prompt": 2,
                    "rollout_max_response_len": 3},
        "train": {"global_batch_size": 8, "micro_batch_size": 8},
        "eval": {"eval_interval": None, "num_prompts": 4},
        "storage": {"root": f"{bucket}/runs", "storage_options": through_proxy},
    })
    import s3fs

    direct = s3fs.S3FileSystem(**local_s3.storage_options)  # the test's own view, not through the proxy
    metrics = f"{bucket.removeprefix('s3://')}/runs/outage/outage/metrics.jsonl"
    witness: dict[str, int] = {}

    def steps() -> int:
        return len(direct.cat_file(metrics).decode().splitlines()) if direct.exists(metrics) else 0

    def outage():
        wait_for(lambda: steps() >= 3, 300, "three steps", poll=0.2)
        witness["cut_at_step"] = steps()
        proxy.cut()
        time.sleep(30)
        witness["restored_at_step"] = steps()
        proxy.restore()

    cutter = threading.Thread(target=outage, daemon=True)
    cutter.start()
    try:
        state = train(cfg, return_state=True)
    finally:
        cutter.join(timeout=30)
        proxy.close()
    assert state.is_completed(), state
    assert 3 <= witness["cut_at_step"] < 12 and witness["restored_at_step"] == witness["cut_at_step"], witness
    assert [json.loads(line)["step"] for line in direct.cat_file(metrics).decode().splitlines()] == list(range(1, 13))
    audit = state.result()["audit"]  # read back through the endpoint: every prompt trained once or accounted for
    assert audit["ok"] and audit["counts"]["trained"] == 12 * 4 and audit["token_balance"] == 0, audit


def test_a_bucket_gone_mid_run_fails_naming_the_bucket_the_endpoint_and_the_object(prefect_backend, tiny_model_dir,
                                                                                  restartable_s3):
    """The endpoint restarts without its data (moto keeps none) while a run writes to it: the run
    fails at once, naming the bucket, the endpoint and the object it was at, and what to check."""
    from flows.train import train
    from miles_core.config import RunConfig

    s3 = restartable_s3
    bucket = s3.make_bucket("gone-bkt")
    cfg = RunConfig.model_validate({
        "name": "gone", "run_id": "gone", "model": {"path": str(tiny_model_dir)},
        "data": {"type": "toy", "num_prompts": 512},
        "rollout": {"num_rollout": 300, "rollout_batch_size": 4, "n_samples_per_prompt": 2,
                    "rollout_max_response_len": 3},
        "train": {"global_batch_size": 8, "micro_batch_size": 8},
        "eval": {"eval_interval": None, "num_prompts": 4, "skip_eval_before_train": True},
        "storage": {"root": f"{bucket}/runs", "storage_options": s3.storage_options},
    })
    import s3fs

    direct = s3fs.S3FileSystem(**s3.storage_options)
    metrics = "gone-bkt/runs/gone/gone/metrics.jsonl"
    witness: dict[str, int] = {}

    def wipe():
        def two_steps() -> bool:
            direct.invalidate_cache()
            return direct.exists(metrics) and len(direct.cat_file(metrics).splitlines()) >= 2

        wait_for(two_steps, 300, "two steps", poll=0.2)
        witness["steps"] = len(direct.cat_file(metrics).splitlines())
        s3.restart()

    wiper = threading.Thread(target=wipe, daemon=True)
    wiper.start()
    started = time.monotonic()
    state = train(cfg, return_state=True)
    wiper.join(timeout=30)
    assert witness["steps"] >= 2 and state.is_failed(), (witness, state)
    with pytest.raises(FileNotFoundError) as info:
        state.result()
    message = str(info.value)
    assert "bucket 'gone-bkt' does not exist on storage endpoint " + s3.endpoint in message, message
    assert "s3://gone-bkt/runs/gone/gone/" in message and "restarted without its data" in message, message
    assert time.monotonic() - started < 120
