"""``SGLangEngine``: the ``RolloutEngine`` as a client of SGLang's HTTP API.

Parts:
- ``SGLangEngine``: ``POST /generate`` with a batch of ``input_ids`` (the server batches
  continuously across requests), ``/update_weights_from_disk``, ``/load_lora_adapter``,
  ``/pause_generation``, ``/continue_generation``, ``/abort_request``, ``/health``. Calls made
  within ``coalesce_window_s`` of each other share one ``/generate`` request: a fully-async
  producer makes one call per sample, and one HTTP request each costs more client CPU (on the
  trainer's machine) than the batch. A cancelled call's requests then run to their end on the
  server (the other calls of the batch are unaffected); with a window of 0, each call is its own
  request and cancelling it disconnects it.
- ``request_body`` / ``parse_result``: the JSON mapping of one call, both ways (pure functions).
- ``Transport`` / ``AiohttpTransport``: how requests travel (tests put a fake one in).
- ``EngineHTTPError``: the server answered with an error status; ``EngineUnreachable``: no answer.

The mapping (SGLang 0.5.x): each request's ``SamplingParams`` become one ``sampling_params`` dict
(``seed`` travels as ``sampling_seed``; ``no_stop_trim`` keeps a matched stop string in the text,
as the protocol wants); ``return_logprob`` with ``logprob_start_len = -1`` asks for output-token
logprobs only, which come back as ``meta_info.output_token_logprobs`` ``[logprob, token_id, text]``
triples; ``meta_info.finish_reason.type`` is ``stop`` | ``length`` | ``abort``; each result's
``meta_info.weight_version`` (a string on the wire: ``"default"`` is the weights the server started
with, version 0) is its weight version. Wire ``rid``s are made unique per request (SGLang refuses
duplicate in-flight ids); results carry the caller's ``rid``.

``pause()`` sends ``mode = "in_place"``: new and queued requests wait; on a real SGLang server the
running ones freeze where they are and continue after ``resume()`` (with whatever weights are loaded
then), rather than finishing first. Errors are not retried here: a failed call raises, naming the
URL and the HTTP status, and the caller (the rollout producer) retries.

HTTP goes through aiohttp (as Miles' own SGLang client does): 256 concurrent requests to a local
server took 1.5-1.8 s with httpx's AsyncClient and 0.02-0.06 s with aiohttp (httpx issue #3215:
its connection pool does not scale with concurrency), and a rollout producer keeps hundreds of
calls in flight. It runs on the engine's own event loop (a ``LoopThread`` started on first use)
with one session: callers may drive one engine from any loop, or several (tests call
``asyncio.run`` repeatedly), while a session and its connections belong to the loop that made
them. A caller's cancelled ``generate`` cancels its request there, and the server sees the
disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from miles_core.engines.base import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from miles_core.loop import LoopThread

if TYPE_CHECKING:
    from miles_core.config import SGLangEngineConfig
    from miles_core.engines.server import LocalEngineServer

PAUSE_MODE = "in_place"
"""``/pause_generation`` mode of ``pause()``: hold new requests, keep running ones (no abort)."""
_CONTROL_TIMEOUT_S = 60.0
"""Timeout of the control endpoints (pause waits for the running batch on the CPU stand-in server,
hence not a few seconds)."""
T = TypeVar("T")
log = logging.getLogger(__name__)


class EngineHTTPError(RuntimeError):
    """The server answered an engine request with an error status."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url} answered HTTP {status}: {message}")
        self.url, self.status, self.message = url, status, message


class EngineUnreachable(ConnectionError):
    """No answer from the server (connection refused or reset, timeout)."""


class Transport(Protocol):
    """Sends one HTTP request and returns (status, body). Raises ``EngineUnreachable`` when no
    answer comes. Used on one event loop only."""

    async def request(
        self, method: str, url: str, body: dict[str, Any] | None, timeout: float
    ) -> tuple[int, bytes]: ...

    async def close(self) -> None: ...


class AiohttpTransport:
    """``Transport`` over one aiohttp session with no connection limit (concurrent calls must not
    queue in the client: the server batches them)."""

    def __init__(self) -> None:
        self._session = None

    async def request(self, method: str, url: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, bytes]:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        try:
            limit = aiohttp.ClientTimeout(total=timeout)
            async with self._session.request(method, url, json=body, timeout=limit) as reply:
                return reply.status, await reply.read()
        except asyncio.TimeoutError as e:
            raise EngineUnreachable(f"{url}: no answer within {timeout:g} s") from e
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
    load: ``EXEMPT``) is pending, the server counts as alive; those calls have their own timeout."""

    EXEMPT = ("/update_weights_from_disk", "/pause_generation", "/load_lora_adapter", "/unload_lora_adapter")

    def __init__(self, url: str, transport: Transport, warn_s: float, timeout_s: float,
                 warn=log.warning, clock=time.monotonic) -> None:
        self.url, self.transport = url, transport
        self.warn_s, self.timeout_s = warn_s, timeout_s
        self.probe_s = max(0.05, min(25.0, timeout_s / 4))
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
            if any(path in self.EXEMPT for path, _ in self._pending.values()):
                self._life, warned_at = self.clock(), None
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


class SGLangEngine:
    """A ``RolloutEngine`` that talks to an SGLang server (or router) at ``url``.

    ``server``: a ``LocalEngineServer`` this engine owns and stops on ``close()``. ``transport``:
    how requests travel (default: ``AiohttpTransport``; tests put in a fake)."""

    def __init__(
        self,
        url: str,
        cfg: SGLangEngineConfig,
        server: LocalEngineServer | None = None,
        transport: Transport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.cfg = cfg
        self.server = server
        self._transport: Transport = transport if transport is not None else AiohttpTransport()
        """Used on ``self._io``'s loop only."""
        self._version = 0
        self._adapter_versions: dict[str, int] = {}
        """Version of the weights last loaded through this engine (0: the server's own)."""
        self._io: LoopThread | None = None
        self._io_lock = threading.Lock()
        self._closed = False
        self._queued: list[tuple[list[GenerateRequest], asyncio.Future]] = []
        """Calls waiting for the coalescing window to close (on the callers' loop)."""
        self._watch = HealthWatch(self.url, self._transport, cfg.health_warn_s, cfg.health_timeout_s)
        """The health deadline of requests to the server (used on ``self._io``'s loop only)."""

    # ------------------------------------------------------------------------------ protocol

    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Results for ``requests`` in request order, from one ``/generate`` request shared with
        the other calls made within ``coalesce_window_s``."""
        requests = list(requests)
        if not requests:
            return []
        if self.cfg.coalesce_window_s <= 0:
            return await self._generate_now(requests)
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._queued.append((requests, waiter))
        if len(self._queued) == 1:  # the first call of a window sends the batch when it closes
            loop.call_later(self.cfg.coalesce_window_s, lambda: asyncio.ensure_future(self._send_queued()))
        return await waiter

    async def _send_queued(self) -> None:
        batch, self._queued = self._queued, []
        live = [(reqs, waiter) for reqs, waiter in batch if not waiter.done()]  # cancelled callers drop out
        if not live:
            return
        try:
            results = await self._generate_now([r for reqs, _ in live for r in reqs])
        except BaseException as e:  # noqa: BLE001 (every caller of the batch gets the error)
            for _, waiter in live:
                if not waiter.done():
                    waiter.set_exception(e)
            return
        start = 0
        for reqs, waiter in live:
            if not waiter.done():
                waiter.set_result(results[start : start + len(reqs)])
            start += len(reqs)

    async def _generate_now(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        body = request_body(requests)
        items = await self._post("/generate", body, timeout=self.cfg.request_timeout_s)
        if not isinstance(items, list) or len(items) != len(requests):
            got = f"{len(items)} results" if isinstance(items, list) else type(items).__name__
            raise EngineHTTPError(f"{self.url}/generate", 200, f"expected {len(requests)} results, got {got}")
        results = [parse_result(item, req.rid, f"{self.url}/generate") for item, req in zip(items, requests)]
        for result, req in zip(results, requests):
            if req.adapter is not None and req.adapter in self._adapter_versions:
                result.weight_version = self._adapter_versions[req.adapter]
        return results

    async def update_weights(self, uri: str, version: int) -> None:
        """``/update_weights_from_disk`` with ``model_path = uri``: the server loads once its
        in-flight requests are done (right away when paused) and reports ``version`` from then on."""
        body = {"model_path": uri, "weight_version": str(version), "flush_cache": True, "abort_all_requests": False}
        reply = await self._post("/update_weights_from_disk", body, timeout=self.cfg.request_timeout_s)
        if isinstance(reply, dict) and reply.get("success") is False:  # an error status raised already
            raise EngineHTTPError(f"{self.url}/update_weights_from_disk", 200, str(reply.get("message")))
        self._version = version

    async def load_adapter(self, name: str, uri: str, version: int = 0) -> None:
        """``/load_lora_adapter``: requests with ``adapter=name`` then use it. SGLang has no adapter
        versions, so this client stamps results of ``name`` with ``version`` from then on (a request
        in flight while the adapter is replaced may carry the new version)."""
        reply = await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": uri})
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineHTTPError(f"{self.url}/load_lora_adapter", 200, str(reply.get("error_message")))
        self._adapter_versions[name] = version

    async def pause(self) -> None:
        await self._post("/pause_generation", {"mode": PAUSE_MODE})

    async def resume(self) -> None:
        await self._post("/continue_generation", {})

    async def abort(self) -> None:
        """``/abort_request`` with ``abort_all``: every in-flight and queued request ends with
        finish reason ``abort`` and the tokens it has so far."""
        await self._post("/abort_request", {"abort_all": True})

    async def health(self) -> bool:
        """Whether ``/health`` answers 200 (False when it answers otherwise or not at all)."""
        if self._closed:
            return False
        try:
            request = self._transport.request("GET", f"{self.url}/health", None, _CONTROL_TIMEOUT_S)
            status, _ = await self._on_io(request)
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

    # ---------------------------------------------------------------------------------- HTTP

    async def _on_io(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` run on the engine's I/O loop (cancelling the wait cancels it there)."""
        with self._io_lock:
            if self._io is None:
                self._io = LoopThread("sglang-engine-io")
                # an engine dropped without close() must not leave its loop thread running
                weakref.finalize(self, _stop_loop, self._io.loop)
            io = self._io
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, io.loop))

    async def _post(self, path: str, body: dict[str, Any], timeout: float = _CONTROL_TIMEOUT_S) -> Any:
        """POST ``body`` as JSON; the decoded JSON reply (None when the reply is not JSON)."""
        if self._closed:
            raise RuntimeError(f"SGLangEngine for {self.url} is closed")
        url = f"{self.url}{path}"
        status, data = await self._on_io(self._watch.track(path, self._transport.request("POST", url, body, timeout)))
        if status >= 400:
            raise EngineHTTPError(url, status, error_message(data))
        try:
            return json.loads(data)
        except ValueError:
            return None


def _stop_loop(loop: asyncio.AbstractEventLoop) -> None:
    if not loop.is_closed():
        loop.call_soon_threadsafe(loop.stop)


# ------------------------------------------------------------------------------ JSON mapping


def sampling_dict(p: SamplingParams) -> dict[str, Any]:
    """SGLang ``sampling_params`` of one request."""
    d: dict[str, Any] = {
        "max_new_tokens": p.max_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "no_stop_trim": True,  # the protocol keeps the stop string in the text
        "skip_special_tokens": True,
    }
    if p.stop:
        d["stop"] = list(p.stop)
    if p.stop_token_ids:
        d["stop_token_ids"] = list(p.stop_token_ids)
    if p.seed is not None:
        d["sampling_seed"] = p.seed
    return d


def request_body(requests: list[GenerateRequest]) -> dict[str, Any]:
    """The ``/generate`` body of a batch (always the batch form, even for one request)."""
    body: dict[str, Any] = {
        "input_ids": [list(req.prompt_ids) for req in requests],
        "sampling_params": [sampling_dict(req.sampling) for req in requests],
        "return_logprob": True,
        "logprob_start_len": -1,
        "rid": [f"{req.rid or 'req'}-{uuid.uuid4().hex[:12]}" for req in requests],
        "stream": False,
    }
    if any(req.adapter is not None for req in requests):
        body["lora_path"] = [req.adapter for req in requests]
    return body


def parse_result(item: Any, rid: str | None, where: str) -> GenerateResult:
    """One ``/generate`` result item as a ``GenerateResult`` (``rid``: the caller's request id).
    Token ids and logprobs come from ``output_token_logprobs``, the one place that pairs them."""
    try:
        meta = item["meta_info"]
        triples = meta["output_token_logprobs"] or []
        output_ids = [int(t[1]) for t in triples]
        logprobs = [float(t[0]) for t in triples]
        finish = finish_reason(meta.get("finish_reason"))
        version = parse_weight_version(meta.get("weight_version"))
        text = item.get("text", "")
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise EngineHTTPError(where, 200, f"unexpected result for request {rid!r}: {e!r} in {str(item)[:300]}") from e
    return GenerateResult(output_ids, text, logprobs, finish, version, rid)


def finish_reason(reason: Any) -> FinishReason:
    """``meta_info.finish_reason`` (``{"type": ..., ...}``) as ``stop`` | ``length`` | ``abort``."""
    kind = reason.get("type") if isinstance(reason, dict) else None
    if kind in ("stop", "length", "abort"):
        return kind
    raise ValueError(f"finish_reason {reason!r} is not one of stop, length, abort")


def parse_weight_version(value: Any) -> int:
    """SGLang's ``weight_version`` string as our integer version (``"default"``, or none: 0)."""
    if value is None or value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"weight_version {value!r} is not an integer version") from None


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
