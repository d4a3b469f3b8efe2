"""fsspec helpers shared by the storage classes.

- ``open_fs(url)`` resolves a URL (or a plain local path) to a filesystem and a root path.
- ``atomic_write(fs, path, data)`` makes a file visible only when whole.
- ``join`` / ``to_url`` / ``basename`` build and print paths the same way on every backend.
- ``read_with_tag`` / ``cas_write`` do compare-and-swap (S3 ``If-Match: <etag>``);
  ``list_after`` lists only names after a cursor (S3 ``StartAfter``).
- ``RetryingFS``: a filesystem whose calls are retried on transient endpoint errors (bounded
  back-off per a ``RetryPolicy``), the one way storage calls are retried; its ``create`` never
  overwrites (S3 ``If-None-Match: *``, local ``os.link``).
- ``copy_to_disk(url, dest)``: a copy on this machine of a remote file or folder (for readers that
  take only paths: PEFT, an inference server).

Everything in ``miles_core.storage`` reaches storage through these, so a backend's quirks
(local files need temp + rename; object stores make a PUT visible whole) live in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import io
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

import fsspec
import fsspec.asyn
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

log = logging.getLogger(__name__)
T = TypeVar("T")


def open_fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem of ``url`` and the path of ``url`` inside it.

    Plain local paths work and are made absolute. Listing caches are off by default: readers poll
    for new objects, and a cached listing would hide them (s3fs keeps listings forever otherwise).
    """
    options = dict(storage_options or {})
    options.setdefault("use_listings_cache", False)
    if str(url).startswith(("s3://", "s3a://")):
        # Our RetryPolicy bounds the retries; botocore's own would multiply them.
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
        config.setdefault("connect_timeout", 2)
        options["config_kwargs"] = config
    try:
        fs, path = url_to_fs(str(url), **options)
    except ImportError as e:
        raise ImportError(f"cannot open {url!r}: {e}") from e
    except (ValueError, TypeError) as e:  # never echo the options: they may hold credentials
        raise ValueError(f"cannot open {url!r}: {type(e).__name__}: {e}") from e
    if is_s3(fs):
        fs.retries = 1  # s3fs's own retry loop (5 by default) would multiply ours too
    return fs, path.rstrip("/") or path


def copy_to_disk(url: str, dest: str, storage_options: dict[str, Any] | None = None) -> str:
    """Copy the folder or file at ``url`` into the local folder ``dest``; the copy's path: ``dest``
    for a folder, ``dest/<name>`` for a file. Each file is retried on transient endpoint errors
    (``RetryingFS``); ``FileNotFoundError`` names ``url`` when it is neither."""
    storage, path = RetryingFS.open(url, storage_options)
    fs = storage.fs

    def get(remote: str, target: str) -> None:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        storage.call(lambda: fs.get_file(remote, target), remote)

    if storage.call(lambda: fs.isdir(path), path):
        for remote in storage.call(lambda: fs.find(path), path):
            if not remote.endswith("/"):  # object stores list folder markers as keys ending in /
                get(remote, os.path.join(dest, os.path.relpath(remote, path)))
        return dest
    if not storage.exists(path):
        raise FileNotFoundError(f"{url}: no such file or folder")
    target = os.path.join(dest, basename(path))
    get(path, target)
    return target


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


def atomic_write_stream(fs: fsspec.AbstractFileSystem, path: str, write: Callable[[BinaryIO], int]) -> int:
    """``atomic_write`` for data produced piece by piece: ``write(f)`` writes it to ``f`` and returns
    how many bytes it wrote (returned here), so no whole copy of it is ever held in memory. Local: a
    fsynced temp file renamed into place; elsewhere one streamed upload, visible whole when it closes."""
    if not is_local(fs):
        if not isinstance(fs, fsspec.asyn.AsyncFileSystem):  # e.g. memory://, which shows a file as it is written
            buffer = io.BytesIO()
            size = write(buffer)
            fs.pipe_file(path, buffer.getvalue())
            return size
        f = fs.open(path, "wb")
        try:  # an object store's upload (S3 multipart) becomes visible whole when it closes
            size = write(f)
        except BaseException:
            f.discard()  # aborted: nothing of it shows
            f.closed = True  # else closing it later (at garbage collection) would try to finish the upload
            raise
        f.close()
        return size
    written = []
    with _local_temp(path, lambda f: written.append(write(f))) as tmp:
        os.replace(tmp, path)
    return written[0]


def _atomic_write_local(path: str, data: bytes) -> None:
    """Temp file in the same folder (same filesystem, so rename is atomic), fsync, then rename."""
    with _local_temp(path, data) as tmp:
        os.replace(tmp, path)


@contextlib.contextmanager
def _local_temp(path: str, data: bytes | Callable[[BinaryIO], Any]):
    """A fsynced temp file beside ``path`` holding ``data`` (bytes, or a function that writes them to
    the open file); removed on exit if still there.

    The temp name starts with a dot and has a random suffix, so readers that match exact names
    ignore it, and a crashed writer leaves only a stray temp file behind.
    """
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        try:
            with open(tmp, "xb") as f:
                if callable(data):
                    data(f)
                else:
                    f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # a write error names no file: say which, and what to do when the disk is full
            hint = "; the disk is full: free space there, or move storage.root" if e.errno == errno.ENOSPC else ""
            size = "" if callable(data) else f" {len(data)} bytes"
            raise OSError(e.errno, f"{path}: cannot write{size} ({e.strerror}){hint}") from e
        yield tmp
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def read_bytes(fs: fsspec.AbstractFileSystem, path: str) -> bytes | None:
    """The whole file, or None when it does not exist (a missing bucket is an error, not None)."""
    try:
        return fs.cat_file(path)
    except FileNotFoundError as e:
        if is_missing_bucket(e):
            raise
        return None


def list_names(fs: fsspec.AbstractFileSystem, folder: str) -> list[str]:
    """Base names of the entries directly in ``folder`` (empty if the folder does not exist)."""
    try:
        entries = fs.ls(folder, detail=False, refresh=True)
    except FileNotFoundError as e:
        if is_missing_bucket(e):
            raise
        return []
    return [basename(e) for e in entries]


# ------------------------------------------------------------------------------- object stores


def is_s3(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("s3", "s3a")


def endpoint_name(fs: fsspec.AbstractFileSystem) -> str:
    """What to call the storage endpoint in an error message: the endpoint URL only, never keys."""
    if is_s3(fs):
        url = getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
        return url or "AWS S3 (default endpoint)"
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return f"{protocol}://"


def _split_s3(fs: fsspec.AbstractFileSystem, path: str) -> tuple[str, str]:
    bucket, key, _ = fs.split_path(path)
    return bucket, key


# ------------------------------------------------------------------------------------ retries


class StorageUnavailableError(OSError):
    """The storage endpoint kept failing with transient errors until the retry budget ran out."""


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential back-off for transient endpoint errors (connection refused/reset, 5xx,
    timeouts). The defaults give 6 attempts within about 10 s. Missing objects, existing objects,
    permission errors and corrupt data are never retried.

    ``retry_missing_bucket``: also retry "bucket does not exist". Off by default (it is a
    configuration error on a real store); an endpoint that restarts without its state (moto in
    tests) comes back without the bucket until someone re-creates it.
    """

    attempts: int = 6
    initial_delay: float = 0.2
    multiplier: float = 2.0
    max_delay: float = 3.2
    deadline: float = 10.0
    retry_missing_bucket: bool = False

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.initial_delay < 0 or self.multiplier < 1 or self.deadline <= 0:
            raise ValueError(f"invalid RetryPolicy {self}")

    def delays(self):
        delay = self.initial_delay
        for _ in range(self.attempts - 1):
            yield min(delay, self.max_delay)
            delay *= self.multiplier


DEFAULT_RETRY = RetryPolicy()


def outage_retry(max_outage_s: float) -> RetryPolicy:
    """Retry transient errors for up to ``max_outage_s`` seconds (``storage.max_outage_s``), backing
    off to one attempt every 5 s."""
    return RetryPolicy(attempts=10_000, initial_delay=0.2, multiplier=2.0, max_delay=5.0, deadline=max_outage_s)

_TRANSIENT_ERRNOS = {
    errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
    errno.EBUSY, errno.EAGAIN, getattr(errno, "EREMOTEIO", 121), errno.EHOSTUNREACH, errno.ENETUNREACH,
}
_TRANSIENT_NAMES = {
    # botocore / aiohttp / urllib3 connection and timeout errors, by class name so that none of
    # these packages is needed to import this module
    "EndpointConnectionError", "ConnectionClosedError", "ConnectTimeoutError", "ReadTimeoutError",
    "HTTPClientError", "ProxyConnectionError", "ClientConnectorError", "ServerDisconnectedError",
    "ClientOSError", "ClientPayloadError", "ServerTimeoutError", "IncompleteRead", "ResponseParserError",
    "FSTimeoutError",
}


class BucketMissingError(FileNotFoundError):
    """The object store answered that the run's bucket does not exist."""


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the errors it was raised from or during, each once."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def is_missing_bucket(error: BaseException) -> bool:
    for e in _chain(error):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code") == "NoSuchBucket":
            return True
        if isinstance(e, FileNotFoundError) and "bucket does not exist" in str(e).lower():
            return True
    return False


def _bucket_missing(what: str, fs: fsspec.AbstractFileSystem, error: BaseException) -> BucketMissingError:
    """The error for a bucket that is gone: which bucket, on which endpoint, at which object."""
    found = re.search(r"s3a?://([^/\s]+)", what)  # ``what`` may be a label around the URI ("create s3://...")
    bucket = found.group(1) if found else "?"
    return BucketMissingError(
        errno.ENOENT,
        f"{what}: bucket {bucket!r} does not exist on storage endpoint {endpoint_name(fs)} (the store said: "
        f"{error}); it was deleted, or the endpoint restarted without its data. Check storage.root and the "
        f"endpoint (storage.storage_options.endpoint_url); a run whose bucket is gone cannot resume from it")


def is_transient(error: BaseException, policy: RetryPolicy = DEFAULT_RETRY) -> bool:
    """True for errors worth retrying: the endpoint was unreachable, slow or failing (5xx)."""
    if isinstance(error, FileExistsError | PermissionError | ValueError | TypeError):
        return False
    if isinstance(error, FileNotFoundError):
        return policy.retry_missing_bucket and "bucket" in str(error).lower()
    for e in _chain(error):
        if isinstance(e, ConnectionError | TimeoutError | asyncio.TimeoutError):
            return True
        if any(c.__name__ in _TRANSIENT_NAMES for c in type(e).__mro__):
            return True
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            code = str(response.get("Error", {}).get("Code", ""))
            if status >= 500 or code in ("SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout"):
                return True
            if policy.retry_missing_bucket and code == "NoSuchBucket":
                return True
            return False
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
    return False


class RetryingFS:
    """``fs`` behind the one retry loop of the storage package: ``call(fn, path)`` runs ``fn()`` again
    after each transient endpoint error, backing off per ``policy``, until it succeeds or the
    policy's attempts or deadline (a run's: ``outage_retry(storage.max_outage_s)``) run out; then
    ``StorageUnavailableError`` names ``path``'s URL, the endpoint and what to do. Other errors
    propagate; on S3 a refused access or a missing bucket is reworded to name the object, the
    endpoint and what to check. ``read`` / ``write`` / ``exists`` / ``create`` are the calls most
    callers make, each retried so."""

    def __init__(self, fs: fsspec.AbstractFileSystem, policy: RetryPolicy = DEFAULT_RETRY) -> None:
        self.fs, self.policy = fs, policy

    @classmethod
    def open(cls, url: str, storage_options: dict[str, Any] | None = None,
             policy: RetryPolicy = DEFAULT_RETRY) -> tuple[RetryingFS, str]:
        """``open_fs(url)`` behind ``policy``: the wrapper and the path of ``url`` in it."""
        fs, path = open_fs(url, storage_options)
        return cls(fs, policy), path

    def url(self, path: str) -> str:
        return to_url(self.fs, path)

    def call(self, fn: Callable[[], T], path: str) -> T:
        """``fn()``, retried on transient errors; errors name the object at ``path``."""
        return self._retried(fn, self.url(path))

    def read(self, path: str) -> bytes | None:
        """The whole file, or None when it does not exist."""
        return self.call(lambda: read_bytes(self.fs, path), path)

    def write(self, path: str, data: bytes) -> None:
        """``atomic_write``: replace ``path`` with ``data``, visible only when whole."""
        self.call(lambda: atomic_write(self.fs, path, data), path)

    def exists(self, path: str) -> bool:
        return bool(self.call(lambda: self.fs.exists(path), path))

    def create(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` only if nothing is there; FileExistsError (naming the object)
        otherwise. Visible only when whole on every backend.

        s3://: a PUT with ``If-None-Match: *``. A retry after a lost response may find the object this
        call wrote: identical bytes count as success. file://: temp file, fsync, then ``os.link`` to
        the final name (fails if it exists). memory://: check and store under a process-wide lock.
        """
        fs, uri = self.fs, self.url(path)
        if is_local(fs):
            _create_only_local(path, data, uri)
            return
        if not is_s3(fs):
            with _memory_lock:
                if fs.exists(path):
                    raise FileExistsError(errno.EEXIST, f"{uri} already exists; refusing to overwrite it")
                fs.pipe_file(path, data)
            return
        failed_before = False

        def put() -> None:
            nonlocal failed_before
            try:
                fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                if failed_before and read_bytes(fs, path) == data:
                    return  # our own earlier attempt landed; its response was lost
                raise FileExistsError(errno.EEXIST, f"{uri} already exists; refusing to overwrite it") from None
            except Exception as e:
                failed_before = failed_before or is_transient(e, self.policy)
                raise

        self._retried(put, f"create {uri}")

    def _retried(self, fn: Callable[[], T], what: str) -> T:
        fs, policy = self.fs, self.policy
        start = time.monotonic()
        delays = policy.delays()
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as e:
                if not is_transient(e, policy):
                    reworded = _reworded(e, what, fs)
                    if reworded is None:
                        raise
                    raise reworded from e
                delay = next(delays, None)
                elapsed = time.monotonic() - start
                if delay is None or elapsed + delay > policy.deadline:
                    raise StorageUnavailableError(
                        errno.EIO,
                        f"{what}: storage endpoint {endpoint_name(fs)} still failing after {attempt} attempt(s) "
                        f"over {elapsed:.1f}s: {type(e).__name__}: {e} (check that the endpoint is up and "
                        "reachable; storage.max_outage_s sets how long a run waits out an outage)",
                    ) from e
                log.warning("%s: transient storage error (attempt %d, retry in %.2fs): %s: %s",
                            what, attempt, delay, type(e).__name__, e)
                time.sleep(delay)


def _reworded(error: Exception, what: str, fs: fsspec.AbstractFileSystem) -> Exception | None:
    """On S3, a missing bucket or a refused access as an error that names ``what``, the endpoint and
    what to check; None for any other error (raised as it is)."""
    if is_s3(fs) and is_missing_bucket(error):
        return _bucket_missing(what, fs, error)
    if is_s3(fs) and isinstance(error, PermissionError):
        return PermissionError(errno.EACCES, f"{what}: storage endpoint {endpoint_name(fs)} refused access "
                               f"({error}); check the credentials the run uses (storage.storage_options, "
                               "storage.credentials_block, or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                               "in the environment) and that they may read and write this bucket")
    return None


# ----------------------------------------------------------------------------- create-only writes

_memory_lock = threading.Lock()


def _create_only_local(path: str, data: bytes, uri: str) -> None:
    """Temp file, fsync, then ``os.link`` to the final name, which fails if the name exists."""
    with _local_temp(path, data) as tmp:
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, f"{uri} already exists; refusing to overwrite it") from None


# ------------------------------------------------------------------------- compare-and-swap


class PreconditionFailed(Exception):
    """A conditional write lost a race: the object changed (or appeared) since it was read."""


def read_with_tag(fs: fsspec.AbstractFileSystem, path: str) -> tuple[bytes | None, str | None]:
    """The object's bytes and a tag for ``cas_write`` (S3: the ETag; elsewhere the bytes' hash).
    (None, None) when it does not exist."""
    if is_s3(fs):
        bucket, key = _split_s3(fs, path)
        try:
            return fsspec.asyn.sync(fs.loop, _s3_get, fs, bucket, key)
        except FileNotFoundError as e:
            if is_missing_bucket(e):
                raise
            return None, None
    data = read_bytes(fs, path)
    return data, None if data is None else hashlib.sha256(data).hexdigest()


async def _s3_get(fs: Any, bucket: str, key: str) -> tuple[bytes, str]:
    out = await fs._call_s3("get_object", Bucket=bucket, Key=key)
    async with out["Body"] as body:
        data = await body.read()
    return data, out["ETag"]


def cas_write(fs: fsspec.AbstractFileSystem, path: str, data: bytes, tag: str | None) -> None:
    """Replace ``path`` with ``data`` only if it still has ``tag`` (from ``read_with_tag``);
    ``tag=None``: only if it does not exist. PreconditionFailed when another writer got there first.

    s3://: ``If-Match: <etag>`` / ``If-None-Match: *``. Local files: an exclusive ``flock`` on a
    hidden file beside ``path``, across the processes of one machine. memory://: a process-wide lock."""
    if is_s3(fs):
        bucket, key = _split_s3(fs, path)
        cond = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
        try:
            fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **cond)
        except FileExistsError as e:
            raise PreconditionFailed(f"{to_url(fs, path)} appeared meanwhile") from e
        except OSError as e:
            if e.errno == errno.EINVAL and "precondition" in str(e).lower() or _status(e) in (409, 412):
                raise PreconditionFailed(f"{to_url(fs, path)} changed meanwhile") from e
            raise
        fs.invalidate_cache(path)
        return
    with _exclusive(fs, path):
        _, current = read_with_tag(fs, path)
        if current != tag:
            raise PreconditionFailed(f"{to_url(fs, path)} changed meanwhile")
        atomic_write(fs, path, data)


@contextlib.contextmanager
def _exclusive(fs: fsspec.AbstractFileSystem, path: str):
    """Held while a compare-and-swap reads and replaces ``path`` off S3."""
    if not is_local(fs):
        with _memory_lock:
            yield
        return
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f".{name}.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the handle closes
        yield


def _status(e: BaseException) -> int:
    cause = e.__cause__
    response = getattr(cause, "response", None)
    if isinstance(response, dict):
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    return 0


def list_after(fs: fsspec.AbstractFileSystem, folder: str, start_after: str | None) -> list[str]:
    """Base names in ``folder`` that sort after ``start_after`` (all if None), ascending.

    s3://: ``list_objects_v2(Prefix=folder/, StartAfter=folder/start_after)``, paged: only new keys
    travel. Elsewhere: a full listing, filtered."""
    if not is_s3(fs):
        names = sorted(list_names(fs, folder))
        return names if start_after is None else [n for n in names if n > start_after]
    return [n for n in _s3_keys(fs, folder, start_after) if n and "/" not in n]


def list_tree(fs: fsspec.AbstractFileSystem, folder: str) -> list[str]:
    """Every file below ``folder``, as paths relative to it, in one listing where the backend can:
    s3://: ``list_objects_v2(Prefix=folder/)`` without a delimiter (paged, no cache); elsewhere a
    walk. Empty if the folder does not exist."""
    if not is_s3(fs):
        base = folder.rstrip("/") + "/"
        try:
            found = fs.find(folder)
        except FileNotFoundError:
            return []
        return sorted(p[len(base):] for p in found if p.startswith(base))
    return sorted(n for n in _s3_keys(fs, folder) if n)


def _s3_keys(fs: fsspec.AbstractFileSystem, folder: str, start_after: str | None = None) -> list[str]:
    """Every key below ``folder`` (after ``folder/start_after``), relative to it, ascending: one
    ``list_objects_v2`` without a delimiter, paged, past fsspec's listing cache."""
    bucket, key = _split_s3(fs, folder)
    prefix = key.rstrip("/") + "/" if key else ""
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    if start_after is not None:
        kwargs["StartAfter"] = prefix + start_after
    names: list[str] = []
    while True:
        out = fs.call_s3("list_objects_v2", **kwargs)
        names.extend(obj["Key"][len(prefix):] for obj in out.get("Contents", []))
        if not out.get("IsTruncated"):
            return names
        kwargs["ContinuationToken"] = out["NextContinuationToken"]


_IO_POOL = None
_IO_POOL_LOCK = threading.Lock()


def io_pool():
    """Threads for concurrent small storage calls (a fleet's heartbeats, its streams' listings),
    shared by the process: they wait on the endpoint's latency, not on the CPU."""
    global _IO_POOL
    with _IO_POOL_LOCK:
        if _IO_POOL is None:
            from concurrent.futures import ThreadPoolExecutor

            _IO_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="storage-io")
    return _IO_POOL
