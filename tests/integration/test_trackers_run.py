"""Experiment trackers on a real run: ``miles train --use-wandb --wandb-mode offline --use-tensorboard
--use-mlflow`` (no network: W&B offline writes its run file, MLflow a local SQLite store), then each
tracker's own files are read back with its own reader (TensorBoard's ``EventAccumulator``, MLflow's
client, W&B's record protocol) and hold the run's ``metrics.jsonl`` and ``eval.jsonl`` numbers under
the same names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def wandb_history(path: Path) -> list[dict]:
    """The history rows of a W&B run file (``run-<id>.wandb``): a LevelDB-style log of ``Record``
    protobufs (7-byte file header, then 32 KiB blocks of chunks: crc32 4, length 2, type 1)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, chunk, rows = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_a_run_logs_the_same_metrics_to_wandb_tensorboard_and_mlflow(tiny_model_dir, tmp_path):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "WANDB_SILENT": "true"}
    for name in ("PREFECT_API_URL", "WANDB_MODE", "MLFLOW_TRACKING_URI", "WANDB_API_KEY"):
        env.pop(name, None)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = subprocess.run(
        [sys.executable, "-m", "deployments.cli", "train", "--name", "tracked", "--hf-checkpoint", str(tiny_model_dir),
         "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
         "--rollout-max-response-len", "4", "--global-batch-size", "8", "--micro-batch-size", "4",
         "--eval-interval", "2", "--eval-num-prompts", "8", "--storage-root", str(tmp_path / "runs"),
         "--use-wandb", "--wandb-mode", "offline", "--wandb-project", "trackers-test",
         "--use-tensorboard", "--use-mlflow", "--mlflow-tracking-uri", store, "--mlflow-experiment-name", "tests"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    [run_dir] = (tmp_path / "runs" / "tracked").iterdir()
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2, 3] and [e["step"] for e in evals] == [0, 2, 3]
    expected = {("reward_mean", r["step"]): r["reward_mean"] for r in steps}
    expected |= {("loss", r["step"]): r["loss"] for r in steps}
    expected |= {("eval/accuracy", e["step"]): e["accuracy"] for e in evals}
    expected |= {("eval/pass@1", e["step"]): e["pass@1"] for e in evals}

    # TensorBoard: event files in the run folder, read by TensorBoard's own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir / "tensorboard"))
    board.Reload()
    assert set(board.Tags()["scalars"]) >= {"reward_mean", "loss", "grad_norm", "eval/accuracy", "eval/pass@1"}
    for (name, step), value in expected.items():
        assert {e.step: e.value for e in board.Scalars(name)}[step] == pytest.approx(value, rel=1e-6), (name, step)

    # MLflow: the local store, read back through MLflow's client; the run is found by its run id
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("tests")
    [run] = client.search_runs([experiment.experiment_id],
                               filter_string=f"tags.`miles.run_id` = '{run_dir.name}'")
    assert run.info.status == "FINISHED" and run.info.run_name == f"tracked-{run_dir.name}"
    assert run.data.params["rollout.rollout_batch_size"] == "4"
    for (name, step), value in expected.items():
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name.replace("@", "_at_"))}
        assert history[step] == pytest.approx(value, rel=1e-6), (name, step)

    # W&B offline: one run file under the run folder's wandb/, its id the run id, never uploaded
    [run_file] = (run_dir / "wandb").glob(f"offline-run-*/run-{run_dir.name}.wandb")
    logged = {}
    for row in wandb_history(run_file):
        for name, value in row.items():
            if name != "step" and not name.startswith("_"):
                logged[(name, row["step"])] = value
    for (name, step), value in expected.items():
        assert logged[(name, step)] == pytest.approx(value, rel=1e-6), (name, step)
    # quiet: no tracker banners in the run's output
    assert "wandb:" not in out.stdout + out.stderr and "Creating initial MLflow" not in out.stderr, out.stderr[-2000:]
