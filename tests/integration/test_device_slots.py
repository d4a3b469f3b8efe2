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

    held, asked, lock = [], set(), threading.Lock()
    both_started = threading.Barrier(2, timeout=120)

    @contextlib.contextmanager
    def recorded(cfg, phase):  # when the slots are really held: after acquiring, before releasing
        with lock:
            first = cfg.name not in asked
            asked.add(cfg.name)
        if first:  # both runs ask for the slot before either takes it: they contend from the start
            both_started.wait()
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
    # the barrier makes the two runs contend for the one slot from their first phase on; what is
    # checked is that they never held it at once (which one gets it next is the limit's business:
    # a run that releases and asks again may well get it back first)
    for (_, end, name), (next_start, _, next_name) in zip(spans, spans[1:]):
        assert end <= next_start, f"{name} and {next_name} held the one slot at once"


def test_two_fully_async_runs_on_a_pool_for_one_take_turns_instead_of_deadlocking(prefect_backend, tiny_model_dir,
                                                                                 tmp_path, monkeypatch):
    """Each run needs 2 slots (its producer's and its trainer's) and the pool has 2. Were a producer
    to take its slot alone, both producers would run and both trainers would wait forever; the
    run takes both at once, so one run goes after the other."""
    import contextlib
    import threading
    import time

    import flows.train
    from deployments.serve import ensure_device_pools
    from tasks.slots import run_slots

    held, lock = [], threading.Lock()

    @contextlib.contextmanager
    def recorded(cfg):
        with run_slots(cfg):
            start = time.monotonic()
            try:
                yield
            finally:
                with lock:
                    held.append((start, time.monotonic(), cfg.name))

    monkeypatch.setattr(flows.train, "run_slots", recorded)
    ensure_device_pools({"two-devices": 2})
    cfgs = [_tiny_run(tmp_path / f"run{i}", tiny_model_dir, name=f"fa-{i}", mode="fully_async",
                      resources={"pool": "two-devices"}, eval={"eval_interval": None, "num_prompts": 4, "engine": "shared"},
                      rollout={"num_rollout": 6, "rollout_batch_size": 4, "n_samples_per_prompt": 4,
                               "rollout_max_response_len": 4})
            for i in range(2)]
    states = {}
    # daemon threads: if the runs deadlock, the test fails here and the process can still exit
    threads = [threading.Thread(target=contextvars.copy_context().run, daemon=True,
                                args=(lambda c=cfg: states.__setitem__(c.name, flows.train.train(c, return_state=True)),))
               for cfg in cfgs]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 240
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"the two runs waited for each other's slots (deadlock): held {held}"
    states = list(states.values())
    assert all(s.is_completed() for s in states), states
    (a0, b0, n0), (a1, b1, n1) = sorted(held)
    assert {n0, n1} == {"fa-0", "fa-1"}
    assert b0 <= a1, f"{n0} and {n1} held the pool's 2 slots at once: {held}"


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
    with pytest.raises(RuntimeError, match=r"has 1 slots, but this run needs 3 at once \(its rollout and training "
                                           r"slots for its whole length, plus an evaluation's on its separate engine\)"):
        state.result()
    assert not (tmp_path / "runs").exists(), "nothing ran"
