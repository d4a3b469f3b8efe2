"""The sync train flow end to end under a real (session-scoped) Prefect backend, on a tiny model."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest
from serving import task_graph, task_runs

pytestmark = pytest.mark.integration


def _tiny_run(tmp_path: Path, model_dir: Path, **overrides):
    from miles_core.config import RunConfig

    raw = {
        "name": "flow-test",
        "model": {"path": str(model_dir)},
        "data": {"type": "toy", "num_prompts": 64},
        "rollout": {"num_rollout": 3, "rollout_batch_size": 4, "n_samples_per_prompt": 4, "rollout_max_response_len": 4},
        "train": {"global_batch_size": 8, "micro_batch_size": 4, "lr": 1e-3},
        "eval": {"eval_interval": 2, "num_prompts": 8},
        "storage": {"root": str(tmp_path / "runs")},
    }
    raw.update(overrides)
    return RunConfig.model_validate(raw)


def test_sync_flow_completes_and_lands_everything(prefect_backend, tiny_model_dir, tmp_path):
    from prefect.client.orchestration import get_client

    from flows.train import train

    cfg = _tiny_run(tmp_path, tiny_model_dir)
    state = train(cfg, return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    run_dir = Path(summary["run_dir"])

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # 16 samples per rollout, global batch 8: two optimizer steps per rollout, versions 2, 4, 6
    assert [r["version"] for r in rows] == [2, 4, 6]
    for key in ("reward_mean", "accuracy", "response_len_mean", "truncated_ratio", "loss", "kl", "grad_norm",
                "rollout_seconds", "train_seconds", "push_seconds", "rollout_tokens_per_s"):
        assert key in rows[0], key
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 3] and evals[-1]["weight_version"] == 6
    assert summary["final_version"] == 6 and summary["accuracy_before"] is not None
    assert len(list((run_dir / "samples" / "rollout").glob("*.arrow"))) == 3
    assert json.loads((run_dir / "config.json").read_text())["name"] == "flow-test"

    import asyncio

    async def artifacts():
        async with get_client() as client:
            flow_run = await client.read_flow_run(state.state_details.flow_run_id)
            from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

            found = await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
            )
            return found

    found = asyncio.run(artifacts())
    assert {a.type for a in found} >= {"progress", "table", "markdown", "image"}
    # the UI's live view: one key per run, its latest version the whole run; the progress line says where it ended
    key = f"flow-test-{summary['run_id']}"
    tables = [a for a in found if a.key == f"{key}-metrics"]
    assert tables and [row["step"] for row in json.loads(max(tables, key=lambda a: a.created).data)] == [1, 2, 3]
    assert any(a.key == f"{key}-curves" for a in found) and any(a.key == f"{key}-summary" for a in found)
    [progress] = [a for a in found if a.type == "progress"]
    assert progress.data == 100.0 and progress.description.startswith("flow-test: step 3/3 | reward "), progress
    assert f"held-out {evals[-1]['accuracy']:.3f} (step 3)" in progress.description, progress.description

    # the graph in the UI follows the steps: rollout k -> train k -> push -> rollout k+1, not a star
    # around prepare-run
    runs = task_runs(state.state_details.flow_run_id,
                     {"prepare-run", "rollout-0", "train-0", "push-weights-v2", "evaluate-step-0", "rollout-2",
                      "push-weights-v6"})
    graph = task_graph(runs)
    assert graph["rollout-0"] == {"prepare-run"} and graph["train-0"] == {"rollout-0"}, graph
    assert graph["push-weights-v2"] == {"train-0"} and graph["rollout-1"] == {"push-weights-v2"}
    assert graph["train-2"] == {"rollout-2"} and graph["push-weights-v6"] == {"train-2"}
    hanging = sorted(name for name, up in graph.items() if "prepare-run" in up)
    assert hanging == ["check-data", "evaluate-step-0", "resume-run", "rollout-0"], hanging


def test_bad_dataset_fails_the_run_before_any_rollout(prefect_backend, tiny_model_dir, tmp_path):
    from flows.train import train

    missing = tmp_path / "nope.jsonl"
    cfg = _tiny_run(tmp_path, tiny_model_dir, data={"type": "file", "path": str(missing)},
                    eval={"data": {"type": "file", "path": str(missing)}, "num_prompts": 4})
    state = train(cfg, return_state=True)
    assert state.is_failed()
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        state.result()
    run_dirs = list((tmp_path / "runs" / "flow-test").iterdir())
    assert not list(run_dirs[0].glob("samples/*/*.arrow")), "no rollout may run on a bad dataset"


def test_cli_train_runs_a_flow_and_prints_the_before_after_table(tiny_model_dir, tmp_path):
    """`miles train` as a user runs it: flags on top of defaults, Prefect's ephemeral API, a table."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    tests = Path(__file__).parent  # the reward below is this module's; it imports tests/waiting.py
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PYTHONPATH": f"{tests}{os.pathsep}{tests.parent}"}
    for name in ("PREFECT_API_URL", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY", "PYTHONWARNINGS",
                 "DS_ACCELERATOR"):  # a user's shell: the command quiets the libraries itself
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-m", "deployments.cli", "train", "--hf-checkpoint", str(tiny_model_dir),
         "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
         "--rollout-max-response-len", "3", "--eval-num-prompts", "4", "--storage-root", str(tmp_path / "runs"),
         "--custom-rm-path", "test_train_flow:first_sample_fails"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "starting policy" in out.stdout and "after   2 GRPO steps" in out.stdout
    assert str(tmp_path / "runs") in out.stdout
    logs = out.stdout + out.stderr
    assert "step   2/2" in logs
    # partial reward failures reach the log, with what failed
    assert "step 1: 4 of 8 samples' rewards failed (they train nothing): group 0 sample 0: reward: ValueError: " \
           "the judge refused sample 0" in logs, logs[-3000:]
    # quiet by default: the run's lines, not the libraries' bars, notices and banners (--verbose shows them)
    for noise in ("Loading weights", "Setting accelerator to CPU", "FutureWarning", "DeprecationWarning"):
        assert noise not in logs, (noise, logs[-3000:])


def first_sample_fails(sample) -> float:
    """A reward that fails for the first sample of every group (a third-party judge that refuses some)."""
    if sample.sample_index == 0:
        raise ValueError("the judge refused sample 0")
    return 0.0


def never_returns(sample) -> float:
    """A reward whose service hangs: the call never comes back."""
    threading.Event().wait()
    return 1.0


def test_a_reward_that_never_returns_fails_the_run_after_a_few_deadlines(prefect_backend, tiny_model_dir, tmp_path):
    """Each step's 16 samples are scored side by side, each call timing out after 1 s: three steps in
    a row train nothing (--max-skipped-steps 3) and the run fails naming the timeout; each timeout
    is logged as it happens."""
    from flows.train import train
    from miles_core.session.training import SkippedSteps

    cfg = _tiny_run(tmp_path, tiny_model_dir, rollout={"num_rollout": 10, "rollout_batch_size": 4,
                                                        "n_samples_per_prompt": 4, "rollout_max_response_len": 4,
                                                        "reward": "test_train_flow:never_returns",
                                                        "reward_timeout_s": 1.0},
                    eval={"skip_eval_before_train": True, "eval_interval": 100, "num_prompts": 8})
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # wherever the run's logging config sends it
    logging.getLogger("miles_core.rewards").addHandler(handler)
    try:
        state = train(cfg, return_state=True)
    finally:
        logging.getLogger("miles_core.rewards").removeHandler(handler)
    assert state.is_failed()
    with pytest.raises(SkippedSteps, match=r"(?s)3 training steps in a row changed nothing.*step 1: 16 of 16 "
                                           r"samples had no valid reward \(reward: RewardTimeout: timed out after 1 s"):
        state.result()
    assert any(m.startswith("reward never_returns timed out after 1 s on group 0 sample 0") for m in logged), logged[:3]


def test_sync_flow_on_s3_moves_samples_and_weights_through_the_endpoint(prefect_backend, tiny_model_dir, tmp_path):
    """The run folder on a real S3 endpoint (moto's server over HTTP): segments, cursors and weight
    snapshots go through it, and the engine loads each new version from it."""
    import fsspec

    from flows.train import train
    from miles_core.storage.local_s3 import LocalS3

    with LocalS3() as s3:
        root = s3.make_bucket("flow-runs") + "/runs"
        cfg = _tiny_run(tmp_path, tiny_model_dir, storage={"root": root, "storage_options": s3.storage_options})
        state = train(cfg, return_state=True)
        assert state.is_completed(), state
        summary = state.result()
        assert summary["run_dir"].startswith("s3://flow-runs/runs/flow-test/") and summary["final_version"] == 6
        fs = fsspec.filesystem("s3", **s3.storage_options)
        run = summary["run_dir"].removeprefix("s3://")
        assert len(fs.glob(f"{run}/samples/rollout/*.arrow")) == 3
        assert fs.cat_file(f"{run}/weights/LATEST").strip() == b"6"
        assert "testing" not in fs.cat_file(f"{run}/config.json").decode()  # credentials stay out
        evals = [json.loads(line) for line in fs.cat_file(f"{run}/eval.jsonl").decode().splitlines()]
        assert evals[-1]["weight_version"] == 6


def test_storage_credentials_come_from_a_prefect_secret_block(prefect_backend, tiny_model_dir, tmp_path, monkeypatch):
    """No credentials in the config or the environment: the run gets them from a Secret block, and
    they never reach the run folder."""
    import fsspec
    from prefect.blocks.system import Secret

    from flows.train import train
    from miles_core.storage.local_s3 import LocalS3

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask an instance-metadata endpoint
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))

    with LocalS3() as s3:
        root = s3.make_bucket("cred-runs") + "/runs"
        Secret(value={"key": "block-key", "secret": "block-secret-123"}).save("s3-test-creds", overwrite=True)
        opts = {k: v for k, v in s3.storage_options.items() if k not in ("key", "secret")}
        storage = {"root": root, "storage_options": opts, "credentials_block": "s3-test-creds"}
        cfg = _tiny_run(tmp_path, tiny_model_dir, storage=storage).updated({"rollout.num_rollout": 1})
        state = train(cfg, return_state=True)
        assert state.is_completed(), state
        run = state.result()["run_dir"].removeprefix("s3://")
        fs = fsspec.filesystem("s3", **s3.storage_options)
        saved = fs.cat_file(f"{run}/config.json").decode()
        assert "block-secret-123" not in saved and '"credentials_block": "s3-test-creds"' in saved
        # nor Prefect's database: the run's parameters and its evaluation subflows' (which received the
        # config with the block's options merged in) hold no secret
        stored = _stored_flow_run_parameters()
        assert len(stored) >= 2 and any('"credentials_block": "s3-test-creds"' in p for p in stored), stored
        assert not [p for p in stored if "block-secret-123" in p or "block-key" in p]

        missing = _tiny_run(tmp_path, tiny_model_dir, storage={**storage, "credentials_block": "no-such-block"})
        state = train(missing, return_state=True)
        assert state.is_failed()
        with pytest.raises(ValueError, match="no-such-block.*no such Secret block"):
            state.result()


def _stored_flow_run_parameters() -> list[str]:
    """Every flow run's parameters as the Prefect API stores them (JSON text)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return [json.dumps(run.parameters) for run in client.read_flow_runs(limit=200)]


def _digit_share(sample) -> float:
    """A reward the untrained tiny model earns unevenly (the toy reward is 0 for all its samples,
    which makes every gradient zero and would leave the weights unchanged)."""
    return sum(c.isdigit() for c in sample.response) / max(1, len(sample.response))


def _deterministic(rows: list[dict]) -> list[dict]:
    """Metric rows without wall-clock timings (the only values that differ between equal runs)."""
    timing = ("seconds", "_per_s", "idle_fraction")
    return [{k: v for k, v in row.items() if not any(t in k for t in timing)} for row in rows]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_resumed_run_equals_an_uninterrupted_one(prefect_backend, tiny_model_dir, tmp_path, monkeypatch, mode):
    """Run A: 6 steps in one go. Run B: 4 steps, its checkpoint at step 4 cut short (no state.json,
    as if the process died while saving it), then resumed to 6 steps from the checkpoint at step 3.
    Step 4 is redone; B's metrics, evaluations and final weights equal A's exactly (async: the
    redone rollouts 4 and 5 are generated with the weights they were generated with in A, one
    version behind the trainer)."""
    import torch

    from flows.train import train
    from miles_core import rewards
    from miles_core.storage import WeightStore

    monkeypatch.setitem(rewards._REGISTRY, "test-digit-share", _digit_share)  # gone after the test

    def run(run_id: str, steps: int) -> dict:
        cfg = _tiny_run(tmp_path, tiny_model_dir, run_id=f"{run_id}-{mode}", mode=mode, checkpoint={"save_interval": 3})
        cfg = cfg.updated({"rollout.num_rollout": steps, "rollout.reward": "test-digit-share"})
        state = train(cfg, return_state=True)
        assert state.is_completed(), state
        return state.result()

    straight = Path(run("straight", 6)["run_dir"])
    first = Path(run("resumed", 4)["run_dir"])
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step-000003", "step-000004"]
    (first / "checkpoints" / "step-000004" / "state.json").unlink()
    summary = run("resumed", 6)
    assert summary["resumed_from_step"] == 3 and summary["run_dir"] == str(first)

    rows = _jsonl(first / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["grad_norm"] > 0 for r in rows), "zero gradients would leave nothing to compare"
    assert _deterministic(rows) == _deterministic(_jsonl(straight / "metrics.jsonl"))
    assert _deterministic(_jsonl(first / "eval.jsonl")) == _deterministic(_jsonl(straight / "eval.jsonl"))
    a, b = WeightStore(str(straight / "weights")), WeightStore(str(first / "weights"))
    # retention (storage.keep_snapshots = 3): the newest three and the step-3 checkpoint's version 6; a
    # version an evaluation still pinned at the last publish stays too (evaluations after steps 2, 4)
    for store in (a, b):
        assert store.versions()[-4:] == [6, 8, 10, 12] and set(store.versions()) <= {4, 6, 8, 10, 12}
    assert a.latest() == b.latest() == 12
    want, got = a.load(), b.load()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not all(torch.equal(want[k], t) for k, t in a.load(6).items()), "the weights must have moved"
    # kept: the newest two complete checkpoints; the cut-short one at step 4 was pruned
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step-000003", "step-000006"]
    # the first step 4's segment stays as history: 4 + 3 segments, the trainer's cursor on the last
    assert len(list((first / "samples" / "rollout").glob("*.arrow"))) == 7
    assert json.loads((first / "cursors" / "rollout" / "trainer.json").read_text())["offset"] == 6
    # the ledger: each step's groups trained once; the first step 4's segment counts as discarded
    audit = summary["audit"]
    assert audit["ok"] and audit["steps"] == 6 and audit["token_balance"] == 0, audit
    assert audit["counts"]["trained"] == 6 * 4  # rollout_batch_size groups a step
    assert audit["counts"]["discarded (a step redone after a resume)"] == 4


def test_a_stop_that_was_asked_for_ends_cancelled_with_its_checkpoint(prefect_backend, tiny_model_dir, tmp_path):
    """A stop asked for (Ctrl-C, SIGTERM: ``request_stop``) ends the flow run Cancelled, not Failed;
    calling the flow raises the stop, which says where the run resumes from."""
    from prefect.client.orchestration import get_client

    from flows.train import train
    from miles_core import stopping

    cfg = _tiny_run(tmp_path, tiny_model_dir, checkpoint={"save_interval": 100}, eval={"eval_interval": None})
    stopping.request_stop()  # as the signal handler does: the run stops after the step in progress
    try:
        state = train(cfg, return_state=True)
    finally:
        stopping._STOP.clear()
    assert state.is_cancelled(), state
    assert "stopped after step 1 of 3, as asked; checkpoint at step 1" in state.message, state.message
    with pytest.raises(stopping.RunStopped) as stop:
        state.result()
    assert stop.value.checkpoint_step == 1
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(state.state_details.flow_run_id).state.is_cancelled()


def test_a_run_with_steps_but_no_checkpoint_is_not_restarted(prefect_backend, tiny_model_dir, tmp_path):
    from flows.train import train

    cfg = _tiny_run(tmp_path, tiny_model_dir, run_id="no-checkpoint").updated({"rollout.num_rollout": 1})
    assert train(cfg, return_state=True).is_completed()
    state = train(cfg, return_state=True)
    assert state.is_failed()
    with pytest.raises(RuntimeError, match="no-checkpoint.*no checkpoint to resume from.*new run id.*--save-interval"):
        state.result()
    run_dir = tmp_path / "runs" / "flow-test" / "no-checkpoint"
    assert [r["step"] for r in _jsonl(run_dir / "metrics.jsonl")] == [1]  # the old run is left as it was
    assert len(list((run_dir / "samples" / "rollout").glob("*.arrow"))) == 1


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_fails_the_run_naming_the_file_and_after_space_is_freed_it_resumes(prefect_backend, tiny_model_dir,
                                                                                       tmp_path):
    """A disk that fills in the middle of a run (checkpoints every step, all kept): the run fails
    naming the file, leaves no temporary file and no incomplete checkpoint, and once there is space
    again the same run id resumes from its last complete checkpoint and finishes."""
    import subprocess

    from flows.train import train
    from miles_core.storage.layout import RunLayout

    small = tmp_path / "small-disk"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        cfg = _tiny_run(tmp_path, tiny_model_dir, storage={"root": str(small / "runs")}, eval={"eval_interval": None},
                        checkpoint={"save_interval": 1, "keep_checkpoints": 1000})
        cfg = cfg.updated({"rollout.num_rollout": 200, "run_id": "full"})  # the 8 MB disk fills long before
        state = train(cfg, return_state=True)
        assert state.is_failed(), state
        # a file written whole says its size; a streamed one (weight snapshots, checkpoints) cannot
        with pytest.raises(OSError, match=rf"^\[Errno 28\] {small}/runs/\S+: cannot write( \d+ bytes)? \(No space "
                                          r"left on device\); the disk is full: free space there, or move storage.root"):
            state.result()
        assert not [p for p in small.rglob("*") if ".tmp" in p.name], "a failed write leaves no temp file"
        layout = RunLayout(str(small / "runs"), "flow-test", "full")
        assert not layout.incomplete_checkpoints(), "a failed checkpoint leaves nothing a resume could take for one"
        last = layout.latest_checkpoint()
        assert last, "the disk held a checkpoint or more before it filled"

        subprocess.run(["mount", "-o", "remount,size=512m", str(small)], check=True)  # space again
        cfg = cfg.updated({"rollout.num_rollout": last + 2})
        state = train(cfg, return_state=True)
        assert state.is_completed(), state
        steps = [r["step"] for r in _jsonl(small / "runs" / "flow-test" / "full" / "metrics.jsonl")]
        assert steps == list(range(1, last + 3))
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_a_damaged_segment_found_on_resume_is_moved_aside_and_the_audit_and_archive_pass(prefect_backend,
                                                                                        tiny_model_dir, tmp_path,
                                                                                        mode):
    """Garbage bytes in sample segments of a finished run (one the trainer trained; fully async, also
    the newest, likely never read): the run resumed for two more steps moves them aside, the prompts
    it had not trained are generated again, its audit balances and the stream archives."""
    from flows.train import train
    from miles_core.audit import SET_ASIDE
    from miles_core.storage.archive import compact_run

    cfg = _tiny_run(tmp_path, tiny_model_dir, checkpoint={"save_interval": 2}, eval={"eval_interval": None},
                    mode={"type": mode})
    cfg = cfg.updated({"rollout.num_rollout": 4, "run_id": "damaged"})
    assert train(cfg, return_state=True).is_completed()
    producer = "rollout" if mode == "sync" else "rollout-p0"
    stream = tmp_path / "runs" / "flow-test" / "damaged" / "samples" / producer
    segments = sorted(stream.glob("*.arrow"))
    damaged = [segments[0]] if mode == "sync" else [segments[0], segments[-1]]
    for segment in damaged:
        data = bytearray(segment.read_bytes())
        data[len(data) // 3: len(data) // 3 + 64] = b"\xde\xad" * 32  # overwritten in place
        segment.write_bytes(bytes(data))

    cfg = cfg.updated({"rollout.num_rollout": 6})
    state = train(cfg, return_state=True)
    assert state.is_completed(), state
    assert sorted(p.name for p in (stream / "damaged").glob("*.arrow")) == [p.name for p in damaged]
    assert all((stream / "damaged" / f"{p.stem}.json").exists() for p in damaged)
    audit = state.result()["audit"]
    assert audit["ok"] and audit["token_balance"] == 0, audit
    assert audit["counts"][SET_ASIDE] == len(damaged), audit["counts"]
    report = compact_run(str(stream.parents[1]), producer=producer)
    assert report.segments == len(list(stream.glob("*.arrow")))
