"""The data plane: sample streams, weight snapshots and the run folder layout, over fsspec.

- ``SampleStream`` / ``StreamReader`` / ``Segment`` (stream.py): Arrow segments with durable cursors.
- ``WeightStore`` / ``load_snapshot`` (weights.py): versioned safetensors snapshots.
- ``RunLayout`` / ``new_run_id`` (layout.py): where a run's files live.
- ``open_fs`` / ``atomic_write`` / ``join`` (fs.py): the fsspec helpers the others share, with
  create-only writes, compare-and-swap and bounded retries on s3://.
- ``compact_run`` / ``archive_dataset`` (archive.py): a run's segments compacted into Parquet.
- ``LocalS3`` (local_s3.py): a moto S3 endpoint on 127.0.0.1 for tests and benchmarks.

Importing this package needs pyarrow only when sample data is read or written, and torch only
when weights are.
"""

from miles_core.storage.archive import archive_dataset, compact_run
from miles_core.storage.fs import atomic_write, join, open_fs
from miles_core.storage.layout import RunLayout, new_run_id
from miles_core.storage.stream import SampleStream, Segment, StreamReader, StreamWriteError, StreamWriter
from miles_core.storage.weights import WeightStore, load_snapshot

__all__ = [
    "RunLayout",
    "SampleStream",
    "Segment",
    "StreamReader",
    "StreamWriteError",
    "StreamWriter",
    "WeightStore",
    "archive_dataset",
    "atomic_write",
    "compact_run",
    "join",
    "load_snapshot",
    "new_run_id",
    "open_fs",
]
