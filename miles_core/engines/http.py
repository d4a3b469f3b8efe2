"""HTTP machinery shared by the engines that are clients of a server (``sglang``, ``vllm``).

- ``Transport`` / ``AiohttpTransport``: how requests travel (tests put a fake one in).
- ``HealthWatch``: the deadline of requests to a server that stops answering (``/health`` probes).
- ``HTTPEngine``: a base class with one I/O event loop per engine (a ``LoopThread`` started on
  first use) and one aiohttp session on it: callers may drive one engine from any loop, or several
  (tests call ``asyncio.run`` repeatedly), while a session and its connections belong to the loop
  that made them. A caller's cancelled call cancels its request there, and the server sees the
  disconnect.
- ``EngineHTTPError``: the server answered with an error status; ``EngineUnreachable``: no answer.

HTTP goes through aiohttp (as Miles' own SGLang client does): 256 concurrent requests to a local
server took 1.5-1.8 s with httpx's AsyncClient and 0.02-0.06 s with aiohttp (httpx issue #3215:
its connection pool does not scale with concurrency), and a rollout producer keeps hundreds of
calls in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import weakref
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from miles_core.loop import LoopThread

CONTROL_TIMEOUT_S = 60.0
"""Timeout of the control endpoints (a pause waits for the running batch on a CPU server, hence
not a few seconds)."""
PUSH_MIN_BYTES_PER_S = 20e6
"""A weight push's deadline is ``CONTROL_TIMEOUT_S`` plus its snapshot's size at this rate (a slow
disk read and load on a busy CPU machine), at most ``request_timeout_s``."""
GENERATE_BASE_S = 300.0
GENERATE_S_PER_TOKEN = 2.0
"""A generate call's deadline: ``GENERATE_BASE_S`` (room for a queue, a pause, a weight load) plus
this per token of its longest request, at most ``request_timeout_s`` (a server that answers
``/health`` but never finishes a batch)."""
CONTROL_ATTEMPTS = 3
"""A control call the server can take twice (a weight push of a given version, an adapter load) is
sent again after no answer: a server frozen and back again resets the connection it was on."""
CONTROL_RETRY_DELAY_S = 1.0
"""Wait before attempt k + 1 of such a call: k times this."""
T = TypeVar("T")
log = logging.getLogger(__name__)


class EngineHTTPError(RuntimeError):
    """The server answered an engine request with an error status."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url} answered HTTP {status}: {message}")
        self.url, self.status, self.message = url, status, message


class EngineUnreachable(ConnectionError):
    """No answer from the server (connection refused or reset, timeout)."""


class EngineTimeout(EngineUnreachable):
    """The request's own deadline passed with no answer (the server may be slow, not gone)."""


class Transport(Protocol):
    """Sends one HTTP request and returns (status, body). Raises ``EngineUnreachable`` when no
    answer comes. Used on one event loop only."""

    async def request(
        self, method: str, url: str, body: dict[str, Any] | None, timeout: float
    ) -> tuple[int, bytes]: ...

    async def close(self) -> None: ...


IDLE_CONNECTION_S = 2.0
"""How long an idle connection is kept for reuse: less than the servers' keep-alive (uvicorn's 5 s,
which vLLM, SGLang and the stand-in server run with). aiohttp's own 15 s let the client send on a
connection the server was closing: "Server disconnected" (seen on a vLLM evaluation engine whose
requests came about 5 s apart)."""


class AiohttpTransport:
    """``Transport`` over one aiohttp session with no connection limit (concurrent calls must not
    queue in the client: the server batches them), closing idle connections before servers do."""

    def __init__(self) -> None:
        self._session = None

    async def request(self, method: str, url: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, bytes]:
        import aiohttp

        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_CONNECTION_S)
            self._session = aiohttp.ClientSession(connector=connector)
        try:
            limit = aiohttp.ClientTimeout(total=timeout)
            async with self._session.request(method, url, json=body, timeout=limit) as reply:
                return reply.status, await reply.read()
        except asyncio.TimeoutError as e:
            raise EngineTimeout(f"{url}: no answer within {timeout:g} s") from e
        except aiohttp.ClientError as e:  # refused, reset, disconnected, bad reply
            raise EngineUnreachable(f"{url}: cannot reach the engine server ({type(e).__name__}: {e})") from e

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class HealthWatch:
    """The health deadline of one server's requests (on the engine's I/O loop). While requests
    wait, ``GET /health`` is probed every ``probe_s`` (SGLang's own ``/health`` may run a one-token
    generation, so each probe gets ``probe_s`` to answer); a reply, or any request answered, is a
    sign of life. After ``warn_s`` without one, a warning names the URL and what is pending (and
    again every ``warn_s``); after ``timeout_s``, every pending request fails with
    ``EngineUnreachable`` naming them, instead of waiting out the request timeout. While a
    control call that may legitimately hold the server (a weight update, a pause, an adapter
    load: ``exempt``, the paths of such calls) is pending, the server counts as alive (those calls
    have their own deadline), and a warning names the call every ``warn_s`` it goes unanswered."""

    def __init__(self, url: str, transport: Transport, warn_s: float, timeout_s: float,
                 warn=log.warning, clock=time.monotonic, exempt: tuple[str, ...] = ()) -> None:
        self.url, self.transport, self.exempt = url, transport, exempt
        self.warn_s, self.timeout_s = warn_s, timeout_s
        self.probe_s = max(0.05, min(10.0, warn_s / 3, timeout_s / 4))
        """How often ``/health`` is probed while requests wait: a silent server is named within
        ``warn_s`` plus this."""
        self.warn, self.clock = warn, clock
        self._pending: dict[asyncio.Task, tuple[str, float]] = {}
        self._life = clock()
        self._expired: dict[asyncio.Task, str] = {}
        """Requests this watch cancelled at the deadline, each with why."""
        self._watcher: asyncio.Task | None = None

    async def track(self, path: str, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` (a request to ``path``) under the deadline."""
        task = asyncio.ensure_future(coro)
        if not self._pending:
            self._life = self.clock()  # silence counts from when something is awaited
        self._pending[task] = (path, self.clock())
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch())
        try:
            result = await task
        except asyncio.CancelledError:
            why = self._expired.get(task)
            if why is not None:  # this watch cancelled it (else the caller was cancelled: that propagates)
                raise EngineUnreachable(why) from None
            raise
        finally:
            self._pending.pop(task, None)
            self._expired.pop(task, None)
        self._life = self.clock()
        return result

    async def stop(self) -> None:
        """Stop probing (the engine closes)."""
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher

    def generating(self) -> bool:
        """Whether a request other than a control call is pending (a generate)."""
        return any(path not in self.exempt for path, _ in list(self._pending.values()))

    def describe(self) -> str:
        now = self.clock()
        paths = sorted({p for p, _ in self._pending.values()})
        oldest = max((now - t for _, t in self._pending.values()), default=0.0)
        return f"{len(self._pending)} request(s) pending ({', '.join(paths)}; the oldest for {oldest:.0f} s)"

    async def _watch(self) -> None:
        warned_at = None
        while self._pending:
            await asyncio.sleep(self.probe_s)
            if not self._pending:
                return
            busy = [(path, self.clock() - t) for path, t in self._pending.values() if path in self.exempt]
            if busy:  # a control call may hold the server: no deadline here (the call has its own), but say so
                path, waited = max(busy, key=lambda b: b[1])
                self._life = self.clock()
                if waited >= self.warn_s and (warned_at is None or self.clock() - warned_at >= self.warn_s):
                    warned_at = self.clock()
                    self.warn(f"the engine server at {self.url} has not answered {path} for {waited:.0f} s; "
                              f"{self.describe()}")
                continue
            try:
                status, _ = await asyncio.wait_for(self.transport.request("GET", f"{self.url}/health", None,
                                                                          self.probe_s), self.probe_s)
                if status < 500:
                    self._life, warned_at = self.clock(), None
            except (EngineUnreachable, asyncio.TimeoutError, OSError):
                pass
            silent = self.clock() - self._life
            if silent >= self.timeout_s:
                why = (f"{self.url}: the engine server gave no sign of life for {silent:.0f} s (no reply, and "
                       f"/health unanswered; engine.health_timeout_s = {self.timeout_s:g}); {self.describe()}")
                for task in list(self._pending):
                    self._expired[task] = why
                    task.cancel()
                return
            if silent >= self.warn_s and (warned_at is None or self.clock() - warned_at >= self.warn_s):
                warned_at = self.clock()
                self.warn(f"the engine server at {self.url} has not answered for {silent:.0f} s (/health "
                          f"neither); {self.describe()}; failing at {self.timeout_s:g} s")




def _stop_loop(loop: asyncio.AbstractEventLoop) -> None:
    if not loop.is_closed():
        loop.call_soon_threadsafe(loop.stop)




def error_message(data: bytes) -> str:
    """The message of an SGLang error reply: ``{"error": {"message"}}``, ``{"message"}`` or
    ``{"detail"}`` (FastAPI), else the start of the body."""
    try:
        reply = json.loads(data)
    except ValueError:
        return data[:500].decode(errors="replace") or "(empty body)"
    if isinstance(reply, dict):
        err = reply.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "error_message", "detail", "error"):
            if reply.get(key):
                return str(reply[key])
    return str(reply)[:500]


class HTTPEngine:
    """What every server-client engine shares: its URL, transport, health deadline and I/O loop;
    ``_post`` / ``_get`` and ``health`` / ``close``. ``server``: a launched server the engine owns
    and stops on ``close()`` (anything with ``stop()``). ``exempt``: paths of control calls that
    may hold the server legitimately (``HealthWatch``)."""

    name = "engine"

    def __init__(self, url: str, cfg: Any, server: Any = None, transport: Transport | None = None,
                 exempt: tuple[str, ...] = ()) -> None:
        self.url = url.rstrip("/")
        self.cfg = cfg
        self.server = server
        self._transport: Transport = transport if transport is not None else AiohttpTransport()
        """Used on ``self._io``'s loop only."""
        self._io: LoopThread | None = None
        self._io_lock = threading.Lock()
        self._closed = False
        self._watch = HealthWatch(self.url, self._transport, cfg.health_warn_s, cfg.health_timeout_s, exempt=exempt)
        """The health deadline of requests to the server (used on ``self._io``'s loop only)."""
        self.storage_options: dict[str, Any] = {}
        """fsspec options of the store weight URIs point into, when this process may read it."""
        self.longest_tokens = 0
        """The most tokens a generate request has asked for (sizes the wait of a push behind one)."""
        self._version = 0
        """Version of the weights last loaded through this engine (0: the server's own)."""
        self._adapter_versions: dict[str, int] = {}
        """Each adapter's version, as last loaded through this engine."""

    @property
    def weight_version(self) -> int:
        return self._version

    async def health(self) -> bool:
        """Whether ``/health`` answers 200 (False when it answers otherwise or not at all)."""
        if self._closed:
            return False
        try:
            status, _ = await self._on_io(self._transport.request("GET", f"{self.url}/health", None, CONTROL_TIMEOUT_S))
        except EngineUnreachable:
            return False
        return status == 200

    async def close(self) -> None:
        """Close the HTTP client and its loop; stop the server if this engine launched it."""
        self._closed = True
        with self._io_lock:
            io, self._io = self._io, None
        if io is not None:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._watch.stop(), io.loop))
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._transport.close(), io.loop))
            await asyncio.to_thread(io.close)
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)

    async def _on_io(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` run on the engine's I/O loop (cancelling the wait cancels it there)."""
        with self._io_lock:
            if self._io is None:
                self._io = LoopThread(f"{self.name}-engine-io")
                # an engine dropped without close() must not leave its loop thread running
                weakref.finalize(self, _stop_loop, self._io.loop)
            io = self._io
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, io.loop))

    async def _post(self, path: str, body: dict[str, Any] | None = None, timeout: float = CONTROL_TIMEOUT_S) -> Any:
        """POST ``body`` as JSON (``path`` may carry a query); the decoded JSON reply (None when the
        reply is not JSON)."""
        return await self._call("POST", path, body, timeout)

    async def _post_again_if_cut(self, path: str, body: dict[str, Any], timeout: float) -> Any:
        """``_post`` of a call the server can take twice, sent again (up to ``CONTROL_ATTEMPTS``
        times, each with ``timeout``) when no answer came: a server that froze and came back resets
        the connection the call was on. After a call's own deadline passed, it is sent again only
        once ``/health`` answers (within ``health_timeout_s``): a server frozen for good fails it
        then. The last failure names the URL and every attempt."""
        failures = []
        for attempt in range(1, CONTROL_ATTEMPTS + 1):
            sent = attempt
            try:
                return await self._post(path, body, timeout=timeout)
            except EngineUnreachable as e:
                failures.append(str(e))
                if attempt == CONTROL_ATTEMPTS:
                    break
                if isinstance(e, EngineTimeout) and not await self._answers_within(self.cfg.health_timeout_s):
                    failures.append(f"/health unanswered for {self.cfg.health_timeout_s:g} s since")
                    break
                log.warning("%s%s: no answer (%s); sending it again (attempt %d of %d)", self.url, path, e,
                            attempt + 1, CONTROL_ATTEMPTS)
                await asyncio.sleep(CONTROL_RETRY_DELAY_S * attempt)
        raise EngineUnreachable(f"{self.url}{path}: no answer in {sent} attempt(s) of up to {timeout:g} s "
                                f"each: " + "; ".join(failures))

    async def _answers_within(self, seconds: float) -> bool:
        """Whether ``/health`` answers 200 within ``seconds`` (asked every few seconds)."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            try:
                status, _ = await self._on_io(self._transport.request("GET", f"{self.url}/health", None,
                                                                      max(0.05, min(5.0, left))))
                if status == 200:
                    return True
            except EngineUnreachable:
                pass
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def generate_timeout_s(self, max_new_tokens: int) -> float:
        """The deadline of a generate call whose longest request asks for ``max_new_tokens``."""
        return min(self.cfg.request_timeout_s, GENERATE_BASE_S + GENERATE_S_PER_TOKEN * max_new_tokens)

    def push_timeout_s(self, uri: str, max_new_tokens: int = 0) -> float:
        """The deadline of a weight push of the snapshot at ``uri``: ``CONTROL_TIMEOUT_S`` plus its
        size at ``PUSH_MIN_BYTES_PER_S``, plus, while generate calls are in flight (the server loads
        once they are done), the deadline of one asking for ``max_new_tokens``; at most
        ``request_timeout_s``, which it is when this process cannot see the snapshot's size (another
        machine's path, or object storage it was given no options for)."""
        import fsspec

        local = "://" not in uri or uri.startswith("file://")
        if not local and not self.storage_options:
            return self.cfg.request_timeout_s
        try:
            fs, path = fsspec.core.url_to_fs(uri, **self.storage_options)
            size = fs.du(path) if fs.isdir(path) else fs.size(path)
        except Exception:  # noqa: BLE001 (not readable from here: the configured bound)
            return self.cfg.request_timeout_s
        waiting = self.generate_timeout_s(max_new_tokens) if self._watch.generating() else 0.0
        return min(self.cfg.request_timeout_s, CONTROL_TIMEOUT_S + size / PUSH_MIN_BYTES_PER_S + waiting)

    async def _get(self, path: str, timeout: float = CONTROL_TIMEOUT_S) -> Any:
        return await self._call("GET", path, None, timeout)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None, timeout: float) -> Any:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} for {self.url} is closed")
        url = f"{self.url}{path}"
        watched = path.split("?", 1)[0]
        status, data = await self._on_io(self._watch.track(watched, self._transport.request(method, url, body, timeout)))
        if status >= 400:
            raise EngineHTTPError(url, status, error_message(data))
        try:
            return json.loads(data)
        except ValueError:
            return None
