"""WeightStore: versioned, immutable weight snapshots on object storage.

```
<weights_dir>/
  v000003/model.safetensors   the state dict after 3 optimizer steps
  v000003/_COMMITTED          written last: only committed versions exist for readers
  LATEST                      text: the highest published version (a hint, checked on read)
  pins/v000003/<reader>       durable pins: retention never deletes a pinned version
```

``LATEST`` moves by compare-and-swap (S3 ``If-Match: <etag>`` / ``If-None-Match: *``), and only
upwards, so two concurrent publishers never move it backwards. The one way back is
``rollback(version)``, for a run resumed from a checkpoint: LATEST moves back to ``version`` and
every newer version is deleted, so the redone steps can publish those version numbers again.
``retain(keep_last)`` deletes old versions (the ``_COMMITTED`` marker first, so readers never see
a half-deleted version) except the newest ``keep_last``, the latest, and pinned ones.

``publish`` writes the tensors, then the commit marker, then ``LATEST``; a crash in between leaves
an uncommitted folder that readers ignore and the next publish of that version overwrites.
``load_snapshot(uri)`` reads a version folder by URI (what tasks hand to engines). Snapshots are
written tensor by tensor in safetensors' format (``_SafetensorsLayout``: no copy of the weights in
memory) and can be read the same way (``SafetensorsFile``).

torch and safetensors are imported inside the functions that need them.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_core.storage.fs import (
    DEFAULT_RETRY,
    PreconditionFailed,
    RetryingFS,
    RetryPolicy,
    atomic_write_stream,
    basename,
    cas_write,
    join,
    list_names,
    open_fs,
    read_bytes,
    read_with_tag,
    to_url,
)
from miles_core.storage.layout import check_name

if TYPE_CHECKING:
    import fsspec
    import torch

MODEL_FILE = "model.safetensors"
COMMITTED = "_COMMITTED"
LATEST = "LATEST"
PINS = "pins"
_CAS_ATTEMPTS = 100
_VERSION_DIR = re.compile(r"^v(\d{6,})$")


def version_dir(version: int) -> str:
    return f"v{version:06d}"


class WeightStore:
    """Weight snapshots of one policy (or adapter), one folder per version."""

    def __init__(
        self, weights_dir_url: str, storage_options: dict[str, Any] | None = None, retry: RetryPolicy | None = None,
        dtype: str | None = None, tied_once: bool = False,
    ):
        """``dtype``: floating tensors are published in it (None: as given); ``tied_once``: a tensor
        that shares storage with an earlier one (a tied ``lm_head.weight``) is left out instead of
        copied, for engines that tie it again on load."""
        self.fs, self.path = open_fs(weights_dir_url, storage_options)
        self.retry = retry or DEFAULT_RETRY
        self.io = RetryingFS(self.fs, self.retry)
        self.dtype, self.tied_once = dtype, tied_once

    @property
    def base_uri(self) -> str:
        return to_url(self.fs, self.path)

    def uri(self, version: int) -> str:
        """URL (plain path for local files) of the folder of ``version``."""
        return to_url(self.fs, join(self.path, version_dir(_check_version(version))))

    def __repr__(self) -> str:
        return f"WeightStore({self.base_uri!r})"

    # ------------------------------------------------------------------------------- writing

    def publish(
        self, version: int, state_dict: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
    ) -> str:
        """Write ``state_dict`` as ``version``; returns the version's URI. Versions are immutable."""
        folder = self._new_version_folder(version)
        layout = _SafetensorsLayout(state_dict, {**(metadata or {}), "miles.version": str(version)}, self.dtype,
                                    self.tied_once)
        model = join(folder, MODEL_FILE)
        size = self.io.call(lambda: atomic_write_stream(self.fs, model, layout.write), model)
        return self._commit(version, folder, {MODEL_FILE: size})

    def publish_folder(self, version: int, local_dir: str | os.PathLike) -> str:
        """Publish the files of a local folder as ``version`` (e.g. a LoRA adapter in PEFT's folder
        format: ``adapter_config.json`` + ``adapter_model.safetensors``); returns the version's URI.
        ``download`` brings it back as a folder that ``PeftModel.from_pretrained`` reads."""
        files = sorted(p for p in Path(local_dir).iterdir() if p.is_file() and not p.name.startswith("."))
        if not files:
            raise ValueError(f"publish_folder: {local_dir} has no files to publish")
        folder = self._new_version_folder(version)
        sizes = {}
        for f in files:
            if f.name in (COMMITTED, LATEST):
                raise ValueError(f"publish_folder: {f} uses a name the weight store reserves")
            data = f.read_bytes()
            self.io.write(join(folder, f.name), data)
            sizes[f.name] = len(data)
        return self._commit(version, folder, sizes)

    def download(self, version: int | None, local_dir: str | os.PathLike) -> Path:
        """Copy the files of a committed version (None: latest) into ``local_dir``; returns it."""
        folder = self._committed_path(version)
        marker = join(folder, COMMITTED)
        listed = json.loads(self.io.call(lambda: self.fs.cat_file(marker), marker))["files"]
        out = Path(local_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name, size in listed.items():
            path = join(folder, name)
            data = self.io.call(lambda: self.fs.cat_file(path), path)
            if len(data) != size:
                raise ValueError(f"{to_url(self.fs, path)}: {len(data)} bytes, the commit marker says {size}")
            (out / name).write_bytes(data)
        return out

    def _new_version_folder(self, version: int) -> str:
        if self.is_committed(_check_version(version)):
            raise FileExistsError(f"weights version {version} is already published at {self.uri(version)}")
        return join(self.path, version_dir(version))

    def _commit(self, version: int, folder: str, sizes: dict[str, int]) -> str:
        """Write the commit marker (create-only: of two publishers of one version exactly one
        commits), then move LATEST."""
        marker = json.dumps({"version": version, "files": sizes}).encode()
        try:
            self.io.create(join(folder, COMMITTED), marker)
        except FileExistsError:
            raise FileExistsError(f"weights version {version} is already published at {self.uri(version)}") from None
        self._advance_latest(version)
        return self.uri(version)

    def _advance_latest(self, version: int) -> None:
        """Move LATEST to ``version`` unless it already points at or past it (compare-and-swap)."""
        path = join(self.path, LATEST)
        for _ in range(_CAS_ATTEMPTS):
            data, tag = self.io.call(lambda: read_with_tag(self.fs, path), path)
            current = None if data is None else self._parse_latest(data)
            if current is not None and current >= version:
                return
            try:
                self.io.call(lambda: cas_write(self.fs, path, str(version).encode(), tag), path)
                return
            except PreconditionFailed:
                continue  # another publisher moved it; re-read and compare again
        raise RuntimeError(f"{to_url(self.fs, path)}: could not move to {version} in {_CAS_ATTEMPTS} attempts")

    # ------------------------------------------------------------------------ pins, retention

    def pin(self, version: int, reader: str) -> None:
        """Durably protect ``version`` from ``retain`` on behalf of ``reader`` (idempotent)."""
        self.io.write(self._pin_path(version, reader), json.dumps({"version": version, "reader": reader}).encode())

    def unpin(self, version: int, reader: str) -> None:
        """Drop ``reader``'s pin of ``version`` (no error if there is none)."""
        path = self._pin_path(version, reader)

        def rm() -> None:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass

        self.io.call(rm, path)

    def pins(self) -> dict[int, set[str]]:
        """Pinned versions and who pins them."""
        root = join(self.path, PINS)
        found: dict[int, set[str]] = {}
        for folder in self.io.call(lambda: list_names(self.fs, root), root):
            m = _VERSION_DIR.match(folder)
            if m:
                readers = set(self.io.call(lambda: list_names(self.fs, join(root, folder)), join(root, folder)))
                if readers:
                    found[int(m.group(1))] = readers
        return found

    def retain(self, keep_last: int, pinned: set[int] | None = None) -> list[int]:
        """Delete committed versions except the newest ``keep_last``, the latest, ``pinned`` and
        durably pinned ones; returns the deleted versions. The commit marker goes first, so a
        reader sees a version whole or not at all (a reader that already resolved it may fail)."""
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
        versions = self.versions()
        keep = set(versions[-keep_last:]) | set(pinned or ()) | set(self.pins())
        latest = self.latest()
        if latest is not None:
            keep.add(latest)
        deleted = []
        for version in versions:
            if version in keep:
                continue
            self._delete(version)
            deleted.append(version)
        return deleted

    def rollback(self, version: int) -> list[int]:
        """Make ``version`` the latest again (0: nothing published) and delete every newer version;
        returns the deleted versions, newest first. For a run resumed from a checkpoint: the newer
        versions came from steps that are redone, which publish those numbers again (``publish``
        never overwrites a committed version).

        LATEST moves first (compare-and-swap: RuntimeError if it changes meanwhile), then newer
        versions go newest first, each commit marker before its files; a crash part way leaves
        LATEST at ``version`` and a call again finishes the job. Only while nothing publishes to
        this store. ValueError, touching nothing, when ``version`` (> 0) is not committed or a
        newer version is pinned."""
        committed = self.is_committed(_check_version(version))
        if version > 0 and not committed:
            raise ValueError(
                f"cannot roll back to weights version {version}: {self.uri(version)} is not committed; "
                f"available versions: {self.versions() or 'none'}"
            )
        pinned = {v: readers for v, readers in self.pins().items() if v > version}
        if pinned:
            raise ValueError(f"cannot roll back {self.base_uri} to version {version}: newer versions are pinned "
                             f"{pinned}; unpin them first")
        newer = [v for v in reversed(self.versions()) if v > version]
        self._move_latest_back(version if committed else None)
        for v in newer:
            self._delete(v)
        return newer

    def _move_latest_back(self, version: int | None) -> None:
        """Point LATEST at ``version`` (None: remove it), whichever way that moves it."""
        path = join(self.path, LATEST)
        data, tag = self.io.call(lambda: read_with_tag(self.fs, path), path)
        if (None if data is None else self._parse_latest(data)) == version:
            return
        try:
            if version is None:
                self.io.call(lambda: self.fs.rm_file(path), path)
            else:
                self.io.call(lambda: cas_write(self.fs, path, str(version).encode(), tag), path)
        except PreconditionFailed:
            raise RuntimeError(f"{to_url(self.fs, path)} changed during rollback to version {version}: "
                               "something is still publishing to this weight store") from None

    def _delete(self, version: int) -> None:
        """Delete a version: its commit marker first, so no reader takes it for a whole one."""
        folder = join(self.path, version_dir(version))
        marker = join(folder, COMMITTED)
        self.io.call(lambda: self.fs.rm_file(marker), marker)
        self.io.call(lambda: self.fs.rm(folder, recursive=True), folder)

    def _pin_path(self, version: int, reader: str) -> str:
        return join(self.path, PINS, version_dir(_check_version(version)), check_name("reader", reader))

    # ------------------------------------------------------------------------------- reading

    def is_committed(self, version: int) -> bool:
        return self.io.exists(join(self.path, version_dir(_check_version(version)), COMMITTED))

    def versions(self) -> list[int]:
        """Committed versions, ascending."""
        found = []
        pattern = join(self.path, "v*", COMMITTED)
        for marker in self.io.call(lambda: self.fs.glob(pattern), self.path):
            m = _VERSION_DIR.match(basename(marker.rsplit("/", 1)[0]))
            if m:
                found.append(int(m.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        """The highest committed version, or None if nothing is published."""
        hint = self._read_latest_hint()
        if hint is not None and self.is_committed(hint):
            return hint
        versions = self.versions()  # no LATEST yet, or it points at an uncommitted version
        return versions[-1] if versions else None

    def load(self, version: int | None = None) -> dict[str, torch.Tensor]:
        """The state dict of ``version`` (None: the latest)."""
        return _load_committed(self.fs, self._committed_path(version))

    def metadata(self, version: int | None = None) -> dict[str, str]:
        """The safetensors metadata of ``version`` (None: the latest), read from the header only."""
        path = join(self._committed_path(version), MODEL_FILE)
        header_len = int.from_bytes(self.fs.cat_file(path, start=0, end=8), "little")
        header = json.loads(self.fs.cat_file(path, start=8, end=8 + header_len))
        return header.get("__metadata__", {})

    def wait_for(self, version: int, timeout: float, poll: float = 0.1) -> str:
        """Block until ``version`` is committed; returns its URI. TimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not self.is_committed(_check_version(version)):
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"weights version {version} not published at {self.uri(version)} after {timeout}s "
                    f"(latest: {self.latest()})"
                )
            time.sleep(poll)
        return self.uri(version)

    def _committed_path(self, version: int | None) -> str:
        if version is None:
            version = self.latest()
            if version is None:
                raise FileNotFoundError(f"no weights published under {self.base_uri}")
        if not self.is_committed(_check_version(version)):
            raise FileNotFoundError(
                f"weights version {version} not found: {self.uri(version)} is not committed; "
                f"available versions: {self.versions() or 'none'}"
            )
        return join(self.path, version_dir(version))

    def _read_latest_hint(self) -> int | None:
        data = self.io.read(join(self.path, LATEST))
        return None if data is None else self._parse_latest(data)

    def _parse_latest(self, data: bytes) -> int:
        try:
            return int(data.decode().strip())
        except ValueError:
            uri = to_url(self.fs, join(self.path, LATEST))
            raise ValueError(f"{uri}: not a version number: {data[:40]!r}") from None


def load_snapshot(uri: str, storage_options: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of the committed version folder at ``uri`` (what ``publish`` returned)."""
    fs, path = open_fs(uri, storage_options)
    return _load_committed(fs, path)


def _load_committed(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    uri = to_url(fs, path)
    if not fs.exists(join(path, COMMITTED)):
        raise FileNotFoundError(f"{uri} is not a committed weight snapshot ({COMMITTED} missing)")
    data = read_bytes(fs, join(path, MODEL_FILE))
    if data is None:
        raise FileNotFoundError(f"{uri} is committed but {MODEL_FILE} is missing")
    try:
        return load(data)
    except Exception as e:  # safetensors raises its own SafetensorError
        raise ValueError(f"cannot decode {join(uri, MODEL_FILE)}: {e}") from e


_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_DTYPES_BY_CODE = {code: name for name, code in _SAFETENSORS_DTYPES.items()}


class SafetensorsFile:
    """A local safetensors file read tensor by tensor with plain reads (not a memory map, whose pages
    would count as the reader's memory while it is open): ``entries`` gives each tensor's dtype name,
    shape and byte range from the header; ``read_into(name, out)`` fills ``out`` (same dtype, shape,
    contiguous) straight from the file, so a model's parameter can be loaded with no copy in between."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= os.path.getsize(path) - 8:
                raise ValueError(f"{path}: not a safetensors file (header length {size})")
            header = json.loads(f.read(size))
        self.data_start = 8 + size
        self.entries: dict[str, dict[str, Any]] = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((e["data_offsets"][1] for e in self.entries.values()), default=0)
        if self.data_start + end > os.path.getsize(path):
            raise ValueError(f"{path}: cut short ({os.path.getsize(path)} bytes; its header needs {self.data_start + end})")

    def dtype(self, name: str) -> torch.dtype:
        import torch

        code = self.entries[name]["dtype"]
        if code not in _DTYPES_BY_CODE:
            raise ValueError(f"{self.path}: tensor {name} has dtype {code}, which this reader does not take")
        return getattr(torch, _DTYPES_BY_CODE[code])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        import torch

        begin, end = self.entries[name]["data_offsets"]
        if not out.is_contiguous() or out.dtype != self.dtype(name) or tuple(out.shape) != self.shape(name):
            raise ValueError(f"{self.path}: {name} cannot be read into a {out.dtype} tensor of shape {tuple(out.shape)}")
        if end > begin:
            with open(self.path, "rb") as f:
                f.seek(self.data_start + begin)
                view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
                if f.readinto(view) != end - begin:
                    raise ValueError(f"{self.path}: cut short inside {name}")
        return out

    def tensor(self, name: str) -> torch.Tensor:
        import torch

        return self.read_into(name, torch.empty(self.shape(name), dtype=self.dtype(name)))


class _SafetensorsLayout:
    """A state dict as one safetensors file, written tensor by tensor (``write``): the header first,
    then each tensor's bytes straight from its memory, cast to ``dtype`` (floating tensors) or moved
    to the CPU one at a time. So publishing never holds a second copy of the weights, where
    ``safetensors.torch.save`` holds two (each tensor's bytes, then the file's). A tensor that is an
    earlier one under another name (tied embeddings) is left out with ``tied_once``, else written
    again (safetensors refuses shared storage)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], metadata: dict[str, str], dtype: str | None,
                 tied_once: bool) -> None:
        import torch

        from miles_core.dtypes import torch_dtype

        bad_meta = {k: v for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)}
        if bad_meta:
            raise TypeError(f"weight metadata must map str to str; bad entries: {bad_meta}")
        cast = None if dtype is None else torch_dtype(dtype, "WeightStore")
        self.tensors: list[tuple[str, torch.Tensor, torch.dtype]] = []
        header: dict[str, Any] = {"__metadata__": {"format": "pt", **metadata}}
        seen, offset = set(), 0
        for name, t in state_dict.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, not a torch.Tensor")
            same = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if tied_once and t.numel() and same in seen:
                continue
            seen.add(same)
            out = cast if cast is not None and t.is_floating_point() else t.dtype
            if str(out).removeprefix("torch.") not in _SAFETENSORS_DTYPES:
                raise TypeError(f"state_dict[{name!r}] is {out}, which snapshots do not store "
                                f"({', '.join(_SAFETENSORS_DTYPES)})")
            size = t.numel() * out.itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[str(out).removeprefix("torch.")], "shape": list(t.shape),
                            "data_offsets": [offset, offset + size]}
            self.tensors.append((name, t, out))
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        self.header = text + b" " * (-len(text) % 8)  # the data starts 8-byte aligned

    def write(self, f) -> int:
        import torch

        f.write(len(self.header).to_bytes(8, "little"))
        f.write(self.header)
        size = 8 + len(self.header)
        for _, t, dtype in self.tensors:
            data = t.detach().to("cpu", dtype).contiguous().reshape(-1)
            if data.numel():
                f.write(memoryview(data.view(torch.uint8).numpy()))
                size += data.numel() * dtype.itemsize
        return size


def _check_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"weight version must be an int >= 0, got {version!r}")
    return version
