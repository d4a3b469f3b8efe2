"""Archive a run's sample stream as a Parquet dataset for analysis.

Parts:
- ``compact_run(run_dir_url, producer)`` reads every whole segment of ``samples/<producer>/`` in
  offset order and writes ``<run_dir>/archive/<producer>/part-00000.parquet`` (more parts when
  ``rows_per_file`` is set), then ``_MANIFEST.json`` last. Returns an ``ArchiveReport``.
- ``archive_dataset(url)`` opens an archive folder as a ``pyarrow.dataset.Dataset``.

Each row is one sample with the columns of ``miles_core.types.arrow_schema()`` plus
``segment_offset`` (int64), the offset of the segment it came from, so a row traces back to
``samples/<producer>/<segment_offset:012d>.arrow``.

Encoding: zstd, and dictionary encoding only on the columns in ``DICTIONARY_COLUMNS`` (values
that repeat across rows: status, adapter, label, the prompt shared by a group, ...). Parquet's
default dictionary-encodes every column, which made token-id and logprob columns larger (measured
on 4,000 synthetic GRPO samples, zstd: prompt_ids 4.6x, rollout_logprobs 1.16x, whole file +10%).

Visibility: each part is written whole (temp file then rename on local disk, one PUT on object
stores), and the manifest goes last; a re-run overwrites the parts and removes stale ones.
Dataset readers skip names starting with ``_`` or ``.``, so the manifest never shows up as data.

Query example (pyarrow only)::

    import pyarrow.compute as pc
    from miles_core.storage.archive import archive_dataset, compact_run

    report = compact_run("s3://bucket/exp/20261130-141502-ab12", storage_options=opts)
    ds = archive_dataset(report.out_url, storage_options=opts)
    table = ds.to_table(columns=["status", "reward"], filter=pc.field("segment_offset") >= 10)
    by_status = table.group_by("status").aggregate([("reward", "mean"), ("reward", "count")])
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from miles_core.storage.fs import atomic_write, join, list_names, open_fs, to_url
from miles_core.storage.stream import SampleStream, segment_name

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.dataset

OFFSET_COLUMN = "segment_offset"
MANIFEST = "_MANIFEST.json"
PART_NAME = re.compile(r"^part-(\d{5})\.parquet$")
DICTIONARY_COLUMNS = ("prompt", "label", "reward", "status", "adapter", "error", "group_index")
"""Columns whose values repeat across rows. Dictionary encoding made each of these smaller (or
equal) in the measurement above; token ids, logprobs and response text get none."""
ZSTD_LEVEL = 3  # an archive is written once and kept: spend a little more CPU than the stream (1)
DEFAULT_ROW_GROUP_SIZE = 16_384


@dataclass
class ArchiveReport:
    """What ``compact_run`` wrote."""

    stream_uri: str
    out_url: str
    files: list[str] = field(default_factory=list)
    segments: int = 0
    rows: int = 0
    first_offset: int = -1
    last_offset: int = -1
    bytes_in: int = 0
    """Encoded size of the segments read (Arrow IPC + zstd)."""
    bytes_out: int = 0
    """Size of the Parquet files written."""
    closed: bool = False
    """True if the stream had its end marker, i.e. the archive holds the whole stream."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compact_run(
    run_dir_url: str,
    producer: str = "rollout",
    out_url: str | None = None,
    storage_options: dict[str, Any] | None = None,
    row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
    rows_per_file: int | None = None,
    dictionary_columns: tuple[str, ...] = DICTIONARY_COLUMNS,
) -> ArchiveReport:
    """Write every whole segment of ``producer``'s stream into a Parquet dataset.

    ``out_url`` defaults to ``<run_dir>/archive/<producer>`` on the run's storage. A new part file
    starts once the current one holds ``rows_per_file`` rows (whole segments; None: one file).
    Raises ValueError when the stream has no segments."""
    if row_group_size < 1:
        raise ValueError(f"row_group_size must be >= 1, got {row_group_size}")
    if rows_per_file is not None and rows_per_file < 1:
        raise ValueError(f"rows_per_file must be None or >= 1, got {rows_per_file}")
    stream = SampleStream(run_dir_url, producer, storage_options)
    closed = stream.end_offset() is not None
    offsets = stream.offsets()
    if not offsets:
        raise ValueError(
            f"nothing to archive: sample stream {stream.uri} has no segments "
            f"(check the run folder and the producer name {producer!r})"
        )
    if out_url is None:
        out_fs, out_dir = stream.fs, join(stream.run_dir, "archive", stream.producer)
    else:
        out_fs, out_dir = open_fs(out_url, storage_options)
    report = ArchiveReport(stream_uri=stream.uri, out_url=to_url(out_fs, out_dir), closed=closed)
    report.first_offset, report.last_offset = offsets[0], offsets[-1]

    part = _PartWriter(out_fs, out_dir, row_group_size, dictionary_columns)
    for offset in offsets:
        segment = stream.read_segment(offset)
        report.bytes_in += stream.fs.size(join(stream.path, segment_name(offset)))
        report.segments += 1
        report.rows += segment.table.num_rows
        if rows_per_file is not None and part.rows >= rows_per_file:
            _finish_part(part, report)
            part = _PartWriter(out_fs, out_dir, row_group_size, dictionary_columns, index=part.index + 1)
        part.add(_with_offset(segment.table, offset))
    _finish_part(part, report)
    _remove_stale_parts(out_fs, out_dir, keep=part.index + 1)
    manifest = {**report.to_dict(), "producer": stream.producer, "dictionary_columns": list(dictionary_columns)}
    atomic_write(out_fs, join(out_dir, MANIFEST), json.dumps(manifest, indent=1).encode())
    return report


def archive_dataset(url: str, storage_options: dict[str, Any] | None = None) -> pyarrow.dataset.Dataset:
    """The Parquet archive folder at ``url`` as a pyarrow dataset (reads through fsspec)."""
    import pyarrow.dataset as ds

    fs, path = open_fs(url, storage_options)
    return ds.dataset(path, filesystem=fs, format="parquet")


# ------------------------------------------------------------------------------------ internals


def _with_offset(table: pa.Table, offset: int) -> pa.Table:
    import pyarrow as pa

    return table.append_column(pa.field(OFFSET_COLUMN, pa.int64()), pa.array([offset] * table.num_rows, pa.int64()))


class _PartWriter:
    """One Parquet part built in memory, so it can be published with a single atomic write.

    Segments are usually much smaller than a row group, so tables are buffered until
    ``row_group_size`` rows are pending: one row group per segment would bloat the metadata."""

    def __init__(self, fs, out_dir: str, row_group_size: int, dictionary_columns: tuple[str, ...], index: int = 0):
        self.fs, self.index, self.row_group_size = fs, index, row_group_size
        self.path = join(out_dir, f"part-{index:05d}.parquet")
        self.dictionary_columns = list(dictionary_columns)
        self.rows = 0
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._writer = None
        self._sink = None

    def add(self, table: pa.Table) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self._writer is None:
            unknown = sorted(set(self.dictionary_columns) - set(table.schema.names))
            if unknown:
                raise ValueError(f"dictionary_columns names columns the stream does not have: {unknown}")
            self._sink = pa.BufferOutputStream()
            self._writer = pq.ParquetWriter(
                self._sink, table.schema, compression="zstd", compression_level=ZSTD_LEVEL,
                use_dictionary=self.dictionary_columns,
            )
        self._pending.append(table)
        self._pending_rows += table.num_rows
        self.rows += table.num_rows
        if self._pending_rows >= self.row_group_size:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self._pending:
            self._writer.write_table(pa.concat_tables(self._pending), row_group_size=self.row_group_size)
        self._pending, self._pending_rows = [], 0

    def finish(self) -> int:
        """Publish the part; returns its size in bytes."""
        self._flush()
        self._writer.close()
        data = self._sink.getvalue().to_pybytes()
        atomic_write(self.fs, self.path, data)
        return len(data)


def _finish_part(part: _PartWriter, report: ArchiveReport) -> None:
    report.bytes_out += part.finish()
    report.files.append(to_url(part.fs, part.path))


def _remove_stale_parts(fs, out_dir: str, keep: int) -> None:
    """Delete parts numbered ``keep`` and up, left by an earlier, larger archive of this stream."""
    for name in list_names(fs, out_dir):
        m = PART_NAME.match(name)
        if m and int(m.group(1)) >= keep:
            fs.rm_file(join(out_dir, name))
