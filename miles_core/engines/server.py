"""An SGLang-compatible HTTP server in front of ``HFEngine``: the CPU stand-in for an SGLang server.

Parts:
- ``build_app(engine, model_path)``: a Starlette app serving one ``HFEngine`` under SGLang's
  endpoints and JSON shapes (the subset below), so ``SGLangEngine`` and any SGLang client talk to it
  as to a real server.
- ``serve(...)`` / ``main(argv)``: the server process (``miles engine-serve``, or
  ``python -m miles_core.engines.server``): pins itself to ``cpu_affinity``, loads the model, serves
  with uvicorn and prints one line ``ready on http://HOST:PORT`` once it accepts connections.
- ``LocalEngineServer``: starts that process on a free port, waits for ``/health``, stops it
  (a context manager; ``SGLangEngine.close()`` stops the one ``setup_engine`` launched).

Endpoints (SGLang 0.5.x shapes):
- ``POST /generate``: ``input_ids`` (one prompt or a batch), ``sampling_params`` (one dict or one
  per prompt: ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``,
  ``stop_token_ids``, ``sampling_seed``, ``no_stop_trim``; the penalties, ``n``, ``ignore_eos`` and
  ``min_new_tokens`` only at their neutral values), ``return_logprob``, ``logprob_start_len`` (-1),
  ``return_text_in_logprobs``, ``rid``, ``lora_path``. Each result: ``text``, ``output_ids``,
  ``meta_info`` {``id``, ``finish_reason`` (``{"type": "stop", "matched": token id | string}``,
  ``{"type": "length", "length": n}``, ``{"type": "abort", "message"}``), ``prompt_tokens``,
  ``completion_tokens``, ``cached_tokens``, ``weight_version``, ``output_token_logprobs``
  (``[logprob, token_id, text | null]``), and with ``logprob_start_len`` 0 ``input_token_logprobs``
  (the first one's logprob null)}. A client that disconnects cancels its request.
- ``POST /update_weights_from_disk`` {``model_path`` (any fsspec URL of a safetensors file or
  folder; read with the server's own storage options), ``weight_version``, ``abort_all_requests``}:
  loads once the running batch is done; ``{"success", "message", "num_paused_requests"}``, 400 on failure.
- ``POST /pause_generation`` {``mode``: ``abort`` (default) | ``in_place`` | ``retract``},
  ``POST /continue_generation``, ``POST /abort_request`` {``abort_all``}, ``POST /load_lora_adapter``
  {``lora_name``, ``lora_path``} (a PEFT adapter folder; ``lora_path`` in ``/generate`` then names
  the adapter a request uses), ``POST /unload_lora_adapter`` {``lora_name``}, ``POST /flush_cache`` (no cache: a no-op),
  ``GET /health``, ``/health_generate``, ``/get_model_info``, ``/get_weight_version``.
- ``GET /stats`` (this server's own, not SGLang's): the engine's ``EngineStats`` as a JSON object
  (requests received, first tokens sampled, dispatches, ...), so a client can follow its progress.

Where it differs from SGLang: no continuous batching (a request that arrives while a batch runs
waits for the next one, as in ``HFEngine``); ``in_place`` and ``retract`` pauses let the running
batch finish, and return when it has, instead of freezing it; abort by ``rid`` is refused (only
``abort_all``); ``text`` prompts, streaming and prompt logprobs from a later token
(``logprob_start_len`` > 0) are refused with 400; weight versions
are integers (reported as strings, ``"0"`` at start where SGLang says ``"default"``); ``/health``
does not run a generation.

The module imports no torch or web framework until a server is built or started.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from miles_core import processes

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

    from miles_core.config import SGLangEngineConfig
    from miles_core.engines.base import GenerateRequest, GenerateResult, SamplingParams
    from miles_core.engines.hf import HFEngine

log = logging.getLogger(__name__)

STORAGE_OPTIONS_ENV = "MILES_ENGINE_STORAGE_OPTIONS"
"""Environment variable with the server's fsspec storage options as JSON (``LocalEngineServer``
passes the run's there, not on the command line, where other users' ``ps`` would see credentials)."""
READY_PREFIX = "ready on "
_SGLANG_MAX_NEW_TOKENS = 128
"""SGLang's default ``max_new_tokens``."""
_SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "sampling_seed",
                  "no_stop_trim"}
_NEUTRAL_SAMPLING = {"n": 1, "ignore_eos": False, "min_new_tokens": 0, "frequency_penalty": 0.0,
                     "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0, "skip_special_tokens": True,
                     "spaces_between_special_tokens": True, "stream_interval": None, "logit_bias": None}
"""Sampling params accepted only at these values (the transformers engine has no such features)."""
_REFUSED_REQUEST = {"text": None, "input_embeds": None, "stream": False, "top_logprobs_num": 0,
                    "token_ids_logprob": None, "return_hidden_states": False, "session_params": None}
"""``/generate`` fields accepted only absent, null or at these values."""


class BadRequest(ValueError):
    """A request this server refuses (HTTP 400)."""


# ------------------------------------------------------------------------------------- app


def build_app(engine: HFEngine, model_path: str) -> Starlette:
    """The Starlette app serving ``engine``; ``model_path`` is what ``/get_model_info`` reports."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    h = _Handlers(engine, model_path)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await engine.close()

    endpoints = [
        ("/generate", h.generate, ["POST", "PUT"]),
        ("/update_weights_from_disk", h.update_weights_from_disk, ["POST"]),
        ("/pause_generation", h.pause_generation, ["POST"]),
        ("/continue_generation", h.continue_generation, ["POST"]),
        ("/abort_request", h.abort_request, ["POST"]),
        ("/load_lora_adapter", h.load_lora_adapter, ["POST"]),
        ("/unload_lora_adapter", h.unload_lora_adapter, ["POST"]),
        ("/flush_cache", h.flush_cache, ["GET", "POST"]),
        ("/health", h.health, ["GET"]),
        ("/health_generate", h.health, ["GET"]),
        ("/get_model_info", h.get_model_info, ["GET"]),
        ("/get_weight_version", h.get_weight_version, ["GET"]),
        ("/stats", h.stats, ["GET"]),
    ]
    routes = [Route(path, _refusing_bad_requests(fn), methods=methods) for path, fn, methods in endpoints]
    return Starlette(routes=routes, lifespan=lifespan)


def _refusing_bad_requests(handler):
    """``handler`` answering 400 with the reason when it raises ``BadRequest``."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except BadRequest as e:
            return _error(400, str(e))

    return endpoint


class _Handlers:
    def __init__(self, engine: HFEngine, model_path: str) -> None:
        self.engine = engine
        self.model_path = model_path

    async def generate(self, request: Request) -> Response:
        batch, reqs, options = parse_generate(await _json_body(request))
        work = asyncio.ensure_future(self.engine.generate(reqs))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():  # the client went away: its rows leave the running batch
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            return _json({"error": {"message": "client disconnected"}}, 499)
        try:
            results = work.result()
            for req, opt in zip(reqs, options):
                if opt["prompt_logprobs"]:
                    opt["prompt_logprobs"] = await self.engine.prompt_logprobs(req.prompt_ids, req.adapter)
        except ValueError as e:
            return _error(400, str(e))
        except Exception as e:
            log.exception("generate failed")
            return _error(500, f"{type(e).__name__}: {e}")
        items = [self._item(req, res, opt) for req, res, opt in zip(reqs, results, options)]
        return _json(items if batch else items[0])

    def _item(self, req: GenerateRequest, res: GenerateResult, opt: dict[str, Any]) -> dict[str, Any]:
        reason = _finish_reason(req.sampling, res)
        text = res.text
        if reason["type"] == "stop" and not opt["no_stop_trim"]:  # SGLang trims what matched from the text
            matched = reason["matched"]
            if isinstance(matched, str):
                text = text[: text.find(matched)]
            elif res.output_ids:
                text = self.engine.tokenizer.decode(res.output_ids[:-1], skip_special_tokens=True)
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": reason,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(res.output_ids),
            "cached_tokens": 0,
            "weight_version": str(res.weight_version),
        }
        if opt["return_logprob"]:
            tok = self.engine.tokenizer
            ids = res.output_ids
            texts = [tok.decode([t]) for t in ids] if opt["text_in_logprobs"] else [None] * len(ids)
            meta["output_token_logprobs"] = [[lp, t, s] for lp, t, s in zip(res.logprobs, res.output_ids, texts)]
        if opt["prompt_logprobs"]:  # SGLang: the first prompt token's logprob is null
            meta["input_token_logprobs"] = [[None if k == 0 else lp, t, None]
                                            for k, (lp, t) in enumerate(zip(opt["prompt_logprobs"], req.prompt_ids))]
        return {"text": text, "output_ids": res.output_ids, "meta_info": meta}

    async def update_weights_from_disk(self, request: Request) -> Response:
        body = await _json_body(request, default={})
        try:
            path = body.get("model_path")
            if not path:
                raise BadRequest("model_path is required")
            if body.get("load_format") not in (None, "auto", "safetensors"):
                raise BadRequest(f"load_format {body['load_format']!r}: this server reads safetensors only")
            version = self.engine.weight_version
            if body.get("weight_version") is not None:
                version = _int_version(body["weight_version"])
            if body.get("abort_all_requests"):
                await self.engine.abort()
            await self.engine.update_weights(path, version)
        except Exception as e:  # a bad path or snapshot: SGLang answers 400 with the reason
            return _json({"success": False, "message": f"{type(e).__name__}: {e}", "num_paused_requests": 0}, 400)
        message = f"Succeeded to update model weights. Weight version updated to {version}."
        return _json({"success": True, "message": message, "num_paused_requests": 0})

    async def pause_generation(self, request: Request) -> Response:
        body = await _json_body(request, default={})
        mode = body.get("mode") or "abort"
        if mode not in ("abort", "in_place", "retract"):
            return _error(400, f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place'].")
        pausing = asyncio.ensure_future(self.engine.pause())
        await asyncio.sleep(0)  # pause() closes the gate before it waits for the running batch
        if mode == "abort":
            await self.engine.abort()
        await pausing
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: Request) -> Response:
        await self.engine.resume()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: Request) -> Response:
        body = await _json_body(request, default={})
        if body.get("abort_all"):
            await self.engine.abort()
        elif body.get("rid"):
            return _error(400, "abort by rid is not supported by this server: use abort_all")
        return _json({})

    async def load_lora_adapter(self, request: Request) -> Response:
        body = await _json_body(request, default={})
        try:
            await self.engine.load_adapter(body.get("lora_name"), body.get("lora_path"))
        except Exception as e:
            return _json({"success": False, "error_message": f"{type(e).__name__}: {e}", "loaded_adapters": {}}, 400)
        loaded = {name: name for name in getattr(self.engine, "adapters", [])}
        return _json({"success": True, "error_message": "", "loaded_adapters": loaded})

    async def unload_lora_adapter(self, request: Request) -> Response:
        body = await _json_body(request, default={})
        name = body.get("lora_name")
        if name not in getattr(self.engine, "adapters", []):
            return _json({"success": False, "error_message": f"adapter {name!r} is not loaded", "loaded_adapters": {}},
                         400)
        unloaded = await self.engine.unload_adapter(name)
        loaded = {name: name for name in getattr(self.engine, "adapters", [])}
        message = "" if unloaded else f"adapter {name!r} is the only one loaded: it stays (PEFT keeps one)"
        return _json({"success": unloaded, "error_message": message, "loaded_adapters": loaded}, 200 if unloaded else 400)

    async def flush_cache(self, request: Request) -> Response:
        from starlette.responses import PlainTextResponse

        return PlainTextResponse("Cache flushed.\n")

    async def health(self, request: Request) -> Response:
        from starlette.responses import Response

        return Response(status_code=200 if await self.engine.health() else 503)

    async def get_model_info(self, request: Request) -> Response:
        return _json({"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                      "weight_version": str(self.engine.weight_version)})

    async def get_weight_version(self, request: Request) -> Response:
        return _json({"weight_version": str(self.engine.weight_version)})

    async def stats(self, request: Request) -> Response:
        return _json(dataclasses.asdict(self.engine.stats))


# --------------------------------------------------------------------------- request parsing


def parse_generate(body: Any) -> tuple[bool, list[GenerateRequest], list[dict[str, Any]]]:
    """A ``/generate`` body as (whether it is a batch, the engine requests, per-request output
    options). Raises ``BadRequest`` naming what this server does not do."""
    from miles_core.engines.base import GenerateRequest

    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object with input_ids")
    for key, neutral in _REFUSED_REQUEST.items():
        if body.get(key) not in (None, neutral):
            raise BadRequest(f"{key}={body[key]!r} is not supported by this server (input_ids only, no streaming)")
    ids = body.get("input_ids")
    batch = isinstance(ids, list) and bool(ids) and all(isinstance(x, list) for x in ids)
    prompts = ids if batch else [ids]
    if not all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompts):
        raise BadRequest("input_ids must be a list of token ids or a list of such lists")
    n = len(prompts)
    sampling = _per_item(body.get("sampling_params"), n, "sampling_params", {})
    rid = body.get("rid")
    if isinstance(rid, str) and batch:  # SGLang: one string for a batch is a prefix
        rid = [f"{rid}_{k}" for k in range(n)]
    rids = _per_item(rid, n, "rid", None)
    adapters = _per_item(body.get("lora_path"), n, "lora_path", None)
    return_logprob = _per_item(body.get("return_logprob"), n, "return_logprob", False)
    starts = _per_item(body.get("logprob_start_len"), n, "logprob_start_len", -1)
    for start in starts:
        if start not in (None, -1, 0):
            raise BadRequest(f"logprob_start_len={start}: prompt logprobs are from the first token only (0), or "
                             "none (-1)")
    reqs, options = [], []
    for k in range(n):
        rid = rids[k] if rids[k] is not None else f"{time.monotonic_ns():x}-{k}"
        params, no_stop_trim = sampling_params(sampling[k] or {})
        reqs.append(GenerateRequest(prompts[k], params, rid=rid, adapter=adapters[k]))
        options.append({"no_stop_trim": no_stop_trim, "return_logprob": bool(return_logprob[k]),
                        "text_in_logprobs": bool(body.get("return_text_in_logprobs")),
                        "prompt_logprobs": bool(return_logprob[k]) and starts[k] == 0})
    return batch, reqs, options


def sampling_params(d: dict[str, Any]) -> tuple[SamplingParams, bool]:
    """SGLang ``sampling_params`` as ours, and ``no_stop_trim``."""
    from miles_core.engines.base import SamplingParams

    if not isinstance(d, dict):
        raise BadRequest(f"sampling_params must be an object, got {d!r}")
    unknown = sorted(set(d) - _SAMPLING_KEYS - set(_NEUTRAL_SAMPLING))
    if unknown:
        raise BadRequest(f"unsupported sampling params: {', '.join(unknown)}")
    for key, neutral in _NEUTRAL_SAMPLING.items():
        if key in d and d[key] is not None and d[key] != neutral:
            raise BadRequest(f"sampling param {key}={d[key]!r} is not supported by this server (only {neutral!r})")
    get = lambda key, default: default if d.get(key) is None else d[key]  # noqa: E731 (SGLang: null = default)
    try:
        stop = get("stop", ())
        temperature = float(get("temperature", 1.0))
        params = SamplingParams(
            max_new_tokens=int(get("max_new_tokens", _SGLANG_MAX_NEW_TOKENS)),
            temperature=0.0 if 0 <= temperature < 1e-6 else temperature,  # SGLang's greedy threshold
            top_p=float(get("top_p", 1.0)),
            top_k=int(get("top_k", -1)),
            stop=(stop,) if isinstance(stop, str) else tuple(str(x) for x in stop),
            stop_token_ids=tuple(int(t) for t in get("stop_token_ids", ())),
            seed=None if d.get("sampling_seed") is None else int(d["sampling_seed"]),
        )
    except (TypeError, ValueError) as e:
        raise BadRequest(f"bad sampling_params {d!r}: {e}") from None
    return params, bool(get("no_stop_trim", False))


def _per_item(value: Any, n: int, name: str, default: Any) -> list[Any]:
    """One value per prompt: a list of n, or one value for all."""
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} items for {n} prompts")
        return value
    return [default if value is None else value] * n


def _finish_reason(p: SamplingParams, res: GenerateResult) -> dict[str, Any]:
    if res.finish_reason == "length":
        return {"type": "length", "length": p.max_new_tokens}
    if res.finish_reason == "abort":
        return {"type": "abort", "message": "Abort request."}
    last = res.output_ids[-1] if res.output_ids else None
    if last is not None and last not in p.stop_token_ids:
        matched = next((s for s in p.stop if s in res.text), None)
        if matched is not None:
            return {"type": "stop", "matched": matched}
    return {"type": "stop", "matched": last}  # a stop token or EOS


def _int_version(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise BadRequest(f"weight_version {value!r}: this server's weight versions are integers") from None


async def _json_body(request: Request, default: Any = None) -> Any:
    """The JSON object of the body (``default`` when there is none)."""
    raw = await request.body()
    if not raw:
        return default
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise BadRequest(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    return body


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next ASGI message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _json(content: Any, status: int = 200) -> Response:
    from starlette.responses import Response

    return Response(json.dumps(content, separators=(",", ":")), status_code=status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    return _json({"error": {"message": message}}, status)


# ----------------------------------------------------------------------------- the process


def serve(
    model_dir: str,
    host: str = "127.0.0.1",
    port: int = 0,
    num_threads: int | None = None,
    cpu_affinity: list[int] | None = None,
    max_batch_size: int = 256,
    dtype: str = "float32",
    seed: int = 0,
    storage_options: dict[str, Any] | None = None,
    parent_pid: int | None = None,
) -> None:
    """Serve ``model_dir`` until SIGINT / SIGTERM (or until ``parent_pid`` ends). ``port`` 0 picks
    a free port; the ``ready on http://HOST:PORT`` line on stdout says which."""
    if cpu_affinity:
        os.sched_setaffinity(0, cpu_affinity)  # before torch starts its thread pool
        num_threads = num_threads or len(cpu_affinity)
    from miles_core.config import HFEngineConfig
    from miles_core.engines.hf import HFEngine

    cfg = HFEngineConfig(max_batch_size=max_batch_size, num_threads=num_threads)
    engine = HFEngine(model_dir, cfg, dtype=dtype, seed=seed, storage_options=storage_options)
    asyncio.run(_serve(build_app(engine, model_dir), host, port, parent_pid))


async def _serve(app: Starlette, host: str, port: int, parent_pid: int | None) -> None:
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5, lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        if task.done():
            await task  # startup failed: uvicorn has logged why
            raise SystemExit(f"engine server did not start on {host}:{port}")
        await asyncio.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    print(f"{READY_PREFIX}http://{host}:{bound}", flush=True)
    while not task.done():
        if parent_pid is not None and processes.orphaned(parent_pid):  # nobody will stop us
            server.should_exit = True
        await asyncio.wait([task], timeout=0.5)
    await task


def parse_cpu_list(text: str) -> list[int]:
    """``"1"``, ``"0,2"`` or ``"0-3,6"`` as a list of core numbers."""
    cores: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise argparse.ArgumentTypeError(f"bad CPU list {text!r}: use e.g. 1 or 0,2 or 0-3")
        first, last = int(match[1]), int(match[2] or match[1])
        cores += range(first, last + 1)
    if not cores:
        raise argparse.ArgumentTypeError(f"bad CPU list {text!r}: no cores")
    return cores


def build_parser(prog: str = "miles engine-serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve a model folder under SGLang's HTTP API "
                                "(the transformers engine on CPU).")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", required=True, help="Hugging Face model folder to serve")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port to listen on; 0 picks a free one (default 30000)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: one per --cpu-affinity core)")
    p.add_argument("--cpu-affinity", type=parse_cpu_list, default=None, metavar="CPUS",
                   help="pin the process to these cores, e.g. 1 or 0-3")
    p.add_argument("--max-batch-size", type=int, default=256, help="sequences decoded together (default 256)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter dtype")
    p.add_argument("--seed", type=int, default=0, help="seed of requests without a sampling_seed")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer the parent")


def run(args: argparse.Namespace) -> int:
    """Serve as the parsed flags say; storage options come from ``$MILES_ENGINE_STORAGE_OPTIONS``."""
    options = json.loads(os.environ.get(STORAGE_OPTIONS_ENV) or "{}")
    serve(args.model_dir, args.host, args.port, args.num_threads, args.cpu_affinity, args.max_batch_size,
          args.dtype, args.seed, options, args.parent_pid)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m miles_core.engines.server``: the same flags as ``miles engine-serve``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local model folder; never reach for a hub
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return run(build_parser(prog="python -m miles_core.engines.server").parse_args(argv))


# ----------------------------------------------------------------------- LocalEngineServer


class LocalEngineServer:
    """``miles engine-serve`` over ``model_dir`` in a child process, on a free port of ``host``.

    ``with LocalEngineServer(model_dir, cfg) as server: SGLangEngine(server.url, cfg)`` (or
    ``start()`` / ``stop()``). ``cfg`` gives threads, CPU affinity, batch size and the startup
    timeout; ``storage_options`` reach the child through its environment. The child exits with
    this process."""

    def __init__(
        self,
        model_dir: str,
        cfg: SGLangEngineConfig,
        dtype: str = "float32",
        seed: int = 0,
        storage_options: dict[str, Any] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.model_dir = str(model_dir)
        self.cfg = cfg
        self.dtype = dtype
        self.seed = seed
        self.storage_options = dict(storage_options or {})
        self.host = host
        self.url: str | None = None
        self.proc: subprocess.Popen[str] | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=200)
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None
        self._finalizer: weakref.finalize | None = None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "miles_core.engines.server", "--model-dir", self.model_dir,
               "--host", self.host, "--port", "0", "--max-batch-size", str(self.cfg.max_batch_size),
               "--dtype", self.dtype, "--seed", str(self.seed), "--parent-pid", str(os.getpid())]
        if self.cfg.num_threads is not None:
            cmd += ["--num-threads", str(self.cfg.num_threads)]
        if self.cfg.cpu_affinity:
            cmd += ["--cpu-affinity", ",".join(map(str, self.cfg.cpu_affinity))]
        return cmd

    def start(self) -> LocalEngineServer:
        """Start the server and wait until ``/health`` answers 200; raises with the server's last
        output if it exits or does not answer within ``cfg.startup_timeout_s``."""
        if self.proc is not None:
            raise RuntimeError(f"{self!r} was started already")
        env = processes.package_env()
        if self.storage_options:
            env[STORAGE_OPTIONS_ENV] = json.dumps(self.storage_options)
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, bufsize=1, env=env)
        self._finalizer = weakref.finalize(self, _kill, self.proc)
        self._reader = threading.Thread(target=self._read_output, name="engine-server-output", daemon=True)
        self._reader.start()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Abort what the server runs, then terminate it (kill after 10 s). Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None and self.url is not None:  # in-flight requests end now, not at the kill
            processes.http_status(f"{self.url}/abort_request", {"abort_all": True}, timeout=2)
        processes.terminate(proc, 10)
        if self._reader is not None:
            self._reader.join(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()
        if self._finalizer is not None:
            self._finalizer.detach()

    def output(self) -> str:
        """The server's last lines of output."""
        return "".join(self._tail)

    def __enter__(self) -> LocalEngineServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalEngineServer({self.model_dir!r}, url={self.url!r})"

    def _read_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._tail.append(line)
            if line.startswith(READY_PREFIX) and not self._ready.is_set():
                self.url = line[len(READY_PREFIX):].strip()
                self._ready.set()
            else:
                log.debug("engine server: %s", line.rstrip())

    def _wait_ready(self) -> None:
        """Until it has printed its address (``READY_PREFIX``) and answers ``/health`` there."""
        proc = self.proc
        assert proc is not None and self._reader is not None

        def ready() -> bool:
            return self._ready.wait(0.05) and processes.http_status(f"{self.url}/health", timeout=5) == 200

        def tail() -> str:
            if proc.poll() is not None:
                self._reader.join(timeout=2)  # the whole of what it printed before it ended
            return f"its last output:\n{self.output()}"

        processes.wait_ready(ready, what=f"engine server for {self.model_dir}", probe="/health at the address it prints",
                             timeout_s=self.cfg.startup_timeout_s, ended=lambda: processes.ended(proc), tail=tail,
                             setting="engine.startup_timeout_s", poll_s=0.05)


def _kill(proc: subprocess.Popen[str]) -> None:
    """Last resort when a ``LocalEngineServer`` is dropped or the interpreter exits unstopped."""
    if proc.poll() is None:
        proc.kill()


if __name__ == "__main__":
    sys.exit(main())
