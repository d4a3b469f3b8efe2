"""A trainer's state file on storage (``Trainer.save`` / ``Trainer.load``).

- ``checkpoint_storage(uri, ...)``: the file's filesystem behind the weight store's retry policy,
  so a checkpoint waits out a storage outage as every run file does (``storage.max_outage_s``).
- ``save_torch(fs, path, state)``: ``torch.save`` straight to the file, atomically.
- ``load_torch(uri, ...)``: the state back; a local file is read in place, not copied into memory.
"""

from __future__ import annotations

import io
import os
import posixpath
from typing import Any

import torch

from miles_core.storage.fs import (
    DEFAULT_RETRY,
    RetryingFS,
    atomic_write_stream,
    is_local,
)


def checkpoint_storage(uri: str, storage_options: dict[str, Any], weight_store: Any) -> tuple[RetryingFS, str]:
    """The filesystem of ``uri`` behind ``weight_store``'s retry policy (a run's: ``storage.max_outage_s``),
    and the path of ``uri`` in it."""
    return RetryingFS.open(uri, storage_options, getattr(weight_store, "retry", DEFAULT_RETRY))


def load_torch(uri: str, storage_options: dict[str, Any], weight_store: Any, map_location: Any) -> dict[str, Any]:
    """The state ``save_torch`` wrote at ``uri``; FileNotFoundError naming ``uri`` when there is none."""
    storage, path = checkpoint_storage(uri, storage_options, weight_store)
    if is_local(storage.fs):  # read from the file itself, not from a copy of its bytes
        if not os.path.isfile(path):
            raise FileNotFoundError(f"trainer checkpoint not found: {uri}")
        return torch.load(path, map_location=map_location, weights_only=True)
    data = storage.read(path)
    if data is None:
        raise FileNotFoundError(f"trainer checkpoint not found: {uri}")
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)


def save_torch(fs: Any, path: str, state: dict[str, Any]) -> None:
    """``torch.save(state)`` to ``path`` on ``fs``, atomically (``storage.fs.atomic_write``: a reader
    never sees half a checkpoint; a failed write, such as a full disk, names the file). Written as
    torch.save makes it, straight to the file: never a copy in memory (a full fine-tune's state is
    weights plus two AdamW moments, 1.6 GB for SmolLM2-135M)."""

    def write(f) -> int:
        out = _WriteErrors(f)
        try:
            torch.save(state, out)
        except RuntimeError:
            if out.error is not None:  # torch.save reports a failed write as "unexpected pos": say what failed
                raise out.error from None
            raise
        return out.written

    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    atomic_write_stream(fs, path, write)


class _WriteErrors:
    """A file for ``torch.save`` that keeps the error of a failed write (a full disk) and counts bytes."""

    def __init__(self, f) -> None:
        self.f, self.error, self.written = f, None, 0

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.written += len(data)
        return n

    def flush(self) -> None:
        self.f.flush()
