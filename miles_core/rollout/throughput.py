"""A rollout producer's counters, and the producer metrics a trainer reports from them.

- ``ProducerStats``: what a producer counts over its life (its heartbeat and its state file carry
  them as a dict).
- ``ThroughputMeter``: the one place the ``async/producer_*`` metrics are computed: throughput and
  idle share, each producer's on its own clock, from the counters of one producer in the trainer's
  process (``producer.ProducerMeter``) or of a fleet's running producers, read from their
  heartbeats (``supervisor.Fleet.metrics``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
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
    """Since the producer started (up to its latest counters)."""
    peak_in_flight: int = 0


class ThroughputMeter:
    """Producer metrics as of each producer's newest counters. Each producer's throughput and idle
    share are measured on its own clock (``run_seconds``) between the counters the meter saw last
    and the ones it sees now; a producer whose counters have not moved since (its next heartbeat
    is not out yet) keeps the rate it had, so a trainer's step shorter than a heartbeat reads no
    false 0 and the next no burst. A producer first seen counts from its start (counters at 0).
    Until some producer's counters have moved, there is no throughput or idle share to report."""

    min_span_s = 0.5
    """A producer's counters are read again only once its clock moved this far since the last read."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[float, int, float]] = {}
        self._rates: dict[str, tuple[float, float]] = {}

    def __call__(self, stats: Mapping[str, dict[str, Any]], in_flight: float,
                 running: Collection[str] | None = None) -> dict[str, float]:
        """``stats``: each producer's ``ProducerStats`` (as a dict) by its name, whose counters are
        summed; ``running``: those whose rates count (all by default: a stopped producer's counters
        stay, its rate does not); ``in_flight``: their samples in flight now."""
        running = stats.keys() if running is None else running
        for name in running:
            s = stats[name]
            now = (s.get("run_seconds", 0.0), s.get("samples_finished", 0), s.get("idle_seconds", 0.0))
            t_prev, finished_prev, idle_prev = self._seen.get(name, (0.0, 0, 0.0))
            if now[0] - t_prev >= self.min_span_s:  # (a rate over a few ms says nothing)
                span = now[0] - t_prev
                self._rates[name] = ((now[1] - finished_prev) / span, min(1.0, max(0.0, (now[2] - idle_prev) / span)))
                self._seen[name] = now
        rates = [self._rates[name] for name in running if name in self._rates]
        values = list(stats.values())
        measured = {} if not rates else {  # none before a producer's counters first move
            "async/producer_throughput_qps": sum(qps for qps, _ in rates),
            "async/producer_idle_fraction": sum(idle for _, idle in rates) / len(rates),
        }
        return {
            **measured,
            "async/in_flight_samples": float(in_flight),
            "async/weight_updates": float(sum(s.get("weight_updates", 0) for s in values)),
            "async/groups_filtered": float(sum(sum(s.get("groups_filtered", {}).values()) for s in values)),
            "async/samples_failed": float(sum(s.get("samples_failed", 0) for s in values)),
            "async/generation_errors": float(sum(s.get("generation_errors", 0) for s in values)),
        }
