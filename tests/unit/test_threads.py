"""One torch thread for the built-in tiny model unless the user set one (``miles_core.threads``)."""

from __future__ import annotations

import torch

from miles_core.models import tiny_model_threads
from miles_core.threads import one_thread


def test_the_tiny_model_runs_on_one_thread_unless_told_otherwise():
    env: dict[str, str] = {}
    tiny_model_threads("builtin:tiny-addition", env)
    assert env == {"OMP_NUM_THREADS": "1"}
    env = {"OMP_NUM_THREADS": "4"}
    tiny_model_threads("builtin:tiny-addition", env)
    assert env == {"OMP_NUM_THREADS": "4"}
    env = {}
    tiny_model_threads("/models/qwen3-8b", env)  # a real model: torch's default
    assert env == {}


def test_one_thread_restores_the_count(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    with one_thread():  # the user's setting wins
        assert torch.get_num_threads() == 2
    torch.set_num_threads(before)
