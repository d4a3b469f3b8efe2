"""What a rollout producer holds ahead of its consumer, and the back-pressure that bounds it.

``Backlog`` keeps the finished groups not yet written and writes them as one segment of the
producer's stream once ``segment_max_groups`` are ready, the oldest has waited
``segment_max_wait_s``, or the producer forces it (at its bound, or stopping). It counts the
groups of segments written and not yet consumed, from the consumer's durable cursor: with the
groups in flight, those make what the producer is ahead, which may not reach its ``share`` of
``capacity`` (each live producer of a fleet holds its share, so the fleet holds at most
``capacity`` whatever the delay of what they know of each other).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles_core.config import FullyAsyncMode
    from miles_core.rollout.throughput import ProducerStats
    from miles_core.storage.stream import SampleStream, StreamWriter
    from miles_core.types import Group


class Backlog:
    def __init__(self, stream: SampleStream, consumer: str | Callable[[], int | tuple[int, int]], capacity: int,
                 acfg: FullyAsyncMode, stats: ProducerStats) -> None:
        self.stream, self.acfg, self.stats = stream, acfg, stats
        self.consumer = consumer
        """The reader whose durable cursor back-pressure counts from, or a function returning that
        cursor (or the cursor and the groups used after it, as a reader's ``progress``)."""
        self.capacity = capacity
        """Groups the producer may be ahead of the consumer (in flight + unwritten + unconsumed)."""
        self.fleet_size = 1
        """Live producers of the fleet this one is in (the trainer says, in ``fleet/ahead.json``)."""
        self._finished: list[Group] = []
        self._oldest_finished_at: float | None = None
        self._segment_groups: dict[int, int] = {}  # offset -> groups in it, written and not consumed
        self._used_after = 0  # groups the consumer used in those segments, as it last said
        self._writer: StreamWriter | None = None

    @property
    def share(self) -> int:
        """The groups this producer may hold ahead of the trainer: its share of ``capacity``."""
        return max(1, -(-self.capacity // max(1, self.fleet_size)))

    def ahead(self) -> int:
        """Groups finished but unwritten, and written but unconsumed (the consumer's groups used in
        segments it has not finished with do not count)."""
        return len(self._finished) + sum(self._segment_groups.values()) - self._used_after

    def open(self) -> None:
        """Count the segments written before a restart and not consumed yet (they count toward the
        bound), and open the writer. Blocking: it reads storage."""
        existing = self.stream.offsets()
        if existing:
            cursor = self._consumer_progress()[0]
            for offset in existing:
                if offset > cursor:
                    segment = self.stream.read_segment(offset)
                    self._segment_groups[offset] = len(set(segment.table.column("group_index").to_pylist()))
        self._writer = self.stream.writer(max_pending=2)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def add(self, group: Group) -> None:
        if not self._finished:
            self._oldest_finished_at = time.monotonic()
        self._finished.append(group)

    async def flush(self, force: bool) -> bool:
        """Write finished groups as one segment when enough are ready, or they waited long enough;
        True when it wrote."""
        if not self._finished:
            return False
        waited = time.monotonic() - (self._oldest_finished_at or time.monotonic())
        if not force and len(self._finished) < self.acfg.segment_max_groups and waited < self.acfg.segment_max_wait_s:
            return False
        groups, self._finished = sorted(self._finished, key=lambda g: g.group_index), []
        size = self.acfg.segment_max_groups
        for start in range(0, len(groups), size):
            chunk = groups[start : start + size]
            offset = await asyncio.to_thread(self._writer.append, chunk)
            self._segment_groups[offset] = len(chunk)
            self.stats.groups_written += len(chunk)
            self.stats.segments_written += 1
        return True

    async def wait_for_room(self, in_flight: int) -> bool:
        """Back-pressure: wait until the consumer's cursor frees room; False if it did not (yet)."""
        t0 = time.monotonic()
        cursor, self._used_after = await asyncio.to_thread(self._consumer_progress)
        for offset in [o for o in self._segment_groups if o <= cursor]:
            del self._segment_groups[offset]
        if in_flight + self.ahead() < self.share:
            return True
        # at the bound: look at the cursor again soon; a member of a large fleet less often
        await asyncio.sleep(min(max(0.05, self.acfg.control_poll_s), 0.05 * self.fleet_size))
        self.stats.backpressure_seconds += time.monotonic() - t0
        return False

    def _consumer_progress(self) -> tuple[int, int]:
        """The durable cursor, and the groups the consumer used after it (blocking: reads storage)."""
        if callable(self.consumer):  # its cursor, or (cursor, groups used after it)
            found = self.consumer()
            return (int(found[0]), int(found[1])) if isinstance(found, tuple) else (int(found), 0)
        return self.stream.reader(self.consumer).progress()
