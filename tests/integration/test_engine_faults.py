"""A frozen engine server (SIGSTOP of the CPU stand-in server, then SIGCONT), in a real run: the
wait is named within seconds, a server that comes back is used again (a weight push cut off by the
freeze is sent again), and one that never comes back ends the run naming its URL."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from waiting import wait_for

pytestmark = pytest.mark.integration


def _cfg(tmp_path: Path, model_dir, mode: str = "sync", **engine):
    from miles_core.config import RunConfig

    return RunConfig.model_validate({
        "name": "frozen", "run_id": "frozen", "model": {"path": str(model_dir)}, "mode": {"type": mode},
        "data": {"type": "toy", "num_prompts": 256},
        "rollout": {"num_rollout": 8, "rollout_batch_size": 4, "n_samples_per_prompt": 2,
                    "rollout_max_response_len": 3},
        "train": {"global_batch_size": 8, "micro_batch_size": 8},
        "engine": {"type": "sglang", "num_threads": 1, "health_warn_s": 1.0, "health_timeout_s": 6.0, **engine},
        "eval": {"eval_interval": None, "num_prompts": 4, "skip_eval_before_train": True},
        "storage": {"root": str(tmp_path / "runs")},
    })


def _server() -> psutil.Process:
    (server,) = [p for p in psutil.Process().children(recursive=True)
                 if "miles_core.engines.server" in " ".join(p.cmdline())]
    return server


def _steps(tmp_path: Path) -> int:
    metrics = tmp_path / "runs" / "frozen" / "frozen" / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


class _Logged(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


def _freeze(tmp_path: Path, after_steps: int, seconds: float | None, witness: dict) -> threading.Thread:
    def run() -> None:
        wait_for(lambda: _steps(tmp_path) >= after_steps, 300, f"{after_steps} steps", poll=0.05)
        server = _server()
        witness["frozen_at_step"], witness["server"] = _steps(tmp_path), server
        server.send_signal(signal.SIGSTOP)
        if seconds is None:
            return
        time.sleep(seconds)
        witness["steps_while_frozen"] = _steps(tmp_path) - witness["frozen_at_step"]
        server.send_signal(signal.SIGCONT)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_an_engine_frozen_for_longer_than_a_request_comes_back_and_the_run_completes(prefect_backend, tiny_model_dir,
                                                                                  tmp_path):
    from flows.train import train

    logged = _Logged()
    logging.getLogger("miles_core").addHandler(logged)
    witness: dict = {}
    try:
        freezer = _freeze(tmp_path, 2, 9.0, witness)
        state = train(_cfg(tmp_path, tiny_model_dir), return_state=True)
        freezer.join(30)
    finally:
        logging.getLogger("miles_core").removeHandler(logged)
    assert witness["steps_while_frozen"] == 0, witness
    assert state.is_completed(), state
    assert _steps(tmp_path) == 8
    # the wait was named within about a second (health_warn_s), and what it cut off was sent again
    # (the rollout's requests or the weight push: whichever the freeze caught)
    waits = [m for m in logged.messages if m.startswith("the engine server at http://127.0.0.1:")]
    assert waits and "has not answered" in waits[0], logged.messages[-20:]
    assert any("sending them once more" in m or "sending it again (attempt 2 of 3)" in m
               for m in logged.messages), logged.messages[-20:]


def test_a_weight_push_cut_off_by_a_freeze_is_sent_again(tiny_model_dir, caplog):
    """The server is frozen while a push waits on it, longer than its keep-alive (5 s): the wait
    is named, and when it comes back the push lands (sent again if the server reset its
    connection, as uvicorn does here)."""
    import asyncio

    from miles_core.config import SGLangEngineConfig
    from miles_core.engines import setup_engine

    engine = setup_engine(SGLangEngineConfig(num_threads=1, health_warn_s=1.0, health_timeout_s=4.0),
                          str(tiny_model_dir), "float32", seed=0)
    server = psutil.Process(engine.server.proc.pid)
    try:
        asyncio.run(engine.health())  # a kept-alive connection, as a run's has
        server.send_signal(signal.SIGSTOP)
        threading.Timer(7.0, server.send_signal, args=(signal.SIGCONT,)).start()
        with caplog.at_level(logging.WARNING, logger="miles_core.engines.http"):
            asyncio.run(engine.update_weights(str(Path(tiny_model_dir) / "model.safetensors"), 1))
        assert engine.weight_version == 1
        said = [r.getMessage() for r in caplog.records]
        assert any("has not answered /update_weights_from_disk" in m for m in said), said
        # how the server's side ends the cut-off call (a reset, or an answer once it runs again) is up
        # to its event loop: either way the push lands
    finally:
        server.send_signal(signal.SIGCONT)
        asyncio.run(engine.close())


def test_an_engine_that_never_comes_back_ends_the_run_naming_its_url(prefect_backend, tiny_model_dir, tmp_path):
    from flows.train import train

    witness: dict = {}
    freezer = _freeze(tmp_path, 2, None, witness)
    started = time.monotonic()
    state = train(_cfg(tmp_path, tiny_model_dir, request_timeout_s=3.0), return_state=True)
    freezer.join(30)
    assert state.is_failed() and witness["frozen_at_step"] >= 2, (state, witness)
    assert time.monotonic() - started < 120
    with pytest.raises(ConnectionError, match=r"http://127\.0\.0\.1:\d+/\S+: no answer"):
        state.result()
    assert not [p for p in psutil.Process().children(recursive=True)
                if "miles_core.engines.server" in " ".join(p.cmdline())], "the frozen server was stopped"


def test_a_fully_async_producer_whose_engine_froze_for_good_is_replaced(prefect_backend, tiny_model_dir, tmp_path):
    """The producer's engine server never answers again: the producer is declared dead (it stops
    naming its engine, or stops beating while a push waits), and the fleet launches a replacement
    (with an engine of its own) that carries the run to its end, losing no prompt."""
    from flows.train import train

    # a weight push to the frozen server waits out its own deadline (the server counts as alive while
    # it may be loading): request_timeout_s bounds it at 20 s instead of ~190 s
    cfg = _cfg(tmp_path, tiny_model_dir, "fully_async", health_timeout_s=3.0, request_timeout_s=20.0)
    witness: dict = {}
    freezer = _freeze(tmp_path, 2, None, witness)
    try:
        state = train(cfg, return_state=True)
        freezer.join(30)
        # the dead producer was killed with the engine server it started (frozen, that server could
        # not notice its parent's death by itself)
        server = witness["server"]
        wait_for(lambda: not server.is_running() or server.status() == psutil.STATUS_ZOMBIE, 30,
                 f"the frozen engine server {server.pid} of the dead producer to be gone")
    finally:
        if "server" in witness and witness["server"].is_running():
            witness["server"].kill()
    assert state.is_completed(), state
    assert witness["frozen_at_step"] >= 2 and _steps(tmp_path) == 8
    from miles_core.rollout.fleet import ControlPlane

    run_dir = tmp_path / "runs" / "frozen" / "frozen"
    beat = json.loads((run_dir / "fleet" / "producers" / "p0.json").read_text())
    # p0 stopped naming its engine (its requests' retries ran out, or a weight push or abort got no
    # sign of life from the server; it keeps beating meanwhile): it was fenced, and p1 took its place
    assert ControlPlane(str(run_dir)).fence_of("p0") is not None, beat
    assert beat["status"] != "failed" or any(
        why in beat["error"] for why in ("its engine did not answer", "gave no sign of life")), beat
    assert (run_dir / "fleet" / "producers" / "p1.json").exists()
    assert state.result()["audit"]["ok"], state.result()["audit"]
