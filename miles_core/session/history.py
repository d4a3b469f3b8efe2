"""A run's history as it is written: per-step metrics (``metrics.jsonl``) and evaluations (``eval.jsonl``)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_core.storage.layout import RunLayout
    from miles_core.trackers import Trackers


class RunHistory:
    """Rows this process recorded (a resumed run starts from the rows of its checkpoint). With
    ``trackers``, every row also goes to the run's experiment trackers (``miles_core.trackers``):
    a step's under ``prefix``, an evaluation's under ``prefix + "eval/"``."""

    def __init__(self, layout: RunLayout, trackers: Trackers | None = None, prefix: str = "") -> None:
        self.layout = layout
        self.trackers, self.prefix = trackers, prefix
        self._metrics: list[dict[str, Any]] = []
        self._evals: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def record(self, step: int, row: dict[str, Any]) -> None:
        """Append one step's metrics to ``metrics.jsonl``."""
        with self._lock:
            self._metrics.append({"step": step, **row})
            self.layout.write_jsonl("metrics.jsonl", self._metrics)
        if self.trackers:
            self.trackers.log(row, step, self.prefix)

    def add_eval(self, row: dict[str, Any]) -> None:
        """Add one evaluation to ``eval.jsonl``; evaluations may finish in any order, the file stays
        sorted by step."""
        with self._lock:
            self._evals.append(row)
            self._evals.sort(key=lambda e: e["step"])
            self.layout.write_jsonl("eval.jsonl", self._evals)
        if self.trackers:
            self.trackers.log(row, row["step"], self.prefix + "eval/")

    @property
    def metrics_rows(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._metrics)

    @property
    def eval_rows(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._evals)

    def rewind(self, step: int) -> None:
        """Keep the rows of steps <= ``step`` in both files (a run resumed from that checkpoint)."""
        with self._lock:
            self._metrics = [r for r in self.layout.read_jsonl("metrics.jsonl") if r["step"] <= step]
            self._evals = [r for r in self.layout.read_jsonl("eval.jsonl") if r["step"] <= step]
            self.layout.write_jsonl("metrics.jsonl", self._metrics)
            self.layout.write_jsonl("eval.jsonl", self._evals)

    def has_steps(self) -> bool:
        """Whether ``metrics.jsonl`` has any row (written by this process or an earlier one)."""
        return bool(self.layout.read_jsonl("metrics.jsonl"))


class HistoryFiles:
    """A run's history as its files hold it, read at each look: the view of a process that records
    nothing itself (the training flow's live report; the tasks record)."""

    def __init__(self, layout: RunLayout) -> None:
        self.layout = layout

    @property
    def metrics_rows(self) -> list[dict[str, Any]]:
        return self.layout.read_jsonl("metrics.jsonl")

    @property
    def eval_rows(self) -> list[dict[str, Any]]:
        return self.layout.read_jsonl("eval.jsonl")
