"""The Python API (``deployments.api``) against a real Prefect backend, on a tiny model.

In process: ``start_run`` returns while the run goes on, the handle follows it through the API,
``wait`` returns the summary (or raises RunFailed naming the flow's error), ``metrics`` reads the
run folder. Runs on served deployments, and their cancellation, are in test_serve.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_train_flow import _tiny_run

pytestmark = pytest.mark.integration


def _cfg(tmp_path: Path, model_dir: Path, **overrides):
    return _tiny_run(tmp_path, model_dir, **{"name": "api-test", "eval": {"eval_interval": 2, "num_prompts": 4},
                                             **overrides})


def test_in_process_run_is_followed_through_the_api(prefect_backend, tiny_model_dir, tmp_path, monkeypatch):
    from deployments import api

    cfg = _cfg(tmp_path, tiny_model_dir)
    t0 = time.monotonic()
    run = api.start_run(cfg)
    started_s = time.monotonic() - t0
    assert run.status() in ("PENDING", "RUNNING"), "start_run should return while the run goes on"
    assert started_s < 10, f"start_run took {started_s:.1f} s"
    assert run.run_id and run.run_dir == str(tmp_path / "runs" / "api-test" / run.run_id)
    assert cfg.run_id is None, "the caller's config is not changed"

    summary = run.wait(timeout=300)
    assert run.status() == "COMPLETED"
    assert summary["run_id"] == run.run_id and summary["run_dir"] == run.run_dir
    assert summary["steps"] == 3 and summary["final_version"] == 6
    assert [r["step"] for r in run.metrics()] == [1, 2, 3]
    assert [e["step"] for e in run.evals()] == [0, 2, 3]
    assert run.wait() is summary  # a finished handle keeps its summary
    # evaluate the finished run again (the standalone flow): the numbers of its last evaluation
    [row] = run.evaluate()
    assert row["version"] == 6 and row["accuracy"] == run.evals()[-1]["accuracy"]
    assert run.evaluate(version=2)[0]["step"] == 1
    [named] = run.evaluate(datasets=[{"name": "more-toy", "data": {"type": "toy", "seed": 7}, "num_prompts": 6}])
    assert named["more-toy/num_prompts"] == 6 and named["version"] == 6
    # the top-level module: evaluate a run by its handle, its flow run id or its folder
    import miles

    by_id, by_folder = miles.evaluate(str(run.id), version=4), miles.evaluate(run.run_dir, version=4)
    assert by_id[0]["version"] == by_folder[0]["version"] == 4
    assert by_id[0]["accuracy"] == by_folder[0]["accuracy"] == run.evals()[1]["accuracy"]  # step 2 made v4
    with pytest.raises(miles.RunFailed, match="version 9 is not published") as info:
        miles.evaluate(run, version=9)
    assert isinstance(info.value.__cause__, ValueError)

    assert api.get_run(run.id) is run  # this process's own handle
    monkeypatch.setattr(api, "_LOCAL_RUNS", {})  # as another process would see it: from the API only
    again = api.get_run(str(run.id))
    assert (again.id, again.run_id, again.run_dir, again.in_process) == (run.id, run.run_id, run.run_dir, True)
    from_disk = again.wait(timeout=10)  # the run's summary.json
    assert {k: from_disk[k] for k in ("run_id", "final_version", "accuracy_after")} == \
           {k: summary[k] for k in ("run_id", "final_version", "accuracy_after")}
    assert again.metrics() == run.metrics()
    with pytest.raises(RuntimeError, match="deployment="):
        again.cancel()


def test_a_failing_run_raises_run_failed_with_the_flows_error(prefect_backend, tiny_model_dir, tmp_path):
    from deployments.api import RunFailed, start_run

    missing = tmp_path / "nope.jsonl"
    cfg = _cfg(tmp_path, tiny_model_dir, data={"type": "file", "path": str(missing)},
               eval={"data": {"type": "file", "path": str(missing)}, "num_prompts": 4})
    with pytest.raises(RunFailed, match="nope.jsonl") as info:
        start_run(cfg, wait=True, timeout=120)
    assert info.value.state.is_failed()
    assert isinstance(info.value.__cause__, FileNotFoundError)
