"""The results of the service's calls, kept for the SDK to fetch: ``Futures``.

Every call that returns an ``UntypedAPIFuture`` gets a request id here (``new``); its result is set
once (``resolve``, from any thread) and fetched by ``retrieve_future`` with a long poll (``wait``):
the SDK re-polls a ``try_again`` answer at once, so an answer that is not ready waits up to
``poll_s`` before saying so. Results stay for ``keep_s`` after they are set, so a client that
reconnects (or polls again after a timeout) still gets them; a request id the service never gave,
or one forgotten, is answered with an error that says so.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field


log = logging.getLogger(__name__)


@dataclass
class Result:
    """A call's answer: ``body`` with its content type (JSON or protobuf), or an error."""

    body: bytes
    content_type: str = "application/json"


@dataclass
class _Entry:
    kind: str
    model_id: str | None
    created: float = field(default_factory=time.monotonic)
    result: Result | None = None
    done_at: float | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)


class Futures:
    """Request ids and their results (module docstring). Created on the server's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, poll_s: float = 25.0, keep_s: float = 3600.0) -> None:
        self.loop = loop
        self.poll_s = poll_s
        self.keep_s = keep_s
        self._entries: dict[str, _Entry] = {}
        self._done: collections.deque[tuple[float, str]] = collections.deque()
        """(when, request id) of each result set, oldest first: forgetting looks at the old ones only."""
        self._lock = threading.Lock()

    def new(self, kind: str, model_id: str | None = None) -> str:
        request_id = f"{kind}-{uuid.uuid4().hex}"
        with self._lock:
            self._forget_old()
            self._entries[request_id] = _Entry(kind, model_id)
        return request_id

    def resolve(self, request_id: str, result: Result) -> None:
        """Set the result (once; from any thread)."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.result is not None:
                return
            entry.result, entry.done_at = result, time.monotonic()
            self._done.append((entry.done_at, request_id))
        if _on_loop(self.loop):
            entry.event.set()
        else:
            self.loop.call_soon_threadsafe(entry.event.set)

    def fail(self, request_id: str, error: BaseException, user: bool) -> None:
        """Answer with the SDK's failed-request shape: ``RequestFailedError`` on the client, its
        category ``user`` (the call was wrong) or ``server``."""
        if isinstance(error, KeyError) and error.args:
            message = str(error.args[0])
        else:
            message = str(error) if user else f"{type(error).__name__}: {error}"
        if not user:
            log.warning("tinker: request %s failed: %s", request_id, message)
        body = {"error": message, "category": "user" if user else "server"}
        self.resolve(request_id, Result(json.dumps(body).encode()))

    def pending(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.result is None)

    async def wait(self, request_id: str) -> Result | None:
        """The result, or None when it is not ready within ``poll_s``; KeyError for an unknown id."""
        with self._lock:
            entry = self._entries.get(request_id)
        if entry is None:
            raise KeyError(request_id)
        if entry.result is None:
            try:
                await asyncio.wait_for(entry.event.wait(), self.poll_s)
            except TimeoutError:
                return None
        return entry.result

    def _forget_old(self) -> None:
        now = time.monotonic()
        while self._done and now - self._done[0][0] > self.keep_s:
            self._entries.pop(self._done.popleft()[1], None)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
