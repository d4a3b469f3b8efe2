"""The trainer's side of fully-async: batches of groups from the producer's sample stream.

``GroupFeed.next_batch(n, trainer_version)`` reads new segments into the ``DataBuffer``, takes
``n`` trainable groups (sorted by group index), and deals with the rejected ones at once: dropped
and counted, or (``unused_samples_handler = "retry"``) appended to the ``recycle`` stream, whose
prompts the producer generates again. While it waits it logs a warning every ``no_progress_s``
seconds, and it calls ``producer_check`` on every poll, which raises the producer's own exception
if the producer died. ``commit()`` (after the train step) marks the batch's groups used. With ``read_ahead``, a
background thread reads and decodes new segments while the trainer trains. The
durable cursor moves only past segments whose every group was used (trained or rejected), so a
restarted trainer sees again what it had not finished with; the producer's back-pressure counts
from the same cursor.
"""

from __future__ import annotations

import logging
import queue
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles_core.rollout.buffer import DataBuffer, Rejected, group_lag
from miles_core.rollout.producer import RECYCLE_PRODUCER
from miles_core.types import Group, regroup

if TYPE_CHECKING:
    from miles_core.config import AsyncConfig
    from miles_core.storage.stream import SampleStream

log = logging.getLogger(__name__)


class ProducerEnded(RuntimeError):
    """The producer closed its stream before the trainer got the groups it needs."""


@dataclass
class FeedBatch:
    groups: list[Group]
    """Trainable groups, sorted by group index."""
    wait_seconds: float
    """Time the trainer waited for data while assembling this batch."""
    rejected: list[Rejected] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


class GroupFeed:
    def __init__(
        self,
        stream: SampleStream,
        buffer: DataBuffer,
        cfg: AsyncConfig,
        reader: str = "trainer",
        producer_check: Callable[[], None] = lambda: None,
        poll_s: float = 0.02,
        warn: Callable[[str], None] = log.warning,
        read_ahead: bool = False,
    ) -> None:
        self.stream = stream
        self.reader = stream.reader(reader)
        self.buffer = buffer
        self.cfg = cfg
        self.producer_check = producer_check
        self.poll_s = poll_s
        self.warn = warn
        self._unused: dict[int, int] = {}  # segment offset -> groups of it not yet taken
        self._segment_of: dict[int, int] = {}  # group index -> segment offset
        self._recycle = stream.sibling(RECYCLE_PRODUCER) if cfg.unused_samples_handler == "retry" else None
        self._handed_out: list[Group] = []
        self._decoded: queue.Queue | None = None  # read-ahead: (offset, groups) or the reader's error
        self._ahead_lock = threading.Lock()
        self._closed = False
        if read_ahead:
            self._decoded = queue.Queue()
            threading.Thread(target=self._read_ahead, name=f"feed-{reader}", daemon=True).start()
        self.totals = {"stale": 0, "aborted": 0, "dropped": 0, "recycled": 0}

    def next_batch(self, n: int, trainer_version: int, stop: Callable[[], bool] = lambda: False) -> FeedBatch:
        """``n`` trainable groups (fewer only if ``stop()`` turns true while waiting)."""
        t0 = time.monotonic()
        waited, warned_at = 0.0, t0
        groups: list[Group] = []
        rejected: list[Rejected] = []
        while len(groups) < n:
            taken = self.buffer.take(n - len(groups), trainer_version)
            groups += taken.groups
            rejected += taken.rejected
            self._reject(taken.rejected)
            if len(groups) == n or stop():
                break
            if self._read_more():
                continue
            self.producer_check()
            if self._ended():
                raise ProducerEnded(
                    f"the rollout producer closed {self.stream.uri} after offset {self.reader.position}; "
                    f"the trainer still needs {n - len(groups)} of {n} groups for this step"
                )
            t_wait = time.monotonic()
            time.sleep(self.poll_s)
            waited += time.monotonic() - t_wait
            if time.monotonic() - warned_at >= self.cfg.no_progress_s:
                warned_at = time.monotonic()
                self.warn(
                    f"trainer has waited {time.monotonic() - t0:.0f} s for rollout data "
                    f"({len(groups)}/{n} groups; stream {self.stream.uri}, read up to offset {self.reader.position})"
                )
        self._handed_out += groups
        groups.sort(key=lambda g: g.group_index)
        return FeedBatch(groups, waited, rejected, self._metrics(groups, rejected, trainer_version))

    def commit(self) -> None:
        """The groups handed out so far are trained: move the durable cursor past them."""
        self._use(self._handed_out)
        self._handed_out = []

    def close(self) -> None:
        """Stop the read-ahead thread (if any)."""
        self._closed = True

    def _read_more(self) -> bool:
        """Move newly written segments into the buffer; True if there were any."""
        if self._decoded is None:
            decoded = [(s.offset, regroup(s.samples())) for s in self.reader.read()]
        else:
            decoded = []
            while not self._decoded.empty():
                item = self._decoded.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                decoded.append(item)
        for offset, groups in decoded:
            self._unused[offset] = len(groups)
            for g in groups:
                self._segment_of[g.group_index] = offset
            self.buffer.put(groups)
        return bool(decoded)

    def _read_ahead(self) -> None:
        """Background reading and decoding, so that a batch is ready when the trainer asks for it."""
        while not self._closed:
            try:
                with self._ahead_lock:
                    for segment in self.reader.read():
                        self._decoded.put((segment.offset, regroup(segment.samples())))
            except BaseException as e:  # noqa: BLE001 (the trainer's thread raises it)
                self._decoded.put(e)
                return
            time.sleep(self.poll_s)

    def _ended(self) -> bool:
        """The stream is closed and every group of it has been handed out or rejected."""
        with self._ahead_lock:
            decoded_all = self.reader.finished and (self._decoded is None or self._decoded.empty())
        return decoded_all and len(self.buffer) == 0

    def _reject(self, rejected: list[Rejected]) -> None:
        """Recycle or drop rejected groups now (so the producer's back-pressure sees them used)."""
        if not rejected:
            return
        for r in rejected:
            self.totals[r.reason] += 1
        if self._recycle is not None:
            self._recycle.append([s for r in rejected for s in r.group.samples])
            self.totals["recycled"] += len(rejected)
        else:
            self.totals["dropped"] += len(rejected)
        self._use([r.group for r in rejected])

    def _use(self, groups: list[Group]) -> None:
        """Mark groups used and move the durable cursor past segments with nothing left in them."""
        for g in groups:
            offset = self._segment_of.pop(g.group_index, None)
            if offset is not None:
                self._unused[offset] -= 1
        done = self.reader.cursor
        while self._unused.get(done + 1) == 0:
            done += 1
            del self._unused[done]
        if done > self.reader.cursor:
            self.reader.commit(done)

    def _metrics(self, groups: list[Group], rejected: list[Rejected], version: int) -> dict[str, Any]:
        lags = [group_lag(g, version) for g in groups]
        rej_lens = [len(s.response_ids) for r in rejected for s in r.group.samples]
        m: dict[str, Any] = {
            "async/queue_depth": float(len(self.buffer)),
            "async/staleness_mean": statistics.fmean(lags) if lags else 0.0,
            "async/staleness_max": float(max(lags, default=0)),
            "async/rejected_stale": float(sum(r.reason == "stale" for r in rejected)),
            "async/rejected_aborted": float(sum(r.reason == "aborted" for r in rejected)),
            "async/recycled_total": float(self.totals["recycled"]),
            "async/dropped_total": float(self.totals["dropped"]),
        }
        if rejected:
            rlags = [r.lag for r in rejected]
            m.update({
                "async/rejected_staleness_mean": statistics.fmean(rlags),
                "async/rejected_staleness_max": float(max(rlags)),
                "async/rejected_response_len_mean": statistics.fmean(rej_lens) if rej_lens else 0.0,
                "async/rejected_response_len_p50": _quantile(rej_lens, 0.5),
                "async/rejected_response_len_p90": _quantile(rej_lens, 0.9),
            })
        return m


def _quantile(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])
