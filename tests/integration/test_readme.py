"""The README's Python example runs as written (on a copy of configs/toy.toml made small: 2 steps of
4 prompts, the test's tiny model, a temporary storage root)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_the_readmes_python_example_runs(prefect_backend, tiny_model_dir, tmp_path):
    [block] = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    toml = (REPO / "configs" / "toy.toml").read_text()
    for old, new in (("num_rollout = 60", "num_rollout = 2"), ("rollout_batch_size = 32", "rollout_batch_size = 4"),
                     ("num_prompts = 512", "num_prompts = 8"), ('root = "runs"', f'root = "{tmp_path / "runs"}"'),
                     ('path = "builtin:tiny-addition"', f'path = "{tiny_model_dir}"')):
        assert old in toml, old
        toml = toml.replace(old, new)
    config = tmp_path / "toy.toml"
    config.write_text(toml)
    assert '"configs/toy.toml"' in block
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.replace('"configs/toy.toml"', repr(str(config))), "README.md", "exec"), {})
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"[0-9.]+ -> [0-9.]+", lines[0]), lines
    assert [line.split()[0] for line in lines[1:]] == ["1", "2"], lines


def test_the_readmes_commands_run(demo_model, tmp_path):
    """``scripts/demo.sh`` (made short with flags, which it passes on to ``miles train``) prints the
    before/after table; ``miles train --help`` lists the flags. (``scripts/test.sh`` is CI itself.)"""
    import os
    import subprocess

    readme = (REPO / "README.md").read_text()
    [commands] = re.findall(r"```bash\n(.*?)```", readme, re.S)
    assert [line.split()[0] for line in commands.splitlines()] == ["scripts/demo.sh", "scripts/test.sh"]
    assert ".venv/bin/miles train --help" in readme
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    env.pop("PREFECT_API_URL", None)
    demo = subprocess.run(["scripts/demo.sh", "--num-rollout", "2", "--eval-num-prompts", "16",
                           "--storage-root", str(tmp_path / "runs")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-3000:]
    assert "starting policy" in demo.stdout and "after   2 GRPO steps" in demo.stdout, demo.stdout[-2000:]
    assert str(tmp_path / "runs" / "toy-addition") in demo.stdout
    usage = subprocess.run([str(REPO / ".venv" / "bin" / "miles"), "train", "--help"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0 and "--lora-count" in usage.stdout and "--use-wandb" in usage.stdout
    # the GPU check the README documents: here (no CUDA device) it skips, saying why, with exit code 0
    assert "scripts/gpu_check.sh" in readme
    check = subprocess.run(["scripts/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if subprocess.run(["sh", "-c", "nvidia-smi -L"], capture_output=True).returncode != 0:
        assert check.returncode == 0 and "skipped: no CUDA device" in check.stdout, check.stdout + check.stderr
