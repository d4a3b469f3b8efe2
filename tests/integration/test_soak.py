"""Kill-and-resume soak of a fully-async run, as a crash would do it: SIGKILL of the run's whole
process session (trainer, producers, the Prefect server) at random points, then the same
`miles train` command again. Each kill must land mid-run (the witness: the steps it had done), and
after each the prompt ledger must still account for every prompt; the resumed run ends with every
step once, and `miles audit` finds no prompt lost or trained twice.

A longer version (10 kills, ``MILES_SOAK_KILLS``): ``scripts/soak.sh``."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from serving import wait_for
from test_stop import REPO, _miles_train, _output, _run_session, _steps

pytestmark = pytest.mark.integration

KILLS = int(os.environ.get("MILES_SOAK_KILLS", "3"))
STEPS = 12 * KILLS + 12


def _audit(run_dir) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "deployments.cli", "audit", str(run_dir), "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 1), out.stderr[-2000:]
    return out.returncode, json.loads(out.stdout)


def test_a_fully_async_run_killed_again_and_again_loses_no_prompt(tiny_model_dir, tmp_path):
    seed = int(os.environ.get("MILES_SOAK_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    flags = ("--fully-async", "--save-interval", "2", "--num-rollout", str(STEPS), "--run-id", "soak")
    witnesses = []
    for kill in range(KILLS):
        proc = _miles_train(tmp_path, tiny_model_dir, *flags)
        session = _run_session(proc)
        target = _steps(tmp_path) + 3 + rng.randrange(8)  # a few steps after where this start resumes
        wait_for(lambda: _steps(tmp_path) >= target or proc.poll() is not None, 240, f"step {target}", poll=0.02)
        time.sleep(rng.random() * 0.3)  # anywhere inside the next step or two
        os.killpg(session, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=30)
        run_dir = next((tmp_path / "runs").glob("*/soak"))
        done = _steps(tmp_path)
        assert done < STEPS and not (run_dir / "summary.json").exists(), \
            f"seed {seed}: kill {kill + 1} came after the run ended ({done} steps)"
        witnesses.append(done)
        code, audit = _audit(run_dir)
        assert code == 0, f"seed {seed}, after kill {kill + 1} at step {done}: {audit['problems']}"

    print(f"soak seed {seed}: killed at steps {witnesses}")
    again = _miles_train(tmp_path, tiny_model_dir, *flags)
    again.wait(timeout=400)
    out, err = _output(again)
    assert again.returncode == 0, f"seed {seed}, kills at {witnesses}:\n{err[-3000:]}"
    assert "resuming run soak from checkpoint at step" in out + err
    run_dir = next((tmp_path / "runs").glob("*/soak"))
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1)), f"seed {seed}, kills at {witnesses}"
    code, audit = _audit(run_dir)
    assert code == 0 and audit["ok"], f"seed {seed}, kills at {witnesses}: {audit['problems']}"
    assert audit["counts"]["trained"] == 4 * STEPS, audit  # every step trained rollout_batch_size prompts
    assert audit["token_balance"] == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["audit"]["ok"] and summary["audit"]["counts"]["trained"] == 4 * STEPS
