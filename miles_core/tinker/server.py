"""The Tinker API over HTTP: ``build_app(service, api_key)`` and ``miles tinker-serve``.

The official ``tinker`` SDK (the version pinned in ``pyproject.toml``) talks to this unmodified:
``tinker.ServiceClient(base_url=..., api_key=...)``. Endpoints are the SDK's (``/api/v1/...``); the
request and response shapes are its types, and ``forward_backward`` requests and the results of
``forward_backward`` and ``sample`` are its protobuf messages (``wire.py``). Calls that return a
future answer ``{"request_id", "model_id"}`` at once; ``retrieve_future`` then long-polls for the
result (``Futures``).

Errors: a missing or wrong API key is 401 (the SDK raises ``AuthenticationError``); a bad
synchronous request is 400 with ``{"error": ...}`` (``BadRequestError``); a failed call's future is
``{"error", "category"}`` (``RequestFailedError``); an unknown future, one the service forgot or
lost in a restart, is such an error too, saying so.

The module imports no torch, SDK or web framework until a server is built or started. The API key
never appears in logs: the server prints where it listens and which key *file* or
environment variable it took the key from.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import secrets
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

    from miles_core.tinker.service import TinkerService

log = logging.getLogger(__name__)

API_KEY_ENV = "MILES_TINKER_API_KEY"
READY_PREFIX = "tinker service ready on "

CLIENT_CONFIG = {
    # plain httpx (the SDK's default transport, pyqwest, is not needed for a local service), one
    # request per forward_backward (so calls arrive in order), no compression
    "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False, "proto_compress_fwdbwd": False,
    "pjwt_auth_enabled": False, "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


def build_app(service: TinkerService, api_key: str) -> Starlette:
    from starlette.applications import Starlette
    from starlette.routing import Route

    h = _Handlers(service)
    post = [("client/config", h.client_config), ("client/dynamic_config", h.dynamic_config),
            ("create_session", h.create_session), ("session_heartbeat", h.heartbeat), ("telemetry", h.telemetry),
            ("create_model", h.create_model), ("get_info", h.get_info), ("forward_backward", h.forward_backward),
            ("optim_step", h.optim_step), ("save_weights", h.save_weights),
            ("save_weights_for_sampler", h.save_weights_for_sampler), ("load_weights", h.load_weights),
            ("create_sampling_session", h.create_sampling_session), ("asample", h.asample),
            ("retrieve_future", h.retrieve_future), ("sessions/{session_id}/finish", h.finish_session),
            ("unload_model", h.unload_model)]
    get = [("samplers/{sampler_id}", h.get_sampler), ("get_server_capabilities", h.capabilities),
           ("healthz", h.health), ("training_runs/{run_id}", h.training_run), ("miles/stats", h.stats)]
    routes = [Route(f"/api/v1/{p}", _guarded(fn, api_key), methods=["POST"]) for p, fn in post]
    routes += [Route(f"/api/v1/{p}", _guarded(fn, api_key), methods=["GET"]) for p, fn in get]

    async def lifespan(app):
        await service.start()
        try:
            yield
        finally:
            await service.close()

    return Starlette(routes=routes, lifespan=lifespan)


def _guarded(handler, api_key: str):
    from miles_core.tinker.sampling import SamplingError
    from miles_core.tinker.service import UserError

    async def endpoint(request: Request) -> Response:
        given = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            return _json({"error": "wrong or missing API key (X-API-Key): use the key this service was started "
                                   "with", "category": "user"}, 401)
        try:
            return await handler(request)
        except (UserError, SamplingError) as e:
            return _json({"error": str(e), "category": "user"}, 400)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            return _json({"error": f"bad request to {request.url.path}: {type(e).__name__}: {e}",
                          "category": "user"}, 400)

    return endpoint


def _json(content: Any, status: int = 200) -> Response:
    from starlette.responses import Response

    return Response(json.dumps(content), status_code=status, media_type="application/json")


def _future(request_id: str, model_id: str | None = None, **extra: Any) -> Response:
    return _json({"request_id": request_id, "model_id": model_id, **extra})


class _Handlers:
    def __init__(self, service: TinkerService) -> None:
        self.s = service

    async def client_config(self, request: Request) -> Response:
        return _json(CLIENT_CONFIG)

    async def dynamic_config(self, request: Request) -> Response:
        return _json({})

    async def create_session(self, request: Request) -> Response:
        session_id = await asyncio.to_thread(self.s.store.sessions.create, await request.json())
        return _json({"session_id": session_id, "type": "create_session"})

    async def heartbeat(self, request: Request) -> Response:
        body = await request.json()
        if not await asyncio.to_thread(self.s.store.sessions.heartbeat, body.get("session_id")):
            return _json({"error": f"unknown session {body.get('session_id')!r}"}, 404)
        return _json({"type": "session_heartbeat"})

    async def telemetry(self, request: Request) -> Response:
        return _json({"status": "accepted"})

    async def create_model(self, request: Request) -> Response:
        body = await request.json()
        request_id = await asyncio.to_thread(self.s.create_model, body)
        return _future(request_id, f"{body.get('session_id')}:train:{body.get('model_seq_id', 0)}")

    async def get_info(self, request: Request) -> Response:
        return _json(self.s.info((await request.json())["model_id"]))

    async def forward_backward(self, request: Request) -> Response:
        from miles_core.tinker import wire
        from miles_core.tinker.service import UserError

        try:
            call = wire.parse_forward_backward(await request.body(), request.headers.get("content-encoding"))
        except wire.WireError as e:
            raise UserError(str(e)) from None
        return _future(self.s.submit("forward_backward", call.model_id, call.seq_id, call), call.model_id)

    async def _training_call(self, request: Request, kind: str) -> Response:
        body = await request.json()
        return _future(self.s.submit(kind, body["model_id"], body.get("seq_id"), body), body["model_id"])

    async def optim_step(self, request: Request) -> Response:
        return await self._training_call(request, "optim_step")

    async def save_weights(self, request: Request) -> Response:
        return await self._training_call(request, "save_weights")

    async def save_weights_for_sampler(self, request: Request) -> Response:
        return await self._training_call(request, "save_weights_for_sampler")

    async def load_weights(self, request: Request) -> Response:
        body = await request.json()
        if body.get("model_id"):
            return _future(self.s.submit("load_weights", body["model_id"], body.get("seq_id"), body), body["model_id"])
        request_id = await asyncio.to_thread(self.s.create_model, body)  # create-via-load
        return _future(request_id, f"{body.get('session_id')}:train:{body.get('model_seq_id', 0)}")

    async def unload_model(self, request: Request) -> Response:
        return await self._training_call(request, "unload_model")

    async def create_sampling_session(self, request: Request) -> Response:
        sampler_id = await asyncio.to_thread(self.s.create_sampler, await request.json())
        return _json({"sampling_session_id": sampler_id, "type": "create_sampling_session"})

    async def get_sampler(self, request: Request) -> Response:
        return _json(self.s.sampler_info(request.path_params["sampler_id"]))

    async def asample(self, request: Request) -> Response:
        request_id, sequence_ids = self.s.sampling.sample(await request.json())
        return _future(request_id, None, sample_sequence_ids=sequence_ids)

    async def retrieve_future(self, request: Request) -> Response:
        from starlette.responses import Response

        request_id = (await request.json())["request_id"]
        try:
            result = await self.s.futures.wait(request_id)
        except KeyError:
            return _json({"error": f"request {request_id} is unknown to this service: its result was lost when the "
                                   "service restarted, or was kept longer than an hour; call again",
                          "category": "server"})
        if result is None:
            return _json({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        return Response(result.body, media_type=result.content_type)

    async def finish_session(self, request: Request) -> Response:
        body = await request.json()
        reason = (body.get("reason") or {}).get("type", "success")
        await asyncio.to_thread(self.s.finish_session, request.path_params["session_id"], reason)
        return _json({})

    async def capabilities(self, request: Request) -> Response:
        return _json({"supported_models": [{"model_name": name, "trainable": True, "sampleable": True}
                                           for name in sorted(self.s.bases)]})

    async def health(self, request: Request) -> Response:
        return _json({"status": "ok"})

    async def stats(self, request: Request) -> Response:
        """This service's own (not the SDK's): what ran, for tests and benchmarks."""
        import dataclasses

        return _json({"fused_sizes": self.s.fused_sizes, "training_clients": len(self.s.clients),
                      "pending": self.s.futures.pending(),
                      "engines": {base: dataclasses.asdict(e.stats) for base, e in self.s.engines.items()
                                  if dataclasses.is_dataclass(getattr(e, "stats", None))}})

    async def training_run(self, request: Request) -> Response:
        return _json({"error": "training runs are not listed by this service"}, 404)


# ------------------------------------------------------------------------------------------ command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-model", action="append", required=True, metavar="NAME_OR_FOLDER",
                   help="a model to serve LoRA training clients on: a built-in name (tiny-addition, "
                        "smollm2-135m-instruct) or a Hugging Face folder; repeat for several")
    p.add_argument("--storage", default="runs", help="storage root for sessions and checkpoints (a folder or "
                   "s3://bucket/prefix; default: ./runs)")
    p.add_argument("--storage-options", type=json.loads, default=None, metavar="JSON",
                   help="fsspec storage options for --storage, as JSON (e.g. an S3 endpoint); keep credentials in "
                        "the usual AWS environment variables, not here")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--api-key-file", help="a file holding the API key (it must start with 'tml-'); default: "
                   f"${API_KEY_ENV}, or a new key written to <storage>/tinker/api_key")
    p.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha of every adapter (default 32)")
    p.add_argument("--tokens-per-pass", type=int, default=512,
                   help="tokens computed in one forward pass of forward_backward (default 512: on a CPU, larger "
                        "passes take more memory and no less time; raise it on a GPU)")
    p.add_argument("--engine", choices=["hf", "vllm", "sglang"], default="hf",
                   help="what samples: hf (transformers in this process, sharing the trainer's base weights; "
                        "default), vllm (a vLLM server launched over the base model from vLLM's environment, "
                        "scripts/setup-vllm.sh, or one at url=...), sglang (an SGLang server at url=..., or the "
                        "transformers stand-in launched beside this process)")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a field of the engine's config (docs/config.md: [engine]), e.g. url=http://host:8000, "
                        "cpu_affinity=[1], python=/path/to/vllm-env/bin/python; repeat for several")
    p.add_argument("--prefect", action=argparse.BooleanOptionalAction, default=None,
                   help="show each training client as a Prefect flow run (default: on when a Prefect API is set, "
                        "PREFECT_API_URL or `miles server start`)")


def resolve_api_key(args: argparse.Namespace) -> tuple[str, str]:
    """The key and where it came from (for the log: never the key itself)."""
    if args.api_key_file:
        with open(args.api_key_file) as f:
            key, source = f.read().strip(), f"the file {args.api_key_file}"
    elif os.environ.get(API_KEY_ENV):
        key, source = os.environ[API_KEY_ENV].strip(), f"${API_KEY_ENV}"
    else:
        path = os.path.join(args.storage, "tinker", "api_key")
        if "://" in args.storage:
            raise SystemExit(f"give --api-key-file or ${API_KEY_ENV} with a remote --storage ({args.storage})")
        if os.path.exists(path):
            with open(path) as f:
                key = f.read().strip()
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            key = f"tml-{secrets.token_urlsafe(24)}"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(key + "\n")
        source = f"the file {path} (readable by you only)"
    if not key.startswith("tml-"):
        raise SystemExit(f"the API key from {source} must start with 'tml-' (the tinker SDK refuses other keys)")
    return key, source


def engine_config(kind: str, options: list[str]) -> Any:
    """The ``EngineConfig`` of ``--engine kind`` and its ``--engine-option KEY=VALUE`` fields (a
    VALUE is read as JSON when it is JSON, else as a string)."""
    from pydantic import TypeAdapter, ValidationError

    from miles_core.config import EngineConfig

    fields: dict[str, Any] = {"type": kind}
    if kind == "vllm":  # the SDK's default rank is 32; vLLM's server takes up to its --max-lora-rank
        fields["max_lora_rank"] = 64
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-option {option!r}: give KEY=VALUE, e.g. url=http://127.0.0.1:8000")
        try:
            fields[key] = json.loads(value)
        except json.JSONDecodeError:
            fields[key] = value
    try:
        return TypeAdapter(EngineConfig).validate_python(fields)
    except ValidationError as e:
        raise SystemExit(f"--engine {kind} with {options}: {e}") from None


def prefect_api_set() -> bool:
    from prefect.settings import PREFECT_API_URL

    return bool(PREFECT_API_URL.value())


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from miles_core.config import ModelConfig
    from miles_core.models import ensure_model
    from miles_core.tinker.service import TinkerService

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    key, source = resolve_api_key(args)
    engine = engine_config(getattr(args, "engine", "hf"), getattr(args, "engine_option", []))
    bases = {name: str(ensure_model(ModelConfig(path=name), log=lambda m: print(m, file=sys.stderr)))
             for name in args.base_model}
    runs = None
    if args.prefect or (args.prefect is None and prefect_api_set()):
        from miles_core.tinker.runs import ClientRuns

        runs = ClientRuns()
    service = TinkerService(args.storage, bases, storage_options=args.storage_options, lora_alpha=args.lora_alpha,
                            runs=runs, engine=engine, tokens_per_pass=args.tokens_per_pass)
    app = build_app(service, key)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                await task
                return
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port
        shown = "each training client is a Prefect flow run" if runs else "not shown in Prefect (no API set)"
        print(f"{READY_PREFIX}http://{args.host}:{port} (base models: {', '.join(bases)}; sampling on "
              f"{engine.type}; API key from {source}; "
              f"{shown}; TINKER_BASE_URL=http://{args.host}:{port})", flush=True)
        await task

    asyncio.run(main())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="miles tinker-serve", description="serve the Tinker API over this project's "
                                "trainer and engines")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
