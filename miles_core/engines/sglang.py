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

The mapping (SGLang 0.5.23: ``tests/unit/test_sglang_types.py`` checks every body against that version's
request types, read from its source): each request's ``SamplingParams`` become one ``sampling_params`` dict
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

HTTP (aiohttp, one I/O loop per engine, the health deadline) is ``miles_core.engines.http``'s.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any

from miles_core.engines.base import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from miles_core.engines.http import (  # noqa: F401 (EngineUnreachable, error_message: imported from here too)
    EngineHTTPError,
    EngineUnreachable,
    HTTPEngine,
    Transport,
    error_message,
)

if TYPE_CHECKING:
    from miles_core.config import SGLangEngineConfig
    from miles_core.engines.server import LocalEngineServer

PAUSE_MODE = "in_place"
"""``/pause_generation`` mode of ``pause()``: hold new requests, keep running ones (no abort)."""
SGLANG_VERSION = "0.5.23"
"""The SGLang release whose request types and response shapes the client is checked against
(``scripts/test.sh`` installs its package alone for that test)."""


def launch_args(model_dir: str, host: str = "127.0.0.1", port: int = 30000, seed: int = 0,
                max_lora_rank: int = 16) -> list[str]:
    """Arguments of ``python -m sglang.launch_server`` for a server this client drives (flags of
    ``SGLANG_VERSION``, checked against its source in tests/unit/test_sglang_types.py): float32 (the
    trainer's recompute is float32, and logprobs are compared with it), a fixed seed, LoRA on for
    adapters by name (any module, rank up to ``max_lora_rank``), 30% of GPU memory (a tiny model
    beside a trainer on the same GPU), CUDA graphs off (small models start in seconds; weights load
    in place either way)."""
    return ["--model-path", model_dir, "--host", host, "--port", str(port), "--dtype", "float32",
            "--random-seed", str(seed), "--mem-fraction-static", "0.3", "--enable-lora",
            "--max-lora-rank", str(max_lora_rank), "--lora-target-modules", "all",
            "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]


CONTROL_PATHS = ("/update_weights_from_disk", "/pause_generation", "/load_lora_adapter", "/unload_lora_adapter")
"""Control calls that may hold the server for a while (not a sign of a dead server)."""


class SGLangEngine(HTTPEngine):
    """A ``RolloutEngine`` that talks to an SGLang server (or router) at ``url``.

    ``server``: a ``LocalEngineServer`` this engine owns and stops on ``close()``. ``transport``:
    how requests travel (default: ``AiohttpTransport``; tests put in a fake)."""

    name = "sglang"

    def __init__(
        self,
        url: str,
        cfg: SGLangEngineConfig,
        server: LocalEngineServer | None = None,
        transport: Transport | None = None,
    ) -> None:
        super().__init__(url, cfg, server, transport, exempt=CONTROL_PATHS)
        self._queued: list[tuple[list[GenerateRequest], asyncio.Future]] = []
        """Calls waiting for the coalescing window to close (on the callers' loop)."""

    # ------------------------------------------------------------------------------ protocol

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
        longest = max(r.sampling.max_new_tokens for r in requests)
        self.longest_tokens = max(self.longest_tokens, longest)
        items = await self._post("/generate", body, timeout=self.generate_timeout_s(longest))
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
        in-flight requests are done (right away when paused) and reports ``version`` from then on.
        Its deadline is sized to the snapshot (``push_timeout_s``), and a call cut off (a server
        frozen and back) is sent again: loading the same version twice is harmless."""
        body = {"model_path": uri, "weight_version": str(version), "flush_cache": True, "abort_all_requests": False}
        timeout = await asyncio.to_thread(self.push_timeout_s, uri, self.longest_tokens)
        reply = await self._post_again_if_cut("/update_weights_from_disk", body, timeout)
        if isinstance(reply, dict) and reply.get("success") is False:  # an error status raised already
            raise EngineHTTPError(f"{self.url}/update_weights_from_disk", 200, str(reply.get("message")))
        self._version = version

    async def load_adapter(self, name: str, uri: str, version: int = 0) -> None:
        """``/load_lora_adapter``: requests with ``adapter=name`` then use it. SGLang has no adapter
        versions, so this client stamps results of ``name`` with ``version`` from then on (a request
        in flight while the adapter is replaced may carry the new version)."""
        reply = await self._post_again_if_cut("/load_lora_adapter", {"lora_name": name, "lora_path": uri},
                                              await asyncio.to_thread(self.push_timeout_s, uri))
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineHTTPError(f"{self.url}/load_lora_adapter", 200, str(reply.get("error_message")))
        self._adapter_versions[name] = version

    async def unload_adapter(self, name: str) -> bool:
        """``/unload_lora_adapter``: adapter ``name`` leaves the server (the caller makes sure no
        request still asks for it). False when this client never loaded it."""
        if name not in self._adapter_versions:
            return False
        reply = await self._post("/unload_lora_adapter", {"lora_name": name})
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineHTTPError(f"{self.url}/unload_lora_adapter", 200, str(reply.get("error_message")))
        self._adapter_versions.pop(name)
        return True

    async def prompt_logprobs(self, prompt_ids: list[int], adapter: str | None = None) -> list[float]:
        """log p(token t | tokens before it) for each prompt token, NaN for the first, under the
        base or the loaded adapter ``adapter``: ``/generate`` of one token with ``logprob_start_len`` 0."""
        body: dict[str, Any] = {"input_ids": list(prompt_ids), "return_logprob": True, "logprob_start_len": 0,
                                "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}, "stream": False}
        if adapter is not None:
            body["lora_path"] = adapter
        item = await self._post("/generate", body, timeout=self.generate_timeout_s(1))
        try:
            triples = item["meta_info"]["input_token_logprobs"]
            if len(triples) != len(prompt_ids):
                raise ValueError(f"{len(triples)} prompt logprobs for {len(prompt_ids)} prompt tokens")
            return [float("nan")] + [float(t[0]) for t in triples[1:]]
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise EngineHTTPError(f"{self.url}/generate", 200, f"unexpected prompt logprobs: {e!r} in "
                                  f"{str(item)[:300]}") from e

    async def pause(self) -> None:
        await self._post("/pause_generation", {"mode": PAUSE_MODE})

    async def resume(self) -> None:
        await self._post("/continue_generation", {})

    async def abort(self) -> None:
        """``/abort_request`` with ``abort_all``: every in-flight and queued request ends with
        finish reason ``abort`` and the tokens it has so far."""
        await self._post("/abort_request", {"abort_all": True})


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
