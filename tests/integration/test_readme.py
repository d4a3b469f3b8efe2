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
