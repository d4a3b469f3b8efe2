"""Kill-and-resume soak of every mode, as a crash would do it: SIGKILL of the run's whole process
session (trainer, producers) at random points, the Prefect server it reports to living on; then
the same `miles` command again. Each kill must land mid-run (the witness: the steps it had done),
and after each the prompt ledger must still account for every prompt; the resumed run ends with
every step once, and `miles audit` finds no prompt lost or trained twice (for a multi-LoRA run: by
any adapter). Sync and async runs are deterministic: their metrics and final weights equal an
uninterrupted run's, bit for bit.

A longer version (10 kills, ``MILES_SOAK_KILLS``): ``scripts/soak.sh``."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serving import wait_for
from test_stop import REPO, _miles_train, _output, _run_session, _steps
from test_train_flow import _deterministic, _jsonl

pytestmark = pytest.mark.integration

KILLS = int(os.environ.get("MILES_SOAK_KILLS", "3"))


def _audit(run_dir) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "deployments.cli", "audit", str(run_dir), "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 1), out.stderr[-2000:]
    return out.returncode, json.loads(out.stdout)


def _adapter_steps(tmp_path: Path) -> int:
    """A multi-LoRA run's steps: those of its slowest adapter."""
    files = list((tmp_path / "runs").glob("*/*/adapters/*/metrics.jsonl"))
    return min((len(f.read_text().splitlines()) for f in files), default=0) if len(files) == 2 else 0


def _checkpointed(tmp_path: Path, trainers: int) -> bool:
    """Whether each of the run's ``trainers`` (the run's own, or each adapter's) has a complete checkpoint."""
    run = next((tmp_path / "runs").glob("*/soak"), None)
    if run is None:
        return False
    folders = [run / "checkpoints"] if trainers == 1 else list(run.glob("adapters/*/checkpoints"))
    return len(folders) == trainers and all(any(f.glob("step-*/state.json")) for f in folders)


def _soak(api_url: str, tmp_path: Path, model_dir, flags: tuple[str, ...], total: int, steps, stride: int,
          command: str = "train", trainers: int = 1) -> tuple[Path, list[int], int]:
    """Start the run, SIGKILL it ``KILLS`` times a few steps after each start, audit after each
    kill; then run it to the end. Returns the run folder, the steps each kill hit, and the seed."""
    seed = int(os.environ.get("MILES_SOAK_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    witnesses = []
    for kill in range(KILLS):
        proc = _miles_train(tmp_path, model_dir, *flags, command=command, api_url=api_url)
        session = _run_session(proc)
        if kill == 0:  # a run killed before its first checkpoint is complete is not resumable (by design)
            wait_for(lambda: _checkpointed(tmp_path, trainers) or proc.poll() is not None, 240,
                     "a complete checkpoint of every trainer", poll=0.02)
        target = steps(tmp_path) + 2 + rng.randrange(stride)  # a few steps after where this start resumes
        wait_for(lambda: steps(tmp_path) >= target - 1 or proc.poll() is not None, 240, f"step {target - 1}",
                 poll=0.02)
        before = time.monotonic()
        wait_for(lambda: steps(tmp_path) >= target or proc.poll() is not None, 240, f"step {target}", poll=0.02)
        step_s = time.monotonic() - before
        time.sleep(rng.random() * min(0.3, 2 * step_s))  # anywhere inside the next step or two, however fast
        assert proc.poll() is None, \
            f"seed {seed}: start {kill + 1} ended by itself before its kill:\n{_output(proc)[1][-3000:]}"
        os.killpg(session, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=30)
        run_dir = next((tmp_path / "runs").glob("*/soak"))
        done = steps(tmp_path)
        assert done < total and not (run_dir / "summary.json").exists(), \
            f"seed {seed}: kill {kill + 1} came after the run ended ({done} steps)"
        witnesses.append(done)
        code, audit = _audit(run_dir)
        assert code == 0, f"seed {seed}, after kill {kill + 1} at step {done}: {audit['problems']}"

    print(f"soak seed {seed}: killed at steps {witnesses}")
    again = _miles_train(tmp_path, model_dir, *flags, command=command, api_url=api_url)
    again.wait(timeout=400)
    out, err = _output(again)
    assert again.returncode == 0, f"seed {seed}, kills at {witnesses}:\n{err[-3000:]}"
    assert "resuming run soak" in out + err
    return next((tmp_path / "runs").glob("*/soak")), witnesses, seed


def _step_numbers(folder: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_killed_again_and_again_ends_as_an_uninterrupted_one_bit_for_bit(prefect_backend, tiny_model_dir,
                                                                               tmp_path, mode):
    import torch

    from miles_core.storage import WeightStore

    total = 6 * KILLS + 6
    flags = (*(["--mode", "async"] if mode == "async" else []), "--save-interval", "2", "--num-rollout", str(total),
             "--run-id", "soak")
    (tmp_path / "reference").mkdir()
    reference = _miles_train(tmp_path / "reference", tiny_model_dir, *flags, api_url=prefect_backend)
    reference.wait(timeout=400)
    assert reference.returncode == 0, _output(reference)[1][-3000:]
    straight = next((tmp_path / "reference" / "runs").glob("*/soak"))

    run_dir, witnesses, seed = _soak(prefect_backend, tmp_path, tiny_model_dir, flags, total, _steps, stride=4)
    assert _step_numbers(run_dir) == list(range(1, total + 1)), f"seed {seed}, kills at {witnesses}"
    rows = _jsonl(run_dir / "metrics.jsonl")
    assert _deterministic(rows) == _deterministic(_jsonl(straight / "metrics.jsonl")), \
        f"seed {seed}, kills at {witnesses}"
    a, b = WeightStore(str(straight / "weights")), WeightStore(str(run_dir / "weights"))
    assert a.latest() == b.latest() == rows[-1]["version"]
    want, got = a.load(), b.load()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), \
        f"seed {seed}, kills at {witnesses}: the final weights differ"
    code, audit = _audit(run_dir)
    assert code == 0 and audit["ok"], f"seed {seed}, kills at {witnesses}: {audit['problems']}"
    assert audit["counts"]["trained"] == 4 * total


def test_a_fully_async_run_killed_again_and_again_loses_no_prompt(prefect_backend, tiny_model_dir, tmp_path):
    total = 12 * KILLS + 12
    flags = ("--fully-async", "--save-interval", "2", "--num-rollout", str(total), "--run-id", "soak")
    run_dir, witnesses, seed = _soak(prefect_backend, tmp_path, tiny_model_dir, flags, total, _steps, stride=8)
    assert _step_numbers(run_dir) == list(range(1, total + 1)), f"seed {seed}, kills at {witnesses}"
    code, audit = _audit(run_dir)
    assert code == 0 and audit["ok"], f"seed {seed}, kills at {witnesses}: {audit['problems']}"
    assert audit["counts"]["trained"] == 4 * total, audit  # every step trained rollout_batch_size prompts
    assert audit["token_balance"] == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["audit"]["ok"] and summary["audit"]["counts"]["trained"] == 4 * total


def test_a_multi_lora_run_killed_again_and_again_loses_no_prompt_for_any_adapter(prefect_backend, tiny_model_dir,
                                                                                 tmp_path):
    total = 6 * KILLS + 6
    flags = ("--lora-count", "2", "--lora-rank", "4", "--save-interval", "2", "--num-rollout", str(total),
             "--run-id", "soak")
    run_dir, witnesses, seed = _soak(prefect_backend, tmp_path, tiny_model_dir, flags, total, _adapter_steps,
                                     stride=4, command="train-multi-lora", trainers=2)
    names = sorted(p.name for p in (run_dir / "adapters").iterdir())
    assert len(names) == 2
    for name in names:
        assert _step_numbers(run_dir / "adapters" / name) == list(range(1, total + 1)), \
            f"seed {seed}, kills at {witnesses}: adapter {name}"
    code, audit = _audit(run_dir)
    assert code == 0 and audit["ok"], f"seed {seed}, kills at {witnesses}: {audit['problems']}"
    for name in names:  # shared rollouts: each adapter trained every step's batch, each prompt once
        assert audit["adapters"][name]["counts"]["trained"] == 4 * total, audit["adapters"][name]
        assert audit["adapters"][name]["token_balance"] == 0
    producers = sorted(p.name for p in (run_dir / "samples").iterdir() if p.name.startswith("rollout-m"))
    assert len(producers) >= 2, producers  # each start had a producer of its own
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["audit"]["ok"] and summary["failed_adapters"] == []
