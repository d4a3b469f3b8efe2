"""SampleStream: an append-only queue of sample batches on object storage.

Parts:
- ``SampleStream``: one producer's stream in a run folder. ``append`` writes one Arrow IPC stream
  file (zstd by default; lz4 or none by choice) per batch at
  ``samples/<producer>/<offset:012d>.arrow``; ``close`` writes ``_END``. ``writer()`` gives a
  ``StreamWriter`` that encodes and writes behind the caller, in order, with bounded pending.
- ``StreamReader``: one named consumer with a durable cursor at ``cursors/<producer>/<name>.json``.
  ``read`` returns the next whole segments in order; ``commit(offset)`` persists progress, and a
  new reader of the same name (after a restart) resumes from the last commit.
- ``Segment``: one decoded segment (``offset``, ``uri``, ``table``, ``samples()``).
- Damage: ``damaged()`` finds segments that cannot be decoded (``SegmentDamaged``), ``move_aside``
  moves one to ``samples/<producer>/damaged/`` (its offset is never written again), and
  ``set_aside_damaged(run_dir)`` does both for every stream of a run (a run that starts again).

Visibility: a segment appears under its final name only when whole, and readers consider only
names that match ``<12 digits>.arrow`` exactly, so temp files and other stray objects are ignored.
There is one writer per producer prefix: the producer counts offsets in memory, starting after
the highest segment present when it first appends. Segments are written create-only
(``RetryingFS.create``: S3 ``If-None-Match: *``, local ``os.link``), so a duplicated or restarted
producer that collides with an existing segment gets a FileExistsError naming the object instead
of overwriting it.

On S3, ``offsets(after)`` lists with ``StartAfter`` (only new keys travel), and every storage call
goes through the stream's ``RetryingFS`` (``io``): retried on transient endpoint errors per its
``RetryPolicy``, then ``StorageUnavailableError`` naming the object and the endpoint URL.

Segments are plain Arrow: ``pyarrow.ipc.open_stream`` (or DuckDB, Polars) reads them.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_core.storage.fs import (
    DEFAULT_RETRY,
    RetryingFS,
    RetryPolicy,
    is_local,
    join,
    list_after,
    open_fs,
    to_url,
)
from miles_core.storage.layout import check_name, cursor_file, samples_dir
from miles_core.types import SCHEMA_VERSION, Group, Sample, arrow_schema, flatten, samples_to_table, table_to_samples

if TYPE_CHECKING:
    import pyarrow as pa

SEGMENT_NAME = re.compile(r"^(\d{12})\.arrow$")
END_MARKER = "_END"
DAMAGED = "damaged"
"""The folder of a stream's segments moved aside as damaged (``move_aside``)."""
VERSION_KEY = b"miles.schema_version"
ZSTD_LEVEL = 1  # measured once: as small as tuned Parquet, several times cheaper to encode than higher levels
COMPRESSIONS = ("zstd", "lz4", "none")
# An Arrow IPC stream ends with this marker (continuation token, then a zero length). Without it a
# stream cut at a batch boundary would decode "successfully" with rows missing.
_IPC_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def segment_name(offset: int) -> str:
    return f"{offset:012d}.arrow"


@dataclass
class Segment:
    """One whole segment of a stream."""

    offset: int
    uri: str
    table: pa.Table

    def samples(self) -> list[Sample]:
        try:
            return table_to_samples(self.table)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"cannot turn sample segment {self.uri} into samples: {e}") from e

    def __len__(self) -> int:
        return self.table.num_rows


class SampleStream:
    """The stream of sample batches that ``producer`` writes into a run folder."""

    def __init__(
        self,
        run_dir_url: str,
        producer: str = "rollout",
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        compression: str = "zstd",
    ):
        if compression not in COMPRESSIONS:
            raise ValueError(f"segment compression must be one of {COMPRESSIONS}, got {compression!r}")
        self.fs, self.run_dir = open_fs(run_dir_url, storage_options)
        self.run_dir_url = run_dir_url
        self.storage_options = storage_options
        self.retry = retry or DEFAULT_RETRY
        self.io = RetryingFS(self.fs, self.retry)
        """Every storage call of the stream and its readers goes through it."""
        self.compression = compression  # of the segments this object writes; readers take any
        self.producer = check_name("producer", producer)
        self.path = join(self.run_dir, samples_dir(producer))
        self._next_offset: int | None = None  # producer side, set on first append
        self._end: int | None = None  # last offset once _END has been seen (it never changes)

    @property
    def uri(self) -> str:
        return to_url(self.fs, self.path)

    def segment_uri(self, offset: int) -> str:
        return to_url(self.fs, join(self.path, segment_name(offset)))

    def __repr__(self) -> str:
        return f"SampleStream({self.uri!r})"

    # ------------------------------------------------------------------------------ producer

    def append(self, samples: list[Sample] | list[Group] | pa.Table) -> int:
        """Write one segment; returns its offset. The segment becomes visible only when whole."""
        table = _as_table(samples)
        offset = self._claim_offset()
        self._write_segment(offset, table)
        self._next_offset = offset + 1
        return offset

    def sibling(self, producer: str) -> SampleStream:
        """The stream of another producer in the same run folder, with the same settings."""
        return SampleStream(self.run_dir_url, producer, self.storage_options, self.retry, self.compression)

    def writer(self, max_pending: int = 2) -> StreamWriter:
        """A write-behind writer of this stream (see ``StreamWriter``); use it as a context manager."""
        return StreamWriter(self, max_pending)

    def _write_segment(self, offset: int, table: pa.Table) -> None:
        try:
            self.io.create(join(self.path, segment_name(offset)), _encode(table, self.compression))
        except FileExistsError as e:
            raise FileExistsError(
                e.errno,
                f"sample segment {self.segment_uri(offset)} already exists: another producer named "
                f"{self.producer!r} is writing {self.uri}; refusing to overwrite it",
            ) from None

    def close(self) -> int:
        """Mark the end of the stream; returns the last offset (-1 for an empty stream).

        Idempotent. Appending after ``close`` raises."""
        end = self.end_offset()
        if end is not None:
            return end
        last = self._claim_offset() - 1
        self.io.write(join(self.path, END_MARKER), json.dumps({"last_offset": last}).encode())
        self._end = last
        return last

    def _claim_offset(self) -> int:
        # _END is looked up once per producer object; after that this object knows if it closed.
        closed = self._end is not None if self._next_offset is not None else self.end_offset() is not None
        if closed:
            raise RuntimeError(f"sample stream {self.uri} is closed ({END_MARKER} exists); cannot append")
        if self._next_offset is None:
            existing = self.offsets() + self.set_aside()  # a damaged segment's offset is never used again
            self._next_offset = max(existing) + 1 if existing else 0
        return self._next_offset

    # ------------------------------------------------------------------------------ damage

    def set_aside(self) -> list[int]:
        """Offsets of the segments moved aside as damaged (``damaged/<offset>.arrow``), ascending."""
        folder = join(self.path, DAMAGED)
        names = self.io.call(lambda: list_after(self.fs, folder, None), folder)
        return sorted(int(m.group(1)) for m in map(SEGMENT_NAME.match, names) if m)

    def damaged(self) -> list[tuple[int, str]]:
        """Each whole-named segment that cannot be decoded (garbage bytes, a cut file), with why."""
        out = []
        for offset in self.offsets():
            try:
                self.read_segment(offset)
            except SegmentDamaged as e:
                out.append((offset, str(e)))
            except ValueError:  # e.g. another schema version: no damage, and for its readers to report
                pass
        return out

    def move_aside(self, offset: int, why: str) -> str:
        """Move damaged segment ``offset`` to ``damaged/<offset>.arrow`` (beside it ``<offset>.json``
        says why), out of every reader's way; returns its new URI. Readers skip the offset, and
        this stream never writes it again."""
        src = join(self.path, segment_name(offset))
        dst = join(self.path, DAMAGED, segment_name(offset))
        note = json.dumps({"offset": offset, "why": why, "at": time.time()}).encode()
        self.io.write(join(self.path, DAMAGED, f"{offset:012d}.json"), note)
        self.io.call(lambda: self.fs.mv(src, dst), src)
        return to_url(self.fs, dst)

    # ------------------------------------------------------------------------------- readers

    def offsets(self, after: int = -1) -> list[int]:
        """Offsets of the whole segments after ``after``, ascending.

        On S3 one ``list_objects_v2(StartAfter=<name of after>)`` (paged): a poll loop transfers
        only new keys. Local and memory storage list the folder and filter by name."""
        start = segment_name(after) if after >= 0 else None
        found = []
        for name in self.io.call(lambda: list_after(self.fs, self.path, start), self.path):
            m = SEGMENT_NAME.match(name)
            if m and int(m.group(1)) > after:
                found.append(int(m.group(1)))
        return sorted(found)

    def read(self, after: int = -1, max_segments: int | None = None) -> list[Segment]:
        """The whole segments after offset ``after``, in order (at most ``max_segments``)."""
        if max_segments is not None and max_segments < 1:
            raise ValueError(f"max_segments must be None or >= 1, got {max_segments}")
        offsets = self.offsets(after)
        if max_segments is not None:
            offsets = offsets[:max_segments]
        if len(offsets) > 1 and not is_local(self.fs):  # an object store: fetch them at once, keep the order
            return list(_segment_pool().map(self.read_segment, offsets))
        return [self.read_segment(o) for o in offsets]

    def read_segment(self, offset: int) -> Segment:
        """The segment at ``offset``; FileNotFoundError if there is none, ValueError if it is bad."""
        uri = self.segment_uri(offset)
        data = self.io.read(join(self.path, segment_name(offset)))
        if data is None:
            raise FileNotFoundError(f"no sample segment at offset {offset}: {uri} does not exist")
        return Segment(offset=offset, uri=uri, table=_decode(data, uri))

    def end_offset(self) -> int | None:
        """The last offset if the stream is closed, else None."""
        if self._end is None:
            path = join(self.path, END_MARKER)
            data = self.io.read(path)
            if data is not None:
                self._end = _parse_json_field(data, "last_offset", to_url(self.fs, path))
        return self._end

    def reader(self, name: str) -> StreamReader:
        """A consumer named ``name``, resuming from its last committed cursor."""
        return StreamReader(self, name)


def set_aside_damaged(run_dir_url: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Move every damaged segment of the run's sample streams aside (``SampleStream.move_aside``);
    returns a line for each (where it went, and why). For a run folder only one trainer holds:
    call it when a run starts again, before anything reads its streams."""
    from miles_core.storage.fs import list_names

    fs, run_dir = open_fs(run_dir_url, storage_options)
    moved = []
    for producer in sorted(list_names(fs, join(run_dir, "samples"))):
        if not check_producer_name(producer):
            continue
        stream = SampleStream(run_dir_url, producer, storage_options)
        for offset, why in stream.damaged():
            moved.append(f"{stream.move_aside(offset, why)}: {why}")
    return moved


def check_producer_name(name: str) -> bool:
    try:
        check_name("producer", name)
    except ValueError:
        return False
    return True


class SegmentDamaged(ValueError):
    """A segment's bytes are not a whole Arrow stream (cut short, overwritten)."""


class StreamWriteError(RuntimeError):
    """A write-behind segment could not be written; ``lost`` holds the offsets not written."""

    def __init__(self, message: str, lost: list[int]):
        super().__init__(message)
        self.lost = lost


class StreamWriter:
    """Write-behind appends to one ``SampleStream``.

    ``append`` checks and converts the samples, claims the next offset and returns it at once; a
    background thread encodes the segment and writes it, so storage latency overlaps with the
    caller producing the next batch. At most ``max_pending`` segments wait: ``append`` blocks
    beyond that (bounded memory, back-pressure). Segments are written one at a time in offset
    order, so they become visible in order. ``flush`` waits until every appended segment is
    visible. The first failed write stops the writer: later segments are not written (a gap would
    let a reader skip data) and the next ``append``, ``flush`` or ``close`` raises
    ``StreamWriteError`` naming the failed object and every offset that was not written.
    """

    def __init__(self, stream: SampleStream, max_pending: int = 2):
        import queue

        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.stream = stream
        self._queue: queue.Queue[tuple[int, pa.Table] | None] = queue.Queue(maxsize=max_pending)
        self._error: StreamWriteError | None = None
        self._lost: list[int] = []
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=f"stream-writer-{stream.producer}", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Segments appended but not yet visible (about; for metrics)."""
        return self._queue.unfinished_tasks

    def append(self, samples: list[Sample] | list[Group] | pa.Table) -> int:
        """Queue one segment; returns its offset. Blocks while ``max_pending`` segments wait."""
        self._raise_if_failed()
        if self._closed:
            raise RuntimeError(f"writer of {self.stream.uri} is closed")
        table = _as_table(samples)
        offset = self.stream._claim_offset()
        self.stream._next_offset = offset + 1
        self._queue.put((offset, table))
        return offset

    def flush(self) -> None:
        """Wait until every appended segment is visible; raise if one could not be written."""
        self._queue.join()
        self._raise_if_failed()

    def close(self, end_stream: bool = False) -> None:
        """Flush, stop the thread, and with ``end_stream`` write the stream's ``_END`` marker."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()
        self._raise_if_failed()
        if end_stream:
            self.stream.close()

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not hide the caller's error; still write what was appended before it
            try:
                self.close()
            except StreamWriteError:
                pass

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                offset, table = item
                if self._error is not None:
                    self._lost.append(offset)
                    continue
                try:
                    self.stream._write_segment(offset, table)
                except BaseException as e:  # noqa: BLE001 (handed to the caller's thread)
                    self._lost.append(offset)
                    self._error = StreamWriteError(
                        f"write-behind of sample segment {self.stream.segment_uri(offset)} failed: "
                        f"{type(e).__name__}: {e}",
                        self._lost,
                    )
                    self._error.__cause__ = e
            finally:
                self._queue.task_done()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            lost = self._error.lost
            raise StreamWriteError(
                f"{self._error}; offsets not written: {lost} (their samples are not in the stream)", list(lost)
            ) from self._error.__cause__


class StreamReader:
    """One named consumer of a ``SampleStream`` with a durable cursor.

    ``position`` is the last offset ``read`` returned (in memory); ``cursor`` is the last offset
    committed (durable). A new reader of the same name starts at the committed cursor, so
    segments read but not committed before a crash are read again (at-least-once)."""

    def __init__(self, stream: SampleStream, name: str):
        self.stream = stream
        self.name = check_name("reader", name)
        self._cursor_path = join(stream.run_dir, cursor_file(stream.producer, name))
        self.used_after = 0
        """Groups used in the segments after the cursor (see ``commit``), as last read or written."""
        self._cursor = self._load_cursor()
        self.position = self._cursor

    @property
    def cursor(self) -> int:
        """Last committed offset (-1: nothing committed yet)."""
        return self._cursor

    @property
    def cursor_uri(self) -> str:
        return to_url(self.stream.fs, self._cursor_path)

    def read(self, max_segments: int | None = None) -> list[Segment]:
        """The next whole segments after ``position``, in order. Does not commit."""
        segments = self.stream.read(after=self.position, max_segments=max_segments)
        if segments:
            self.position = segments[-1].offset
        return segments

    def commit(self, offset: int, used_after: int = 0) -> None:
        """Persist ``offset`` as this reader's cursor (atomically). Committing a lower offset
        rewinds the durable cursor, not ``position``. ``used_after``: groups this reader has used
        in the segments after ``offset`` (they are not whole yet), which a producer's back-pressure
        does not count as waiting."""
        if not isinstance(offset, int) or offset < -1:
            raise ValueError(f"reader {self.name!r}: cursor offset must be an int >= -1, got {offset!r}")
        data = json.dumps({"reader": self.name, "producer": self.stream.producer, "offset": offset,
                           "used_after": int(used_after)}).encode()
        self.stream.io.write(self._cursor_path, data)
        self._cursor, self.used_after = offset, int(used_after)
        self.position = max(self.position, offset)

    @property
    def finished(self) -> bool:
        """True when the stream is closed and this reader has read its last segment."""
        end = self.stream.end_offset()
        return end is not None and self.position >= end

    def wait(self, timeout: float, poll: float = 0.05, max_segments: int | None = None) -> list[Segment]:
        """``read`` until it returns something, the stream is finished, or ``timeout`` seconds pass
        (then returns an empty list)."""
        deadline = time.monotonic() + timeout
        while True:
            segments = self.read(max_segments)
            if segments or self.finished or time.monotonic() >= deadline:
                return segments
            time.sleep(min(poll, max(0.0, deadline - time.monotonic())))

    def _load_cursor(self) -> int:
        data = self.stream.io.read(self._cursor_path)
        if data is None:
            return -1
        offset = _parse_json_field(data, "offset", self.cursor_uri)
        self.used_after = int(json.loads(data).get("used_after", 0))
        return offset

    def progress(self) -> tuple[int, int]:
        """(cursor, used_after) as the consumer last committed them (reads storage)."""
        self._cursor = self._load_cursor()
        return self._cursor, self.used_after

    def __repr__(self) -> str:
        return f"StreamReader({self.name!r}, stream={self.stream.uri!r}, cursor={self._cursor})"


# ------------------------------------------------------------------------------------- encoding


_SEGMENT_POOL = None
_SEGMENT_POOL_LOCK = threading.Lock()


def _segment_pool():
    """Threads that fetch a reader's new segments from an object store concurrently (its own pool:
    a fleet's trainer already reads its streams on ``fs.io_pool``)."""
    global _SEGMENT_POOL
    with _SEGMENT_POOL_LOCK:
        if _SEGMENT_POOL is None:
            from concurrent.futures import ThreadPoolExecutor

            _SEGMENT_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="segment-read")
    return _SEGMENT_POOL


def _as_table(samples: list[Sample] | list[Group] | pa.Table) -> pa.Table:
    import pyarrow as pa

    if isinstance(samples, pa.Table):
        _check_table_schema(samples)
        return samples
    if not samples:
        raise ValueError("append() got no samples; a segment holds at least one")
    if all(isinstance(s, Group) for s in samples):
        samples = flatten(samples)
    bad = [type(s).__name__ for s in samples if not isinstance(s, Sample)]
    if bad:
        raise TypeError(f"append() takes Samples, Groups or a pyarrow.Table; got {sorted(set(bad))}")
    return samples_to_table(samples)


def _check_table_schema(table: pa.Table) -> None:
    expected = arrow_schema()
    version = (table.schema.metadata or {}).get(VERSION_KEY, b"<missing>").decode()
    if version != str(SCHEMA_VERSION):
        raise ValueError(f"sample table has schema version {version!r}; this code writes {SCHEMA_VERSION}")
    if not table.schema.equals(expected, check_metadata=False):
        raise ValueError(
            "sample table's columns differ from miles_core.types.arrow_schema():\n"
            f"got:\n{table.schema.remove_metadata()}\nexpected:\n{expected.remove_metadata()}"
        )
    if table.num_rows == 0:
        raise ValueError("append() got an empty table; a segment holds at least one sample")


def _encode(table: pa.Table, compression: str = "zstd") -> bytes:
    import pyarrow as pa

    codec = {"zstd": pa.Codec("zstd", compression_level=ZSTD_LEVEL), "lz4": "lz4_frame", "none": None}[compression]
    options = pa.ipc.IpcWriteOptions(compression=codec)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _decode(data: bytes, uri: str) -> pa.Table:
    import pyarrow as pa

    if not data.endswith(_IPC_EOS):
        raise SegmentDamaged(f"sample segment {uri} is truncated ({len(data)} bytes, no Arrow end-of-stream marker)")
    try:
        table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    except (pa.ArrowException, OSError) as e:
        raise SegmentDamaged(f"cannot decode sample segment {uri} ({len(data)} bytes): {e}") from e
    version = (table.schema.metadata or {}).get(VERSION_KEY, b"<missing>").decode()
    if version != str(SCHEMA_VERSION):
        raise ValueError(
            f"sample segment {uri} has schema version {version!r}; this code reads {SCHEMA_VERSION}"
        )
    return table


def _parse_json_field(data: bytes, key: str, uri: str) -> int:
    try:
        value = json.loads(data)[key]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{uri} is not valid JSON with an integer {key!r}: {e!r}") from e
    if not isinstance(value, int):
        raise ValueError(f"{uri}: {key!r} must be an integer, got {value!r}")
    return value
