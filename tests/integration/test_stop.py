"""Ctrl-C and SIGTERM of `miles train`, as a user sends them: the run stops after the step in
progress (a sync run with its checkpoint and the command that resumes it; a fully-async run with
its producers), leaves only whole segments and no process behind; a second Ctrl-C stops it at once.
A second trainer of a running run is refused (the run folder's lease)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serving import wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _miles_train(tmp_path: Path, model_dir, *flags: str, command: str = "train",
                 api_url: str | None = None, own_group: bool = False) -> subprocess.Popen:
    """``miles train`` (or ``command``) in a process of its own (``own_group``: leading a process
    group of its own, as a terminal's job), its output in files (``out``/``err`` of tmp_path).
    Without ``api_url`` it has Prefect's ephemeral API, as a user's first run has."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    env.pop("PREFECT_API_URL", None)
    if api_url:
        env["PREFECT_API_URL"] = api_url
    cmd = [sys.executable, "-m", "deployments.cli", command, "--hf-checkpoint", str(model_dir),
           "--num-rollout", "400", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
           "--rollout-max-response-len", "3", "--eval-num-prompts", "4", "--eval-interval", "1000",
           "--storage-root", str(tmp_path / "runs"), *flags]
    n = len(list(tmp_path.glob("err-*")))
    out, err = open(tmp_path / f"out-{n}", "w"), open(tmp_path / f"err-{n}", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, text=True, process_group=0 if own_group else None)
    proc.log = (tmp_path / f"out-{n}", tmp_path / f"err-{n}")
    return proc


def _output(proc: subprocess.Popen) -> tuple[str, str]:
    return proc.log[0].read_text(), proc.log[1].read_text()


def _steps(tmp_path: Path) -> int:
    files = list((tmp_path / "runs").glob("*/*/metrics.jsonl"))
    return len(files[0].read_text().splitlines()) if files else 0


def _run_session(proc: subprocess.Popen) -> int:
    """The session of the run's process (the supervisor's child, which leads it)."""
    wait_for(lambda: subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True,
                                    text=True).stdout.strip(), 30, "the run's process")
    return int(subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True,
                              text=True).stdout.split()[0])


def _left_in(session: int) -> list[str]:
    out = subprocess.run(["ps", "-o", "pid=,args=", "-s", str(session)], capture_output=True, text=True).stdout
    # a killed process whose parent died too waits for init to reap it: it holds nothing but a pid
    return [line for line in out.splitlines() if line.strip() and "<defunct>" not in line]


def _stop(proc: subprocess.Popen, *signals: int, within: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    for sig in signals:
        proc.send_signal(sig)
        time.sleep(0.2)
    try:
        proc.wait(timeout=within + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, _output(proc)[1], time.monotonic() - t0


SETTLE_S = 45
"""A run with producers stops after its step once they have settled what they had in flight (up to
30 s by design, seconds when idle; 23 s was seen beside another test process): under the 60 s that
``Fleet.stop`` would wait out for a producer that never says it stopped."""


def _no_partial_segments(tmp_path: Path) -> None:
    partial = [p for p in (tmp_path / "runs").rglob("samples/**/*") if p.is_file() and p.suffix != ".arrow"
               and p.name != "_END"]
    assert not partial, f"partial files in the sample streams: {partial[:5]}"


def test_ctrl_c_stops_a_sync_run_after_its_step_with_a_checkpoint_and_says_how_to_resume(tiny_model_dir, tmp_path):
    """Also: while it runs, a second trainer of the same run id is refused and writes nothing."""
    proc = _miles_train(tmp_path, tiny_model_dir, "--save-interval", "100", "--run-id", "busy")
    session = _run_session(proc)
    wait_for(lambda: _steps(tmp_path) >= 1, 180, "a training step")
    second = _miles_train(tmp_path, tiny_model_dir, "--run-id", "busy", "--num-rollout", "2")
    assert second.wait(timeout=120) == 1
    err = _output(second)[1]
    assert f"run busy ({tmp_path / 'runs'}" in err and f"is being trained by pid {session} on " in err, err[-3000:]
    assert "wait for that run to end, or use a new run id" in err
    config = json.loads(next((tmp_path / "runs").glob("*/busy/config.json")).read_text())
    assert config["rollout"]["num_rollout"] == 400, "the refused trainer wrote nothing"

    wait_for(lambda: _steps(tmp_path) >= 3, 180, "three training steps")
    code, err, seconds = _stop(proc, signal.SIGINT, within=10)
    assert code == 130, err[-3000:]
    assert seconds < 10, f"stopped after {seconds:.1f} s"
    assert not _left_in(session), _left_in(session)
    run_dir = next((tmp_path / "runs").glob("*/*"))
    done = _steps(tmp_path)
    assert f"stopped after step {done} of 400, as asked; checkpoint at step {done}" in err, err[-3000:]
    assert (run_dir / "checkpoints" / f"step-{done:06d}" / "state.json").exists()
    resume = next(line for line in err.splitlines() if line.startswith("resume it with: miles train "))
    assert resume.endswith(f"--run-id {run_dir.name}")
    _no_partial_segments(tmp_path)
    assert json.loads((run_dir / "lease.json").read_text())["released_at"], "a run that ended gives its lease back"

    # the printed command resumes it (here with two more steps to go)
    again = _miles_train(tmp_path, tiny_model_dir, "--save-interval", "100", "--num-rollout", str(done + 2),
                         "--run-id", run_dir.name)
    again.wait(timeout=300)
    out, err = _output(again)
    assert again.returncode == 0, err[-3000:]
    assert f"resuming run {run_dir.name} from checkpoint at step {done}" in out + err
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, done + 3))


def test_sigterm_stops_a_fully_async_run_and_its_producers_with_a_checkpoint(tiny_model_dir, tmp_path):
    """SIGTERM, with partial rollout on: the producer saves its unfinished groups; the resumed run's
    first producer continues them (under their own group indices) and the audit finds every prompt."""
    flags = ("--fully-async", "--save-interval", "100", "--partial-rollout", "--async-max-concurrent-samples", "64")
    proc = _miles_train(tmp_path, tiny_model_dir, *flags)
    session = _run_session(proc)
    wait_for(lambda: _steps(tmp_path) >= 3, 180, "three training steps")
    code, err, seconds = _stop(proc, signal.SIGTERM, within=SETTLE_S)
    assert code == 143, err[-3000:]
    assert seconds < SETTLE_S, f"stopped after {seconds:.1f} s:\n{err[-3000:]}"
    done = _steps(tmp_path)
    assert f"as asked; checkpoint at step {done}" in err and "resume it with: miles train " in err, err[-3000:]
    assert not _left_in(session), _left_in(session)  # producers, their engines, the Prefect server
    _no_partial_segments(tmp_path)

    from miles_core.rollout.fleet import ControlPlane
    from miles_core.storage import SampleStream

    run_dir = next((tmp_path / "runs").glob("*/*"))
    saved = {s.group_index for seg in SampleStream(str(run_dir)).sibling("partial-p0").read() for s in seg.samples()}
    again = _miles_train(tmp_path, tiny_model_dir, *flags, "--num-rollout", str(done + 2), "--run-id", run_dir.name)
    again.wait(timeout=300)
    out, err = _output(again)
    assert again.returncode == 0, err[-3000:]
    if saved:  # (how many groups were in flight at the stop is up to timing)
        assert f"p1 continues {len(saved)} partial groups they saved" in out + err, (out + err)[-3000:]
        assert ControlPlane(str(run_dir)).heartbeat("p1").stats["groups_resumed_partial"] == len(saved)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["audit"]["ok"], summary["audit"]
    print(f"partial groups saved at the stop and continued: {len(saved)}")


def test_sigterm_stops_a_multi_lora_run_with_a_checkpoint_of_each_adapter(tiny_model_dir, tmp_path):
    proc = _miles_train(tmp_path, tiny_model_dir, "--lora-count", "2", "--lora-rank", "4", "--save-interval", "100",
                        command="train-multi-lora")
    session = _run_session(proc)

    def adapter_steps() -> int:
        files = list((tmp_path / "runs").glob("*/*/adapters/*/metrics.jsonl"))
        return min(len(f.read_text().splitlines()) for f in files) if len(files) == 2 else 0

    wait_for(lambda: adapter_steps() >= 2, 180, "two steps of each adapter")
    code, err, seconds = _stop(proc, signal.SIGTERM, within=SETTLE_S)
    assert code == 143, err[-3000:]
    assert seconds < SETTLE_S, f"stopped after {seconds:.1f} s:\n{err[-3000:]}"
    assert "the adapters' checkpoints are at steps adapter-0 " in err, err[-3000:]
    assert "resume it with: miles train-multi-lora " in err, err[-3000:]
    run_dir = next((tmp_path / "runs").glob("*/*"))
    for name in ("adapter-0", "adapter-1"):
        assert list((run_dir / "adapters" / name / "checkpoints").iterdir()), name
    assert not _left_in(session), _left_in(session)
    _no_partial_segments(tmp_path)


def test_a_second_ctrl_c_stops_the_run_at_once(tiny_model_dir, tmp_path):
    proc = _miles_train(tmp_path, tiny_model_dir)
    session = _run_session(proc)
    wait_for(lambda: _steps(tmp_path) >= 1, 180, "a training step")
    code, err, seconds = _stop(proc, signal.SIGINT, signal.SIGINT, within=3)
    assert code == 130 and "stopping the run at once" in err, err[-3000:]
    assert seconds < 3, f"stopped after {seconds:.1f} s"
    assert not _left_in(session), _left_in(session)



def test_a_run_ends_with_its_command_killed_with_sigkill_and_resumes_at_once(tiny_model_dir, tmp_path):
    """kill -9 of the `miles` command's process group (a crashed terminal, a killed container step):
    the run's own session ends within seconds, and `--run-id` resumes it right away."""
    proc = _miles_train(tmp_path, tiny_model_dir, "--save-interval", "2", "--run-id", "orphan", own_group=True)
    session = _run_session(proc)
    wait_for(lambda: _steps(tmp_path) >= 3, 180, "three training steps")
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL  # the witness: the command is gone, the run's session was not hit
    wait_for(lambda: not _left_in(session), 10, f"the run's session to end: {_left_in(session)}")
    assert "the miles command that ran this run (pid " in _output(proc)[1], _output(proc)[1][-3000:]
    done = _steps(tmp_path)
    checkpoints = sorted(p.name for p in next((tmp_path / "runs").glob("*/orphan")).glob("checkpoints/step-*"))
    assert checkpoints, "a checkpoint every 2 steps"

    again = _miles_train(tmp_path, tiny_model_dir, "--save-interval", "2", "--num-rollout", str(done + 2),
                         "--run-id", "orphan")
    again.wait(timeout=300)
    out, err = _output(again)
    assert again.returncode == 0, err[-3000:]
    assert f"resuming run orphan from checkpoint at step {int(checkpoints[-1][5:])}" in out + err, (out + err)[-3000:]
