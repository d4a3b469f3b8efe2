"""Experiment trackers (miles_core/trackers.py): which numbers go, under which names, and what a
missing package says. TensorBoard's event files are read back with TensorBoard's own reader; W&B
and MLflow are read back after a real run in tests/integration/test_trackers_run.py."""

from __future__ import annotations

import sys

import pytest

from miles_core.config import RunConfig
from miles_core.trackers import Trackers, TrackerMissing, mlflow_name, numbers, open_trackers


def test_only_finite_numbers_go_under_the_files_names():
    row = {"step": 3, "reward_mean": 0.5, "version": 6, "pass@1": 0.25, "note": "x", "loss": float("nan"),
           "truncated": True, "kl": float("inf")}
    assert numbers(row) == {"reward_mean": 0.5, "version": 6.0, "pass@1": 0.25, "truncated": 1.0}
    assert numbers({"accuracy": 0.5}, "eval/") == {"eval/accuracy": 0.5}
    assert mlflow_name("eval/pass@4") == "eval/pass_at_4" and mlflow_name("reward_mean") == "reward_mean"


def test_no_tracker_costs_nothing():
    trackers = open_trackers(RunConfig(), "r1", "runs/x/r1")
    assert not trackers
    trackers.log({"reward_mean": 1.0}, 1)
    trackers.close(ok=True)


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    cfg = RunConfig(tracking={"wandb": True})
    with pytest.raises(TrackerMissing, match=r"tracking.wandb is on, but 'wandb' is not installed .*"
                                             r"pip install 'miles-prefect\[trackers\]'"):
        open_trackers(cfg, "r1", "runs/x/r1")


def test_tensorboard_event_files_hold_every_row_at_its_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from miles_core.session.history import RunHistory
    from miles_core.storage.layout import RunLayout

    run_dir = tmp_path / "runs" / "x" / "r1"
    trackers = open_trackers(RunConfig(tracking={"tensorboard": True}), "r1", str(run_dir))
    history = RunHistory(RunLayout(str(tmp_path / "runs"), "x", "r1"), trackers)
    history.record(1, {"reward_mean": 0.25, "loss": 0.5})
    history.record(2, {"reward_mean": 0.75, "loss": 0.25})
    history.add_eval({"step": 2, "accuracy": 0.5, "pass@1": 0.5})
    history.add_eval({"step": 0, "accuracy": 0.125})  # evaluations may finish late
    trackers.close(ok=True)
    trackers.close(ok=True)  # once only
    board = EventAccumulator(str(run_dir / "tensorboard"))
    board.Reload()
    scalars = {tag: {e.step: e.value for e in board.Scalars(tag)} for tag in board.Tags()["scalars"]}
    assert scalars == {"reward_mean": {1: 0.25, 2: 0.75}, "loss": {1: 0.5, 2: 0.25},
                       "eval/accuracy": {2: 0.5, 0: 0.125}, "eval/pass@1": {2: 0.5}}


def test_a_closed_tracker_set_logs_nothing_more():
    seen = []

    class Recorder:
        def log(self, metrics, step):
            seen.append((step, metrics))

        def close(self, ok):
            seen.append(("closed", ok))

    trackers = Trackers([Recorder()])
    trackers.log({"step": 1, "a": 1.0}, 1, "x/")
    trackers.close(ok=False)
    trackers.log({"a": 2.0}, 2)
    assert seen == [(1, {"x/a": 1.0}), ("closed", False)]
