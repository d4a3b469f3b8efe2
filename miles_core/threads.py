"""Torch threads for the built-in tiny model: one, unless the user says otherwise.

Measured on the project's 2-core machine (training steps of the tiny model, 8 s each, twice,
2026-12-04): two torch threads ran 40-55 steps/s on an idle machine but 10.5 with a busy loop on
the other core (OpenMP threads spin while waiting for each other, and one of them waits for a core);
``OMP_WAIT_POLICY=PASSIVE`` gave 21-23 in both cases; one thread 32-36 in both. A model this small
gains little from a second thread and loses most of its speed when anything else runs, so:

- ``miles_core.models.tiny_model_threads(model_path)``: the ``miles`` command sets ``OMP_NUM_THREADS=1`` for a run of
  the built-in tiny model (torch reads it at import; every process the run starts inherits it)
  unless it is set already;
- ``one_thread()``: the tiny model's warm start runs on one thread unless ``OMP_NUM_THREADS`` says
  otherwise (it also makes the built model the same whatever the machine's core count).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def one_thread() -> Iterator[None]:
    import torch

    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
