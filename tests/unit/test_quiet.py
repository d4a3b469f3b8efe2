"""Quiet by default (``miles_core.quiet``): what the ``miles`` command sets for itself and its children."""

from __future__ import annotations

import glob

from miles_core.quiet import ACCELERATOR_NODES, QUIET, quiet_environment


def test_quiet_fills_only_what_the_user_left_unset():
    env = {"TRANSFORMERS_VERBOSITY": "info"}
    quiet_environment(env)
    assert env["TRANSFORMERS_VERBOSITY"] == "info"
    assert env["HF_HUB_DISABLE_PROGRESS_BARS"] == QUIET["HF_HUB_DISABLE_PROGRESS_BARS"]
    assert "ignore::FutureWarning" in env["PYTHONWARNINGS"]


def test_deepspeed_is_told_cpu_only_where_no_accelerator_exists(monkeypatch):
    env: dict[str, str] = {}
    quiet_environment(env)
    on_cpu = not any(glob.glob(p) for p in ACCELERATOR_NODES)
    assert (env.get("DS_ACCELERATOR") == "cpu") is on_cpu
    monkeypatch.setattr(glob, "glob", lambda pattern: ["/dev/nvidia0"] if pattern == "/dev/nvidia*" else [])
    env = {}
    quiet_environment(env)
    assert "DS_ACCELERATOR" not in env  # a GPU machine: DeepSpeed detects it
    env = {"DS_ACCELERATOR": "cuda"}
    quiet_environment(env)
    assert env["DS_ACCELERATOR"] == "cuda"
