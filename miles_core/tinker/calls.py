"""The order training calls run in: ``CallQueue``.

The SDK numbers each training client's calls (``seq_id``, from 1) and sends them one after the
other; the service runs them in that order. ``take`` hands the training thread the next call of
every client that has it (at most one per client: a client's calls never run side by side).
``forward_backward`` calls run fused, so a round with one waits up to ``gather_s`` for the calls of
the other active clients (answered less than ``ACTIVE_S`` ago), which may be on their way; a client
alone, or among idle ones, never waits. (Waiting longer, or holding passes back while other calls
run so that more clients join them, fused more clients a pass but made each round slower:
``bench/tinker.py``, docs/tinker.md.) A call that is not numbered (a client's creation) runs next.

A call whose predecessor has not come within ``seq_wait_s`` fails, and so do those behind it,
naming the ``seq_id`` that never came: the SDK sends in order, so a gap is a lost request, and
waiting for it forever would hang the client. A call numbered below one that already ran fails at
once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


ACTIVE_S = 1.0
"""A client answered less than this ago is active: a round of passes waits for its next call."""


class OrderError(ValueError):
    """A call out of its client's order (the message names the seq_ids)."""


@dataclass
class Call:
    kind: str
    model_id: str
    seq_id: int
    request_id: str
    payload: Any
    arrived: float = field(default_factory=time.monotonic)


class CallQueue:
    """Training calls per client, in ``seq_id`` order (module docstring). ``fail(request_id, error)``
    answers a call that cannot run."""

    def __init__(self, fail: Callable[[str, BaseException], None], seq_wait_s: float = 120.0,
                 gather_s: float = 0.02) -> None:
        self.fail = fail
        self.seq_wait_s = seq_wait_s
        self.gather_s = gather_s
        self._cond = threading.Condition()
        self._waiting: dict[str, dict[int, Call]] = {}
        self._next: dict[str, int | None] = {}
        self._answered: dict[str, float] = {}
        """When each client's last call was answered (``done``); a client gone is not in it."""
        self._closed = False

    def put(self, call: Call, ordered: bool = True) -> None:
        with self._cond:
            waiting = self._waiting.setdefault(call.model_id, {})
            nxt = self._next.get(call.model_id)
            if not ordered:  # runs next, whatever the numbers of the calls waiting
                call.seq_id = -1
                waiting[-1] = call
                self._next[call.model_id] = -1
            elif nxt is not None and nxt >= 0 and call.seq_id < nxt:
                self.fail(call.request_id, OrderError(f"{call.model_id}: seq_id {call.seq_id} came after seq_id "
                                                      f"{nxt - 1} had run; calls run in seq_id order"))
                return
            else:
                waiting[call.seq_id] = call
                if nxt is None:
                    self._next[call.model_id] = call.seq_id
            self._cond.notify_all()

    def take(self) -> list[Call] | None:
        """The next round's calls (blocks until there are some); None once closed (module docstring)."""
        with self._cond:
            while not (ready := self._ready()) and not self._closed:
                self._cond.wait(timeout=1.0)
            start = time.monotonic()
            while ready and not self._closed and (until := self._gather_until(ready, start)) is not None:
                self._cond.wait(timeout=until - time.monotonic())  # woken by each put
                ready = self._ready()
            return None if self._closed else ready

    def _gather_until(self, ready: list[Call], start: float) -> float | None:
        """Until when a round with ``forward_backward`` calls waits for the other active clients'
        calls (module docstring); None: it runs now."""
        now, here = time.monotonic(), {c.model_id for c in ready}
        if now >= start + self.gather_s or not any(c.kind == "forward_backward" for c in ready):
            return None
        if all(m in here or now - t >= ACTIVE_S for m, t in self._answered.items()):
            return None
        return start + self.gather_s

    def done(self, call: Call) -> None:
        """``call`` ran: its client's next call may go."""
        with self._cond:
            waiting = self._waiting.get(call.model_id, {})
            waiting.pop(call.seq_id, None)
            self._answered[call.model_id] = time.monotonic()
            if call.seq_id >= 0:
                self._next[call.model_id] = call.seq_id + 1
            else:  # an unnumbered call ran: the next is the lowest waiting, or whichever comes first
                self._next[call.model_id] = min(waiting) if waiting else None
            self._cond.notify_all()

    def forget(self, model_id: str) -> None:
        """The client is gone (unloaded, its session finished): rounds no longer wait for it."""
        with self._cond:
            self._answered.pop(model_id, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _ready(self) -> list[Call]:
        """Each client's next call where it is there (with the lock held); gaps older than
        ``seq_wait_s`` fail the calls behind them."""
        ready, now = [], time.monotonic()
        for model_id, waiting in self._waiting.items():
            if not waiting:
                continue
            nxt = self._next.get(model_id)
            if nxt in waiting:
                ready.append(waiting[nxt])
                continue
            if now - min(c.arrived for c in waiting.values()) > self.seq_wait_s:
                for c in waiting.values():
                    self.fail(c.request_id, OrderError(
                        f"{model_id}: waited {self.seq_wait_s:.0f} s for seq_id {nxt}, which never came; "
                        f"seq_id {c.seq_id} cannot run before it"))
                waiting.clear()
                self._next[model_id] = None
        return ready
