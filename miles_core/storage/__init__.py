"""The data plane: sample streams, weight snapshots and the run folder layout, over fsspec.

- ``SampleStream`` / ``StreamReader`` / ``Segment`` (stream.py): Arrow segments with durable cursors.
- ``WeightStore`` / ``load_snapshot`` (weights.py): versioned safetensors snapshots.
- ``RunLayout`` / ``new_run_id`` (layout.py): where a run's files live.
- ``open_fs`` / ``atomic_write`` / ``join`` (fs.py): the fsspec helpers the others share.

Importing this package needs pyarrow only when sample data is read or written, and torch only
when weights are.
"""

from miles_core.storage.fs import atomic_write, join, open_fs
from miles_core.storage.layout import RunLayout, new_run_id
from miles_core.storage.stream import SampleStream, Segment, StreamReader
from miles_core.storage.weights import WeightStore, load_snapshot

__all__ = [
    "RunLayout",
    "SampleStream",
    "Segment",
    "StreamReader",
    "WeightStore",
    "atomic_write",
    "join",
    "load_snapshot",
    "new_run_id",
    "open_fs",
]
