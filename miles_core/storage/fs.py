"""fsspec helpers shared by the storage classes.

- ``open_fs(url)`` resolves a URL (or a plain local path) to a filesystem and a root path.
- ``atomic_write(fs, path, data)`` makes a file visible only when whole.
- ``join`` / ``to_url`` / ``basename`` build and print paths the same way on every backend.

Everything in ``miles_core.storage`` reaches storage through these, so a backend's quirks
(local files need temp + rename; object stores make a PUT visible whole) live in one place.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem


def open_fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem of ``url`` and the path of ``url`` inside it.

    Plain local paths work and are made absolute. Listing caches are off by default: readers poll
    for new objects, and a cached listing would hide them (s3fs keeps listings forever otherwise).
    """
    options = dict(storage_options or {})
    options.setdefault("use_listings_cache", False)
    try:
        fs, path = url_to_fs(str(url), **options)
    except ImportError as e:
        raise ImportError(f"cannot open {url!r}: {e}") from e
    except ValueError as e:
        raise ValueError(f"cannot open {url!r}: {e}") from e
    return fs, path.rstrip("/") or path


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def join(*parts: str) -> str:
    """Join path parts with ``/`` (no duplicate separators; a leading ``/`` of the first is kept)."""
    if not parts:
        raise ValueError("join() needs at least one path part")
    head = parts[0].rstrip("/") or parts[0]
    tail = [p.strip("/") for p in parts[1:] if p.strip("/")]
    if head.endswith("/"):  # the root "/" itself
        return head + "/".join(tail)
    return "/".join([head, *tail])


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def to_url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """What to hand to other tasks: a plain path for local files, a full URL otherwise."""
    return path if is_local(fs) else fs.unstrip_protocol(path)


def atomic_write(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees either nothing (or the old file) or all of it.

    Overwrites an existing file. The caller guarantees a single writer per path.
    """
    if is_local(fs):
        _atomic_write_local(path, data)
    else:
        # memory://: one pipe stores the bytes on close, in one step. Object stores (s3://) make a
        # PUT visible whole, never partially. A create-only PUT (If-None-Match) comes later.
        fs.pipe_file(path, data)


def _atomic_write_local(path: str, data: bytes) -> None:
    """Temp file in the same folder (same filesystem, so rename is atomic), fsync, then rename.

    The temp name starts with a dot and has a random suffix, so readers that match exact names
    ignore it, and a crashed writer leaves only a stray temp file behind.
    """
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_bytes(fs: fsspec.AbstractFileSystem, path: str) -> bytes | None:
    """The whole file, or None when it does not exist."""
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        return None


def list_names(fs: fsspec.AbstractFileSystem, folder: str) -> list[str]:
    """Base names of the entries directly in ``folder`` (empty if the folder does not exist)."""
    try:
        entries = fs.ls(folder, detail=False, refresh=True)
    except FileNotFoundError:
        return []
    return [basename(e) for e in entries]
