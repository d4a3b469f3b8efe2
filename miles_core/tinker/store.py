"""Where the Tinker service keeps what must outlive it: ``TinkerStore``, in the run storage.

Layout under ``<root>/tinker/`` (any fsspec URL: local folders, ``s3://``):

- ``sessions/<session_id>.json``: a client session (when, tags, SDK version): ``Sessions``.
- ``models/<folder>/model.json``: a training client (model id, session, base model, LoRA rank and
  targets, seed); ``<folder>`` is the model id with ``:`` as ``-``.
- ``models/<folder>/weights/<name>/state.pt`` + ``meta.json``: a ``save_state`` (adapter, optimizer,
  step; the ``seq_id`` of the call that saved it), ``tinker://<model_id>/weights/<name>``.
- ``models/<folder>/sampler_weights/<name>/``: a ``save_weights_for_sampler`` snapshot in PEFT's
  folder format, ``tinker://<model_id>/sampler_weights/<name>``. Snapshots are written once and
  never replaced: a name that exists is refused.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from miles_core.storage.fs import RetryingFS, join, list_names

KINDS = ("weights", "sampler_weights")


class PathError(ValueError):
    """A ``tinker://`` path that is malformed or names nothing here."""


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: str
    name: str

    @classmethod
    def parse(cls, path: str) -> TinkerPath:
        parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in KINDS or not all(parts):
            raise PathError(f"{path!r} is not a checkpoint path of this service: expected "
                            "tinker://<model_id>/weights/<name> or tinker://<model_id>/sampler_weights/<name>")
        return cls(*parts)

    def __str__(self) -> str:
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"


def check_name(name: str) -> str:
    if not name or "/" in name or name in (".", "..") or name.startswith("."):
        raise PathError(f"checkpoint name {name!r}: give a non-empty name without '/' that does not start with '.'")
    return name


def model_folder(model_id: str) -> str:
    return model_id.replace(":", "-")


class TinkerStore:
    """The service's files under ``<root>/tinker`` (module docstring)."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.storage, base = RetryingFS.open(root, storage_options)
        self.base = join(base, "tinker")
        self.sessions = Sessions(self)

    def path(self, *parts: str) -> str:
        return join(self.base, *parts)

    def url(self, *parts: str) -> str:
        return self.storage.url(self.path(*parts))

    def write_json(self, rel: tuple[str, ...], obj: Any) -> None:
        self.storage.write(self.path(*rel), json.dumps(obj, sort_keys=True).encode())

    def read_json(self, rel: tuple[str, ...]) -> Any | None:
        data = self.storage.read(self.path(*rel))
        return None if data is None else json.loads(data)

    def checkpoint(self, p: TinkerPath) -> tuple[str, ...]:
        return ("models", model_folder(p.model_id), p.kind, p.name)

    def resolve(self, path: str, kind: str) -> TinkerPath:
        """The checkpoint ``path`` names, which must be of ``kind`` and exist (``PathError`` otherwise)."""
        p = TinkerPath.parse(path)
        if p.kind != kind:
            raise PathError(f"{path}: a {p.kind} checkpoint; this call needs a {kind} one")
        if not self.exists(p):
            raise PathError(f"{path}: no such checkpoint in {self.url()}")
        return p

    def restart_message(self, model_id: str) -> str:
        """What a restarted service tells a training client it knows only from the store."""
        states = self.states(model_id)
        if not states:
            return (f"the service restarted and training client {model_id} had no saved state: its adapter was "
                    "lost; create a new training client")
        last = states[-1]
        return (f"the service restarted; training client {model_id}'s last saved state is {last['path']} "
                f"(seq_id {last['seq_id']}, step {last['steps']}), and its calls after that were lost; "
                f"load_state_with_optimizer({last['path']!r}) and go on from there")

    def exists(self, p: TinkerPath) -> bool:
        return self.storage.exists(self.path(*self.checkpoint(p), "meta.json"))

    def put_folder(self, p: TinkerPath, local: str, meta: dict[str, Any]) -> str:
        """Copy the local folder ``local`` to checkpoint ``p`` (its ``meta.json`` last, so a
        checkpoint with one is whole); FileExistsError when ``p`` exists. Returns its URL."""
        if self.exists(p):
            raise FileExistsError(f"{p} exists; checkpoints are never replaced: pick another name")
        for name in sorted(os.listdir(local)):
            with open(os.path.join(local, name), "rb") as f:
                self.storage.write(self.path(*self.checkpoint(p), name), f.read())
        self.storage.create(self.path(*self.checkpoint(p), "meta.json"), json.dumps(meta, sort_keys=True).encode())
        return self.url(*self.checkpoint(p))

    def read_file(self, p: TinkerPath, name: str) -> bytes:
        data = self.storage.read(self.path(*self.checkpoint(p), name))
        if data is None or not self.exists(p):
            raise PathError(f"{p}: no such checkpoint in {self.url()}")
        return data

    def meta(self, p: TinkerPath) -> dict[str, Any]:
        meta = self.read_json((*self.checkpoint(p), "meta.json"))
        if meta is None:
            raise PathError(f"{p}: no such checkpoint in {self.url()}")
        return meta

    def models(self) -> list[dict[str, Any]]:
        """Every training client's ``model.json``."""
        out = []
        for folder in list_names(self.storage.fs, self.path("models")):
            info = self.read_json(("models", folder, "model.json"))
            if info is not None:
                out.append(info)
        return out

    def states(self, model_id: str) -> list[dict[str, Any]]:
        """The ``meta.json`` of each ``save_state`` of ``model_id``, oldest first."""
        folder = self.path("models", model_folder(model_id), "weights")
        metas = [self.read_json(("models", model_folder(model_id), "weights", n, "meta.json"))
                 for n in list_names(self.storage.fs, folder)]
        return sorted((m for m in metas if m), key=lambda m: m["saved_at"])


class Sessions:
    """The SDK's client sessions, each a file in the store (so they outlive a restart)."""

    def __init__(self, store: TinkerStore) -> None:
        self.store = store
        self.known: dict[str, dict[str, Any]] = {}

    def create(self, body: dict[str, Any]) -> str:
        session_id = uuid.uuid4().hex
        record = {"session_id": session_id, "created": time.time(), "tags": body.get("tags") or [],
                  "sdk_version": body.get("sdk_version"), "display_name": body.get("display_name")}
        self.known[session_id] = record
        self.store.write_json(("sessions", f"{session_id}.json"), record)
        return session_id

    def heartbeat(self, session_id: str) -> bool:
        """Whether the session exists (in memory, or in the store after a restart)."""
        if session_id not in self.known:
            record = self.store.read_json(("sessions", f"{session_id}.json"))
            if record is None:
                return False
            self.known[session_id] = record
        self.known[session_id]["last_heartbeat"] = time.time()
        return True
