"""The launched trainer's driver side: which rank a failure is blamed on."""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing import Pipe

import pytest

from miles_core.train.launch import LaunchedTrainer, TrainerProcessError, send


def _driver(tmp_path, rank1_pid: int):
    """A driver over two ranks' connections (real pipes, no launcher); returns it, and the ends the
    ranks would write to (rank 1's stays open: no EOF to read, as before the driver notices it)."""
    (rank0, rank0_end), (rank1, rank1_end) = Pipe(), Pipe()
    trainer = LaunchedTrainer.__new__(LaunchedTrainer)  # only the driver's reply handling
    trainer._conns, trainer.pids = {0: rank0, 1: rank1}, {0: os.getpid(), 1: rank1_pid}
    trainer._fail = lambda wait_for_exit=True: None
    trainer._stopped, trainer.dir = True, tmp_path
    return trainer, rank0_end, rank1_end


def test_a_rank_failing_after_another_died_blames_the_dead_one(tmp_path):
    """Rank 1 died and rank 0 then failed in a collective with it: the error names rank 1 first,
    although rank 0's reply is the one the driver reads."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # exited and reaped: its pid runs nothing
    trainer, rank0_end, _rank1_end = _driver(tmp_path, dead.pid)
    send(rank0_end, ("error", "RuntimeError: Connection reset by peer (all_reduce)", None))
    with pytest.raises(TrainerProcessError, match=r"trainer rank 1 exited during 'step' \(rank 0 failed after it:"):
        trainer._gather("step", None)


def test_a_rank_failing_alone_is_named(tmp_path):
    trainer, rank0_end, _rank1_end = _driver(tmp_path, os.getpid())  # rank 1 alive (this process)
    send(rank0_end, ("error", "ValueError: a bad batch", None))
    with pytest.raises(TrainerProcessError, match=r"trainer rank 0 failed during 'step':\nValueError: a bad batch"):
        trainer._gather("step", None)
