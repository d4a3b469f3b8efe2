"""The standalone evaluation flow over finished runs: a plain run's newest or a given version, and
every adapter of a multi-LoRA run. Evaluating the version the run itself evaluated last gives the
same numbers (greedy, the same held-out prompts); the history grows; the run's own files stay."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_train_flow import _tiny_run

pytestmark = pytest.mark.integration


def test_evaluate_a_run_newest_and_given_version(prefect_backend, tiny_model_dir, tmp_path):
    from flows.evaluate import evaluate_run
    from flows.train import train
    from miles_core.eval.standalone import read_history
    from miles_core.storage import WeightStore

    summary = train(_tiny_run(tmp_path, tiny_model_dir))
    run_dir = summary["run_dir"]
    in_run = (Path(run_dir) / "eval.jsonl").read_text()

    [newest] = evaluate_run(run_dir)
    assert (newest["version"], newest["step"], newest["adapter"]) == (6, 3, None)
    assert newest["accuracy"] == summary["accuracy_after"], "the same version, prompts and greedy decoding"
    [older] = evaluate_run(run_dir, version=2)
    assert (older["version"], older["step"]) == (2, 1)

    history = read_history(run_dir)
    assert [(r["version"], r["step"]) for r in history] == [(6, 3), (2, 1)]
    assert (Path(run_dir) / "eval.jsonl").read_text() == in_run, "the in-run history is left as it is"
    assert WeightStore(str(Path(run_dir) / "weights")).pins() == {}
    state = evaluate_run(run_dir, version=9, return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match="version 9 is not published"):
        state.result()
    name, run_id = Path(run_dir).parent.name, Path(run_dir).name
    assert _flow_run(state).name == f"evaluate {name}/{run_id}"  # named after the run, not its whole path

    # what a scheduled evaluation does (only_new): the newest version was evaluated: nothing, no error
    assert evaluate_run(run_dir, only_new=True) == []
    assert evaluate_run(str(Path(run_dir).parent), only_new=True) == []  # the name's newest run: the same one
    assert len(read_history(run_dir)) == 2
    assert evaluate_run(str(tmp_path / "no-runs-yet"), only_new=True) == []  # nothing to evaluate yet: one line
    with pytest.raises(FileNotFoundError):
        evaluate_run(str(tmp_path / "no-runs-yet"))  # asked for by hand: an error


def test_miles_evaluate_prints_the_versions_accuracy(prefect_backend, tiny_model_dir, tmp_path):
    import json
    import os
    import subprocess
    import sys

    from flows.train import train

    summary = train(_tiny_run(tmp_path, tiny_model_dir))
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"q": f"{i}+1=", "a": str(i + 1)}) + "\n" for i in range(3)))
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PREFECT_API_URL": prefect_backend}  # the test's server (the harness sets it in-process only)
    out = subprocess.run([sys.executable, "-m", "deployments.cli", "evaluate", summary["run_dir"], "--version", "4",
                          "--eval-prompt-data", "qa", str(qa), "--eval-input-key", "q", "--eval-label-key", "a"],
                         cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    header, row = out.stdout.strip().splitlines()[-2:]
    assert header.split() == ["adapter", "version", "step", "accuracy", "qa/accuracy"]
    assert row.split()[:3] == ["-", "4", "2"], out.stdout
    bad = subprocess.run([sys.executable, "-m", "deployments.cli", "evaluate", str(tmp_path / "nope")], cwd=repo,
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "error: cannot evaluate" in bad.stderr


def _flow_run(state):
    import asyncio

    from prefect.client.orchestration import get_client

    async def read():
        async with get_client() as client:
            return await client.read_flow_run(state.state_details.flow_run_id)

    return asyncio.run(read())


def test_evaluate_every_adapter_of_a_multi_lora_run(prefect_backend, demo_model, tmp_path):
    from test_multi_lora_flow import LORA
    from test_modes import _run_cfg

    from flows.evaluate import evaluate_run
    from flows.multi_lora import train_multi_lora

    cfg = _run_cfg(tmp_path, demo_model, "fully_async", lora=LORA, rollout={"num_rollout": 2},
                   eval={"eval_interval": None, "num_prompts": 32},
                   multi_lora={"adapters": [{"name": "fast", "train": {"lr": 3e-3}}, {"name": "slow", "train": {"lr": 1e-4}}]})
    summary = train_multi_lora(cfg)
    rows = evaluate_run(summary["run_dir"])
    by_adapter = {r["adapter"]: r for r in rows}
    assert set(by_adapter) == {"fast", "slow"}
    for adapter in summary["adapters"]:
        row = by_adapter[adapter["name"]]
        assert row["version"] == adapter["final_version"] == 2
        assert row["accuracy"] == adapter["accuracy_after"], adapter["name"]


def test_evaluate_a_run_on_named_datasets_of_its_own(prefect_backend, tiny_model_dir, tmp_path):
    """A scheduled evaluation on a new benchmark: ``datasets`` (dicts, validated) instead of the run's
    own held-out prompts; the rows are wide, and so are the history and its table artifact."""
    import asyncio
    import json

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.exceptions import ParameterTypeError

    from flows.evaluate import evaluate_run
    from flows.train import train
    from miles_core.eval.standalone import read_history

    summary = train(_tiny_run(tmp_path, tiny_model_dir))
    run_dir = summary["run_dir"]
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(3)))
    datasets = [
        {"name": "toy", "data": {"type": "toy"}},  # the run's own held-out problems, with its eval settings
        {"name": "qa", "data": {"type": "file", "path": str(qa), "input_key": "question", "label_key": "answer"},
         "n_samples_per_prompt": 2, "temperature": 1.0},
    ]
    state = evaluate_run(run_dir, datasets=datasets, return_state=True)
    [row] = state.result()
    # the same version, prompts and settings as the run's last evaluation; the first dataset is the headline
    last = json.loads((Path(run_dir) / "eval.jsonl").read_text().splitlines()[-1])
    metrics = [k for k in last if k not in ("step", "eval_seconds", "weight_version")]
    assert {k: row[f"toy/{k}"] for k in metrics} == {k: row[k] for k in metrics} == {k: last[k] for k in metrics}
    assert (row["toy/num_prompts"], row["qa/num_prompts"], row["version"]) == (8, 3, 6)
    assert "qa/pass@2" in row and "toy/pass@2" not in row
    [own] = evaluate_run(run_dir)
    assert not [k for k in own if "/" in k], "the run's own single dataset: plain keys, as before"

    history = read_history(run_dir)
    assert [r["qa/accuracy"] is not None for r in history] == [True, False]

    async def artifacts():
        async with get_client() as client:
            found = await client.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
            return {a.type: a.data for a in found}

    by_type = asyncio.run(artifacts())
    assert sorted(by_type) == ["image", "table"]  # the history, and its trend as an image
    assert by_type["image"].startswith("data:image/png;base64,")
    data = by_type["table"]
    rows = json.loads(data) if isinstance(data, str) else data
    assert rows[0]["qa/accuracy"] == row["qa/accuracy"] and rows[0]["toy/accuracy"] == row["toy/accuracy"]

    with pytest.raises(ParameterTypeError, match="eval dataset name 'bad name'"):
        evaluate_run(run_dir, datasets=[{"name": "bad name", "data": {"type": "toy"}}])
