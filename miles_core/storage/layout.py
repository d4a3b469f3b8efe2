"""Where a run's files live: the one place that names them.

```
<root>/<name>/<run_id>/
  config.json                      the run config (public part, no storage options)
  samples/<producer>/<seq>.arrow   SampleStream segments; samples/<producer>/_END closes a stream
  cursors/<producer>/<reader>.json durable read cursors (one per reader of each stream)
  weights/v<version>/              WeightStore snapshots; weights/LATEST
  state/data_source.json           the prompt cursor after the latest rollout
  checkpoints/step-<k>/trainer.pt  the trainer's state after k steps (``Trainer.save``)
  checkpoints/step-<k>/state.json  step, weight version, prompt cursor; written last
  metrics.jsonl  eval.jsonl  summary.json
```

``write_checkpoint`` makes a checkpoint visible whole (on local files it is written under a
temporary name, ``checkpoints/.partial-step-<k>-<hex>/``, and renamed). A checkpoint folder
without ``state.json`` is incomplete (a save that did not finish) and is ignored:
``checkpoints()`` and ``latest_checkpoint()`` list complete ones only; ``incomplete_checkpoints()``
names the others.
``prune_checkpoints(keep)`` deletes all but the newest ``keep`` complete checkpoints (the newest is
never deleted), and the incomplete ones older than the newest complete one.

``SampleStream`` and ``WeightStore`` take a run folder or weights folder URL and use the
relative-path helpers below, so they agree with ``RunLayout`` without depending on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from miles_core.storage.fs import (
    DEFAULT_RETRY,
    RetryingFS,
    RetryPolicy,
    cas_write,
    is_local,
    join,
    list_names,
    open_fs,
    read_with_tag,
    to_url,
)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
CHECKPOINTS = "checkpoints"
CHECKPOINT_STATE = "state.json"
TRAINER_STATE = "trainer.pt"
PARTIAL_PREFIX = ".partial-"
"""A checkpoint being written on local files: ``checkpoints/.partial-step-<k>-<hex>/``."""
_CHECKPOINT_DIR = re.compile(r"^step-(\d{6,})$")


def check_name(kind: str, name: str) -> str:
    """A producer, reader or run name becomes a path part: no separators, no leading dot."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"invalid {kind} name {name!r}: use letters, digits, '_', '-', '.' (not first), no '/'"
        )
    return name


def samples_dir(producer: str) -> str:
    return f"samples/{check_name('producer', producer)}"


def cursor_file(producer: str, reader: str) -> str:
    # Cursors are per stream: a reader called "trainer" of "rollout" and of "eval" are distinct.
    return f"cursors/{check_name('producer', producer)}/{check_name('reader', reader)}.json"


def checkpoint_dir(step: int) -> str:
    """The checkpoint folder of the run after ``step`` training steps."""
    return f"{CHECKPOINTS}/step-{step:06d}"


def _checkpoint_steps(folder_names) -> list[int]:
    """The steps of the names that are checkpoint folders (``step-<k>``), ascending."""
    return sorted(int(m.group(1)) for m in map(_CHECKPOINT_DIR.match, folder_names) if m)


def _replace_folder(src: str, dst: str) -> None:
    """Rename local folder ``src`` to ``dst``, replacing a folder there (moved aside, then deleted
    once ``src`` is in place); the parent folder is synced so the rename survives a crash."""
    old = None
    if os.path.exists(dst):
        old = f"{src}.replaced"
        os.rename(dst, old)
    os.rename(src, dst)
    fd = os.open(os.path.dirname(dst), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def new_run_id() -> str:
    """A fresh run id that sorts by creation time (UTC), e.g. ``20261130-141502-ab12``."""
    return f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


class RunLayout:
    """The URLs of one run's files; reads and writes its small JSON files, lists and prunes its
    checkpoints. Building one touches no storage."""

    def __init__(self, root_url: str, name: str, run_id: str, storage_options: dict[str, Any] | None = None,
                 retry: RetryPolicy | None = None):
        self.fs, root = open_fs(root_url, storage_options)
        self.retry = retry or DEFAULT_RETRY
        """Transient storage errors are retried by this policy (a run's: ``storage.max_outage_s``)."""
        self.io = RetryingFS(self.fs, self.retry)
        self.name = check_name("run", name)
        self.run_id = check_name("run id", run_id)
        self.path = join(root, name, run_id)
        """The run folder as a path inside ``self.fs``."""

    def url(self, *parts: str) -> str:
        """URL (plain path for local files) of ``parts`` under the run folder."""
        return to_url(self.fs, join(self.path, *parts))

    @property
    def run_dir(self) -> str:
        return self.url()

    @property
    def config(self) -> str:
        return self.url("config.json")

    def samples(self, producer: str = "rollout") -> str:
        return self.url(samples_dir(producer))

    def cursor(self, reader: str, producer: str = "rollout") -> str:
        return self.url(cursor_file(producer, reader))

    @property
    def weights(self) -> str:
        return self.url("weights")

    @property
    def metrics(self) -> str:
        return self.url("metrics.jsonl")

    @property
    def eval(self) -> str:
        return self.url("eval.jsonl")

    @property
    def summary(self) -> str:
        return self.url("summary.json")

    def checkpoint(self, step: int, file: str = "") -> str:
        """URL of the checkpoint folder of ``step`` (or of ``file`` in it)."""
        return self.url(checkpoint_dir(step), file)

    def checkpoints(self) -> list[int]:
        """Steps of the complete checkpoints (those with ``state.json``), ascending."""
        pattern = join(self.path, CHECKPOINTS, "step-*", CHECKPOINT_STATE)
        markers = self.io.call(lambda: self.fs.glob(pattern), join(self.path, CHECKPOINTS))
        return _checkpoint_steps(marker.rsplit("/", 2)[-2] for marker in markers)

    def write_checkpoint(self, step: int, write: Callable[[str], Any], state: dict[str, Any]) -> str:
        """Write checkpoint ``step`` whole or not at all: ``write(folder_url)`` writes the trainer's
        files into a folder, then ``state.json`` (``state``) goes last; returns the folder's URL.

        Local files: the folder is ``checkpoints/.partial-step-<k>-<hex>`` and is renamed into place
        when complete, so a failed write (a full disk) leaves nothing named ``step-<k>``; a folder
        already at that step (an incomplete one, or a damaged one being redone) is replaced. Object
        stores have no folder rename: the final folder is written, ``state.json`` last, which is what
        makes it complete. Either way a failed write's files are deleted as far as storage allows."""
        final = join(self.path, checkpoint_dir(step))
        local = is_local(self.fs)
        folder = join(self.path, CHECKPOINTS, f"{PARTIAL_PREFIX}{checkpoint_dir(step).rsplit('/', 1)[-1]}-"
                                              f"{secrets.token_hex(3)}") if local else final
        if not local:  # a checkpoint redone at this step stops counting as complete before its files change
            self.remove(f"{checkpoint_dir(step)}/{CHECKPOINT_STATE}")
        try:
            write(to_url(self.fs, folder))
            self.io.write(join(folder, CHECKPOINT_STATE), json.dumps(state, indent=2, sort_keys=True).encode())
            if local:
                _replace_folder(folder, final)
        except BaseException:
            with contextlib.suppress(Exception):  # the write's own error is the one to report
                self.fs.rm(folder, recursive=True)
            raise
        return to_url(self.fs, final)

    def incomplete_checkpoints(self) -> list[str]:
        """The folders under ``checkpoints/`` that are no complete checkpoint: ``step-<k>`` without
        ``state.json`` and temporary ``.partial-*`` ones (each a save that did not finish), by name."""
        folder = join(self.path, CHECKPOINTS)
        names = self.io.call(lambda: list_names(self.fs, folder), folder)
        complete = {checkpoint_dir(step).rsplit("/", 1)[-1] for step in self.checkpoints()}
        return sorted(n for n in names if (_CHECKPOINT_DIR.match(n) or n.startswith(PARTIAL_PREFIX)) and n not in complete)

    def remove_checkpoint_folder(self, name: str) -> None:
        """Delete the folder ``checkpoints/<name>`` (an incomplete one)."""
        folder = join(self.path, CHECKPOINTS, name)
        self.io.call(lambda: self.fs.rm(folder, recursive=True), folder)

    def latest_checkpoint(self) -> int | None:
        """The step of the newest complete checkpoint, or None when there is none."""
        steps = self.checkpoints()
        return steps[-1] if steps else None

    def prune_checkpoints(self, keep: int) -> list[int]:
        """Delete complete checkpoints but the newest ``keep``, and incomplete ones older than the
        newest complete one (left by saves that did not finish); returns the deleted steps.
        ``state.json`` goes first, so a half-deleted checkpoint is never taken for a complete one."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        complete = self.checkpoints()
        if not complete:
            return []
        kept = set(complete[-keep:])
        every = _checkpoint_steps(list_names(self.fs, join(self.path, CHECKPOINTS)))
        doomed = [step for step in every if step < complete[-1] and step not in kept]
        for step in doomed:
            folder = join(self.path, checkpoint_dir(step))
            if step in complete:
                self.fs.rm_file(join(folder, CHECKPOINT_STATE))
            self.fs.rm(folder, recursive=True)
        return doomed

    def _write(self, rel: str, data: bytes) -> str:
        self.io.write(join(self.path, rel), data)
        return self.url(rel)

    def remove(self, rel: str) -> None:
        """Delete the file ``rel`` under the run folder (nothing if it is not there)."""
        path = join(self.path, rel)

        def rm() -> None:
            if self.fs.exists(path):
                self.fs.rm_file(path)

        self.io.call(rm, path)

    def write_json(self, rel: str, obj: Any) -> str:
        """Replace the JSON file ``rel`` under the run folder atomically; returns its URL."""
        return self._write(rel, json.dumps(obj, indent=2, sort_keys=True).encode())

    def write_text(self, rel: str, text: str) -> str:
        """Replace the text file ``rel`` under the run folder atomically (a report); returns its URL."""
        return self.write_bytes(rel, text.encode())

    def write_bytes(self, rel: str, data: bytes) -> str:
        """Replace the file ``rel`` under the run folder atomically (an image); returns its URL."""
        return self._write(rel, data)

    def read_json(self, rel: str) -> Any | None:
        """The JSON file ``rel`` under the run folder, or None when it does not exist."""
        data = self.io.read(join(self.path, rel))
        return None if data is None else json.loads(data)

    def read_json_tagged(self, rel: str) -> tuple[Any | None, str | None]:
        """The JSON file ``rel`` and its tag for ``swap_json``; (None, None) when it does not exist."""
        path = join(self.path, rel)
        data, tag = self.io.call(lambda: read_with_tag(self.fs, path), path)
        return (None, None) if data is None else (json.loads(data), tag)

    def swap_json(self, rel: str, obj: Any, tag: str | None) -> None:
        """Replace the JSON file ``rel`` only if it still has ``tag`` (None: only if it does not
        exist); ``PreconditionFailed`` when another writer changed it first."""
        path, data = join(self.path, rel), json.dumps(obj, indent=2, sort_keys=True).encode()
        self.io.call(lambda: cas_write(self.fs, path, data, tag), path)

    def read_jsonl(self, rel: str) -> list[dict[str, Any]]:
        """The rows of the JSON-lines file ``rel`` (empty when it does not exist)."""
        data = self.io.read(join(self.path, rel))
        return [] if data is None else [json.loads(line) for line in data.decode().splitlines() if line.strip()]

    def write_jsonl(self, rel: str, rows: list[dict[str, Any]]) -> str:
        """Replace the JSON-lines file ``rel`` (object stores cannot append, so the whole file)."""
        return self._write(rel, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode())

    def __repr__(self) -> str:
        return f"RunLayout({self.run_dir!r})"
