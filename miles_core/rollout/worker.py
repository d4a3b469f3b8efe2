"""How a rollout producer of a fleet talks to its run folder (the process around it is
``session.fleet_member``).

- ``ProducerLink``: what ``RolloutProducer`` polls (``control_poll_s``): stop, pause, fence, in one
  listing; it also writes the heartbeat (every ``producer_heartbeat_s``) and reads how many live
  producers share the buffer bound (``fleet/ahead.json``: the trainer writes it from the
  heartbeats it reads, so no producer reads the others' heartbeats).
- ``ClaimedPrompts``: the producer's prompt supply, ``prompt_claim_size`` prompts per claim.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles_core import processes
from miles_core.rollout.fleet import ControlPlane, Heartbeat, ProducerFenced, PromptLog

if TYPE_CHECKING:
    from miles_core.rollout.generate import PromptItem
    from miles_core.rollout.producer import RolloutProducer
    from miles_core.types import Group


class ClaimedPrompts:
    """A producer's prompts (its ``PromptSupply``): blocks claimed from the run's prompt log, each
    prompt with its group index (unique in the run)."""

    def __init__(self, log: PromptLog, producer: str, render, block: int) -> None:
        self.log, self.producer, self.render, self.block = log, producer, render, block
        self._queue: deque[tuple[PromptItem, int]] = deque()
        self.claims = 0
        self._lock = threading.Lock()  # the producer calls take and filtered from worker threads; one log

    def take(self) -> tuple[PromptItem, int]:
        with self._lock:
            if not self._queue:
                claim = self.log.claim(self.producer, self.block)
                self.claims += 1
                items = self.render(claim.rows)
                self._queue.extend((item, claim.group_index(i)) for i, item in enumerate(items))
            return self._queue.popleft()

    def unstarted(self) -> dict[int, int]:
        """Group index -> row of the prompts claimed and not started yet."""
        return {group: item.prompt_index for item, group in self._queue}

    def filtered(self, group: Group, reason: str) -> None:
        """A dynamic filter dropped ``group``: the prompt log records it as settled."""
        with self._lock:
            self.log.filtered(self.producer, group.group_index, group.samples[0].prompt_index, reason)

    def release_own(self, groups: dict[int, int], reason: str):
        """Give back prompts this producer claimed (group index -> row); see ``PromptLog.release_own``."""
        with self._lock:
            return self.log.release_own(groups, reason=reason, producer=self.producer)

    def adopted(self) -> list[tuple[str, set[int]]]:
        """The partial groups this producer took over: (the producer that saved them, group indices)."""
        with self._lock:
            return [(c.source, set(c.groups)) for c in self.log.adopted_by(self.producer)]

    def state(self) -> dict[str, Any]:
        return {"claims": self.claims, "queued": len(self._queue)}

    def load_state(self, state: dict[str, Any]) -> None:
        """Nothing to load: the prompt log is the cursor."""


@dataclass
class Signal:
    """What one poll of the control plane tells a producer."""

    stop: bool = False
    pause_holders: list[str] = field(default_factory=list)
    fleet_size: int | None = None
    """Live producers sharing the buffer bound (``fleet/ahead.json``), when this poll read it."""


class ProducerLink:
    """A producer's side of the control plane (polled from the producer's loop, on a worker thread)."""

    def __init__(self, control: ControlPlane, heartbeat: Heartbeat, heartbeat_s: float,
                 cancel: threading.Event | None = None, parent_pid: int | None = None) -> None:
        self.control, self.hb, self.heartbeat_s = control, heartbeat, heartbeat_s
        self.cancel = cancel or threading.Event()
        self.parent_pid = parent_pid
        """Stop when this process is no longer our parent (the trainer died without stopping us)."""
        self._beat_at = 0.0
        self._lock = threading.Lock()  # the starting beat's thread and the producer's loop

    def poll(self, producer: RolloutProducer, beat_now: bool = False) -> Signal:
        """One listing of ``control/`` (stop, pause, fence); on the heartbeat's cadence also the
        heartbeat and the fleet's groups ahead (``ahead.json``, which the trainer writes)."""
        signals = self.control.signals()
        if self.hb.producer in signals.fenced:
            raise ProducerFenced(f"producer {self.hb.producer} was declared dead by the trainer "
                                 f"({self.control.files.url(f'control/fence/{self.hb.producer}.json')}); stopping")
        stop = self.cancel.is_set() or signals.stop
        if self.parent_pid is not None and processes.orphaned(self.parent_pid):
            stop = True
        now, fleet_size = time.monotonic(), None
        if beat_now or now - self._beat_at >= self.heartbeat_s:
            self.beat(**producer.heartbeat_fields())
            self._beat_at = now
            fleet_size = len(set(self.control.ahead()) | {self.hb.producer})
        return Signal(stop, signals.pause_holders, fleet_size)

    def beat(self, **fields: Any) -> None:
        with self._lock:
            for key, value in fields.items():
                setattr(self.hb, key, value)
            self.control.beat(self.hb)

    def fail(self, error: BaseException) -> None:
        """Say ``failed``, with ``error`` and its traceback (call it in the ``except`` that caught it)."""
        self.beat(status="failed", error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc(),
                  outstanding=0, in_engine=0)

    def beat_while_starting(self) -> threading.Event:
        """Beat ``starting`` from a thread until the producer's loop beats by itself (loading an
        engine can take minutes); set the returned event to end it early."""
        done = threading.Event()

        def run() -> None:
            while not done.wait(self.heartbeat_s):
                with self._lock:
                    if self.hb.status != "starting":
                        return
                try:
                    self.beat()
                except Exception:  # noqa: BLE001 (the loop's own beats report storage errors)
                    return

        threading.Thread(target=run, name=f"heartbeat-{self.hb.producer}", daemon=True).start()
        return done
