"""The trainer's buffer of finished groups: FIFO, bounded, staleness- and abort-aware.

Parts:
- ``DataBuffer``: the protocol a custom buffer implements (``--custom-async-data-buffer-path``
  names a class ``Cls(cfg: AsyncConfig, capacity: int)``).
- ``DefaultDataBuffer``: groups in arrival order; ``take`` hands out up to n trainable groups and
  sets aside the stale and aborted ones it meets on the way, each with why.
- ``group_lag``: how many versions a group's oldest span lags the trainer.

Staleness is measured at the moment a group is taken, against the trainer's version then: a group
that waited in the buffer while the trainer moved on ages there. Nothing is stale while the trainer
has not yet updated in this run (``trainer_version <= first_version``), so a run never throws away
its first batches.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from miles_core.types import Group, SampleStatus

if TYPE_CHECKING:
    from miles_core.config import AsyncConfig

RejectReason = Literal["stale", "aborted"]


def group_lag(group: Group, trainer_version: int) -> int:
    """Versions between the trainer and the oldest weights that generated any span of the group."""
    return trainer_version - min(min(s.span_versions) for s in group.samples)


@dataclass
class Rejected:
    group: Group
    reason: RejectReason
    lag: int


@dataclass
class Taken:
    """What one ``take`` found: trainable groups in arrival order, and the ones set aside."""

    groups: list[Group]
    rejected: list[Rejected]


@runtime_checkable
class DataBuffer(Protocol):
    capacity: int

    def put(self, groups: list[Group]) -> None:
        """Add finished groups (in the order the producer finished them)."""

    def take(self, n: int, trainer_version: int) -> Taken:
        """Up to ``n`` trainable groups, plus every group rejected while looking for them."""

    def __len__(self) -> int: ...


class DefaultDataBuffer:
    """FIFO of groups. ``take`` rejects a group when any sample was aborted, or when its lag exceeds
    ``cfg.max_weight_staleness`` (once the trainer has updated past ``first_version``)."""

    def __init__(self, cfg: AsyncConfig, capacity: int, first_version: int = 0) -> None:
        self.capacity = capacity
        self.max_staleness = cfg.max_weight_staleness
        self.first_version = first_version
        self._groups: deque[Group] = deque()

    def put(self, groups: list[Group]) -> None:
        self._groups.extend(groups)

    def take(self, n: int, trainer_version: int) -> Taken:
        taken = Taken([], [])
        filtering = self.max_staleness is not None and trainer_version > self.first_version
        while self._groups and len(taken.groups) < n:
            group = self._groups.popleft()
            lag = group_lag(group, trainer_version)
            if any(s.status is SampleStatus.ABORTED for s in group.samples):
                taken.rejected.append(Rejected(group, "aborted", lag))
            elif filtering and lag > self.max_staleness:
                taken.rejected.append(Rejected(group, "stale", lag))
            else:
                taken.groups.append(group)
        return taken

    def __len__(self) -> int:
        return len(self._groups)


def make_buffer(cfg: AsyncConfig, capacity: int, first_version: int = 0, path: str | None = None) -> DataBuffer:
    """The default buffer, or the class at ``path`` (``"module:Class"``) built as ``Cls(cfg, capacity)``."""
    if path is None:
        return DefaultDataBuffer(cfg, capacity, first_version)
    from miles_core.plugins import load_object

    cls = load_object(path, "custom data buffer")
    buffer = cls(cfg, capacity)
    missing = [m for m in ("put", "take", "__len__") if not callable(getattr(buffer, m, None))]
    if missing:
        raise TypeError(f"custom data buffer {path!r} lacks {missing}; see miles_core.rollout.buffer.DataBuffer")
    return buffer
