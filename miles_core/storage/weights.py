"""WeightStore: versioned, immutable weight snapshots on object storage.

```
<weights_dir>/
  v000003/model.safetensors   the state dict after 3 optimizer steps
  v000003/_COMMITTED          written last: only committed versions exist for readers
  LATEST                      text: the highest published version (a hint, checked on read)
```

``publish`` writes the tensors, then the commit marker, then ``LATEST``; a crash in between leaves
an uncommitted folder that readers ignore and the next publish of that version overwrites.
``load_snapshot(uri)`` reads a version folder by URI (what tasks hand to engines).

torch and safetensors are imported inside the functions that need them.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from miles_core.storage.fs import atomic_write, basename, join, open_fs, read_bytes, to_url

if TYPE_CHECKING:
    import fsspec
    import torch

MODEL_FILE = "model.safetensors"
COMMITTED = "_COMMITTED"
LATEST = "LATEST"
_VERSION_DIR = re.compile(r"^v(\d{6,})$")


def version_dir(version: int) -> str:
    return f"v{version:06d}"


class WeightStore:
    """Weight snapshots of one policy (or adapter), one folder per version."""

    def __init__(self, weights_dir_url: str, storage_options: dict[str, Any] | None = None):
        self.fs, self.path = open_fs(weights_dir_url, storage_options)

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
        folder = join(self.path, version_dir(_check_version(version)))
        if self.is_committed(version):
            raise FileExistsError(f"weights version {version} is already published at {self.uri(version)}")
        data = _serialize(state_dict, {**(metadata or {}), "miles.version": str(version)})
        atomic_write(self.fs, join(folder, MODEL_FILE), data)
        marker = {"version": version, "files": {MODEL_FILE: len(data)}}
        atomic_write(self.fs, join(folder, COMMITTED), json.dumps(marker).encode())
        current = self._read_latest_hint()
        if current is None or version > current:
            atomic_write(self.fs, join(self.path, LATEST), str(version).encode())
        return self.uri(version)

    # ------------------------------------------------------------------------------- reading

    def is_committed(self, version: int) -> bool:
        return self.fs.exists(join(self.path, version_dir(_check_version(version)), COMMITTED))

    def versions(self) -> list[int]:
        """Committed versions, ascending."""
        found = []
        for marker in self.fs.glob(join(self.path, "v*", COMMITTED)):
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
        data = read_bytes(self.fs, join(self.path, LATEST))
        if data is None:
            return None
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


def _serialize(state_dict: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """safetensors bytes of CPU, contiguous tensors. Tensors that share storage with an earlier
    one (tied embeddings) are copied, since safetensors refuses shared storage."""
    import torch
    from safetensors.torch import save

    bad_meta = {k: v for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad_meta:
        raise TypeError(f"weight metadata must map str to str; bad entries: {bad_meta}")
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, not a torch.Tensor")
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()
        seen.add(ptr)
        tensors[name] = t
    return save(tensors, metadata={"format": "pt", **metadata})


def _check_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"weight version must be an int >= 0, got {version!r}")
    return version
