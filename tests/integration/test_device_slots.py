"""Device slots: two runs at once on one Prefect server, drawing from a global concurrency limit of
one slot, never hold it at the same time (their rollout, training and evaluation tasks take turns
across the two runs); a run naming a pool the server does not have fails at once, saying how to
create it."""

from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_train_flow import _tiny_run

pytestmark = pytest.mark.integration


def test_two_runs_share_one_device_slot(prefect_backend, tiny_model_dir, tmp_path, monkeypatch):
    import contextlib
    import threading
    import time

    import tasks.train
    from deployments.serve import ensure_device_pools
    from flows.train import train
    from tasks.slots import device_slots

    held, lock = [], threading.Lock()

    @contextlib.contextmanager
    def recorded(cfg, phase):  # when the slots are really held: after acquiring, before releasing
        with device_slots(cfg, phase):
            start = time.monotonic()
            try:
                yield
            finally:
                with lock:
                    held.append((start, time.monotonic(), f"{cfg.name}:{phase}"))

    monkeypatch.setattr(tasks.train, "device_slots", recorded)

    ensure_device_pools({"test-device": 1})
    steps = 8  # long enough for the two runs to be under way at the same time
    cfgs = [_tiny_run(tmp_path / f"run{i}", tiny_model_dir, name=f"slots-{i}", resources={"pool": "test-device"},
                      rollout={"num_rollout": steps, "rollout_batch_size": 4, "n_samples_per_prompt": 4,
                               "rollout_max_response_len": 4},
                      eval={"eval_interval": None, "num_prompts": 4, "engine": "shared"})
            for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(contextvars.copy_context().run, train, cfg, return_state=True) for cfg in cfgs]
        states = [f.result() for f in futures]
    assert all(s.is_completed() for s in states), states
    spans = sorted(held)
    assert len(spans) == 2 * (steps + steps + 2), spans  # per run: rollouts, train steps, 2 evaluations
    window = {run: (min(a for a, _, n in spans if n.startswith(run)), max(b for _, b, n in spans if n.startswith(run)))
              for run in ("slots-0", "slots-1")}
    (a0, b0), (a1, b1) = window.values()
    assert a0 < b1 and a1 < b0, f"the two runs did not run at the same time: {window}"
    interleaved = sum(x[2].split(":")[0] != y[2].split(":")[0] for x, y in zip(spans, spans[1:]))
    assert interleaved >= 2, "the slot passed between the runs"
    for (_, end, name), (next_start, _, next_name) in zip(spans, spans[1:]):
        assert end <= next_start, f"{name} and {next_name} held the one slot at once"


def test_a_missing_device_pool_fails_the_run_with_how_to_create_it(prefect_backend, tiny_model_dir, tmp_path):
    from flows.train import train

    cfg = _tiny_run(tmp_path, tiny_model_dir, resources={"pool": "no-such-pool"})
    state = train(cfg, return_state=True)
    assert state.is_failed()
    with pytest.raises(RuntimeError, match="miles serve --device-slots no-such-pool=N"):
        state.result()


def test_a_pool_too_small_for_a_fully_async_run_is_refused_before_any_work(prefect_backend, tiny_model_dir, tmp_path):
    from deployments.serve import ensure_device_pools
    from flows.train import train

    ensure_device_pools({"one-device": 1})
    cfg = _tiny_run(tmp_path, tiny_model_dir, mode="fully_async", resources={"pool": "one-device"})
    state = train(cfg, return_state=True)
    assert state.is_failed()
    with pytest.raises(RuntimeError, match="has 1 slots, but this run needs 2 at once"):
        state.result()
    assert not (tmp_path / "runs").exists(), "nothing ran"
