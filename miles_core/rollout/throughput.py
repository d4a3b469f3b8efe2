"""A rollout producer's counters, and the producer metrics a trainer reports from them.

- ``ProducerStats``: what a producer counts over its life (its heartbeat and its state file carry
  them as a dict).
- ``ThroughputMeter``: the one place the ``async/producer_*`` metrics are computed: throughput and
  idle share since the last call, from the counters of one producer in the trainer's process
  (``producer.ProducerMeter``) or of a fleet's producers, read from their heartbeats
  (``supervisor.Fleet.metrics``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ProducerStats:
    groups_started: int = 0
    groups_finished: int = 0
    groups_written: int = 0
    segments_written: int = 0
    samples_finished: int = 0
    response_tokens: int = 0
    """Tokens generated into finished samples (kept, filtered or failed alike): the rollout cost."""
    samples_failed: int = 0
    generation_errors: int = 0
    groups_filtered: dict[str, int] = field(default_factory=dict)
    groups_abandoned: int = 0
    groups_saved_partial: int = 0
    groups_resumed_partial: int = 0
    weight_updates: int = 0
    weight_update_seconds: float = 0.0
    backpressure_seconds: float = 0.0
    idle_seconds: float = 0.0
    run_seconds: float = 0.0
    peak_in_flight: int = 0


class ThroughputMeter:
    """Producer metrics since the last call. ``from_zero``: the first call counts from when the meter
    was made and from no sample (a producer made after it); else the first call only sets the
    baseline (producers whose counters began earlier, such as a restarted run's)."""

    def __init__(self, from_zero: bool = False) -> None:
        self._seen: tuple[float, int, float] | None = (time.monotonic(), 0, 0.0) if from_zero else None

    def __call__(self, stats: Sequence[dict[str, Any]], in_flight: float, producers: int = 1) -> dict[str, float]:
        """``stats``: each producer's ``ProducerStats`` as a dict; ``in_flight``: their samples in
        flight now; ``producers``: how many share the idle time (the idle share is an average)."""
        now = time.monotonic()
        finished = sum(s.get("samples_finished", 0) for s in stats)
        idle = sum(s.get("idle_seconds", 0.0) for s in stats)
        t_prev, finished_prev, idle_prev = self._seen or (now, finished, idle)
        self._seen = (now, finished, idle)
        span = max(now - t_prev, 1e-9)
        return {
            "async/producer_throughput_qps": (finished - finished_prev) / span,
            "async/producer_idle_fraction": min(1.0, max(0.0, (idle - idle_prev) / span / max(producers, 1))),
            "async/in_flight_samples": float(in_flight),
            "async/weight_updates": float(sum(s.get("weight_updates", 0) for s in stats)),
            "async/groups_filtered": float(sum(sum(s.get("groups_filtered", {}).values()) for s in stats)),
            "async/samples_failed": float(sum(s.get("samples_failed", 0) for s in stats)),
            "async/generation_errors": float(sum(s.get("generation_errors", 0) for s in stats)),
        }
