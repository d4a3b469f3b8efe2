"""The Tinker service's state and work: ``TinkerService`` (the HTTP layer is ``server.py``).

- Sessions (``create_session``, heartbeats) and training clients (``create_model``: a LoRA adapter on
  a served base, ``TinkerTrainer``), each kept in the store (``TinkerStore``) as it is made.
- Training calls (``forward_backward``, ``optim_step``, ``save_weights``,
  ``save_weights_for_sampler``, ``load_weights``) run on one training thread in each client's
  ``seq_id`` order (``CallQueue``). Each round takes the next call of every client that has one
  ready; their ``forward_backward`` calls run together (one forward pass, one backward pass:
  ``TinkerTrainer``).
- Sampling runs on the server's event loop (``Samplers``: one engine per base model, snapshots as
  named adapters). The engine is the in-process transformers one by default, sharing the trainer's
  base weights; or a vLLM server (launched over the base model's folder, or one at a URL) or an
  SGLang server (``engine``: an ``EngineConfig``), which loads the snapshots by name.
- Results are futures (``Futures``); failures are answered as the SDK's ``RequestFailedError``
  (category ``user`` for bad input, ``server`` otherwise), with a message naming what failed.
- After a restart (kill -9 included) the store still holds every session, training client and
  checkpoint; a client's adapter is not in memory until ``load_state`` loads one of its states.
  Until then its calls fail naming its last saved state and the calls after it that were lost.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from miles_core.tinker import wire
from miles_core.tinker.calls import Call, CallQueue, OrderError
from miles_core.tinker.futures import Futures, Result
from miles_core.tinker.losses import LossError
from miles_core.tinker.runs import ClientRuns
from miles_core.tinker.sampling import Sampler, Samplers, SamplingError, adapter_name
from miles_core.tinker.store import PathError, TinkerPath, TinkerStore, check_name, model_folder
from miles_core.tinker.trainer import TinkerTrainer

log = logging.getLogger(__name__)


class UserError(ValueError):
    """A call the service refuses because of what the client sent (answered with category ``user``)."""


@dataclass
class Client:
    """A training client the service knows: in memory (``live``) or only in the store (after a restart)."""

    info: dict[str, Any]
    live: bool = False
    lost: str | None = None
    """Why its calls fail until a state is loaded (after a restart)."""


class TinkerService:
    """Sessions, training clients, samplers and their calls (module docstring)."""

    def __init__(self, root: str, bases: dict[str, str], storage_options: dict[str, Any] | None = None,
                 lora_alpha: float = 32.0, seq_wait_s: float = 120.0, gather_s: float = 0.02,
                 runs: ClientRuns | None = None, engine: Any = None, tokens_per_pass: int = 512) -> None:
        self.engine_cfg = engine
        """The sampling engines' ``EngineConfig`` (None: transformers in process)."""
        if getattr(engine, "url", None) and len(bases) > 1:
            raise ValueError(f"an engine at a URL ({engine.url}) serves one base model; {len(bases)} were given")
        self.store = TinkerStore(root, storage_options)
        self.storage_options = dict(storage_options or {})
        self.bases = {name: os.path.realpath(folder) for name, folder in bases.items()}
        self.trainer = TinkerTrainer(self.bases, lora_alpha=lora_alpha, tokens_per_pass=tokens_per_pass)
        self.runs = runs
        """Each training client's Prefect flow run (None: not shown in Prefect)."""
        self.queue = CallQueue(self._fail, seq_wait_s, gather_s)
        self.clients: dict[str, Client] = {}
        self.engines: dict[str, Any] = {}
        self.futures: Futures | None = None
        self.sampling: Samplers | None = None
        self._thread: threading.Thread | None = None
        self.fused_sizes: list[int] = []
        """How many clients' ``forward_backward`` calls each training round ran together."""

    # -- life

    async def start(self) -> None:
        """Load the base models, start their engines, restore what the store holds, start the
        training thread."""
        self.futures = Futures(asyncio.get_running_loop())
        self.sampling = Samplers(self.engines, self.futures)
        for base, folder in self.bases.items():
            bank = await asyncio.to_thread(self.trainer.bank, base)
            self.engines[base] = await asyncio.to_thread(self._start_engine, folder, bank.model)
        for info in await asyncio.to_thread(self.store.models):
            client = self.clients[info["model_id"]] = Client(info, lost=self.store.restart_message(info["model_id"]))
            if self.runs is not None and info.get("flow_run_id") and not info.get("ended"):
                self._end(client, "CRASHED", client.lost)
        self._thread = threading.Thread(target=self._train_loop, name="tinker-train", daemon=True)
        self._thread.start()
        log.info("tinker service: bases %s, %d training clients in the store", sorted(self.bases), len(self.clients))

    def _start_engine(self, folder: str, model: Any) -> Any:
        """The sampling engine of a base model: in process over the trainer's base weights (``model``),
        or a server that serves LoRA adapters (launched over ``folder``, or the config's URL)."""
        from miles_core.config import HFEngineConfig
        from miles_core.engines import setup_engine

        cfg = self.engine_cfg or HFEngineConfig()
        engine = setup_engine(cfg, folder, storage_options=self.storage_options, lora=True)
        if isinstance(cfg, HFEngineConfig):
            engine.share_weights(model)
        return engine

    async def close(self) -> None:
        self.queue.close()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        for engine in self.engines.values():
            await engine.close()
        if self.sampling is not None:
            self.sampling.close()
        if self.runs is not None:
            for client in self.clients.values():
                if client.live:
                    self._end(client, "CANCELLED", "the service stopped; the client's saved states are in the store")
            await asyncio.to_thread(self.runs.close)

    def _end(self, client: Client, state: str, message: str) -> None:
        """The client's flow run ends (once; the store remembers that it did)."""
        info = client.info
        if self.runs is None or info.get("ended"):
            return
        self.runs.finished(info["model_id"], state, message, info.get("flow_run_id"))
        info["ended"] = state
        self._save_info(client)

    def finish_session(self, session_id: str, reason: str) -> None:
        """The SDK's ``ServiceClient`` closed (``/sessions/<id>/finish``): its clients' runs end."""
        for client in list(self.clients.values()):
            if client.info["session_id"] == session_id and client.live:
                self._end(client, "COMPLETED", f"the client's session finished ({reason})")
                self.queue.forget(client.info["model_id"])

    # -- training clients

    def base_of(self, name: str) -> str:
        if name in self.bases:
            return name
        for base, folder in self.bases.items():  # a base may be named by its folder (the cookbook's tokenizer)
            if os.path.realpath(name) == folder:
                return base
        raise UserError(f"base model {name!r} is not served here; served: {sorted(self.bases)}")

    def info(self, model_id: str) -> dict[str, Any]:
        client = self._client(model_id)
        info = client.info
        return {"model_id": model_id, "type": "get_info", "is_lora": True, "lora_rank": info["rank"],
                "model_name": info["base_model"],
                "model_data": {"model_name": info["base_model"], "arch": info.get("arch"),
                               "tokenizer_id": self.bases[info["base"]]}}

    def create_model(self, body: dict[str, Any]) -> str:
        """``create_model``, or ``load_weights`` with a session and no model id (create-via-load):
        a new training client; returns the request id of its future."""
        session_id = body.get("session_id")
        if session_id is None or not self.store.sessions.heartbeat(session_id):
            raise UserError(f"unknown session {session_id!r}: create a session first (ServiceClient does)")
        model_id = f"{session_id}:train:{body.get('model_seq_id', 0)}"
        base_model, lora, source = _new_client(body, self.store)
        most = getattr(self.engine_cfg, "max_lora_rank", None)
        if most is not None and lora["rank"] > most:
            raise UserError(f"LoRA rank {lora['rank']} is above the sampling engine's largest, {most}: start the "
                            f"service with --engine-option max_lora_rank={lora['rank']}, or ask for a smaller rank")
        if model_id in self.clients:
            raise UserError(f"training client {model_id} exists already")
        info = {"model_id": model_id, "session_id": session_id, "base_model": base_model,
                "base": self.base_of(base_model), "created": time.time(),
                "user_metadata": body.get("user_metadata") or {}, **lora}
        client = Client(info)
        self.clients[model_id] = client
        request_id = self.futures.new("create_model", model_id)
        self.queue.put(Call("create", model_id, 0, request_id, (source, bool(body.get("optimizer"))) if source else None),
                       ordered=False)
        return request_id

    def submit(self, kind: str, model_id: str, seq_id: int | None, payload: Any) -> str:
        """A training call of ``model_id`` (run in ``seq_id`` order); the request id of its future."""
        client = self._client(model_id)
        request_id = self.futures.new(kind, model_id)
        call = Call(kind, model_id, int(seq_id or 0), request_id, payload)
        if client.lost is not None and kind != "load_weights":
            self._fail(request_id, UserError(f"{client.lost} (this call is seq_id {call.seq_id})"))
            return request_id
        self.queue.put(call, ordered=seq_id is not None)
        return request_id

    def _client(self, model_id: str) -> Client:
        client = self.clients.get(model_id)
        if client is None:
            raise UserError(f"no training client {model_id!r} on this service")
        return client

    # -- the training thread

    def _train_loop(self) -> None:
        while (ready := self.queue.take()) is not None:
            try:
                self._run_round(ready)
            except BaseException as e:  # noqa: BLE001 - a bug here must fail the round's calls, not hang them
                log.exception("tinker: a training round failed")
                for call in ready:  # answered calls keep their answer (a future is set once)
                    self._fail(call.request_id, e)
                    self.queue.done(call)

    def _run_round(self, ready: list[Call]) -> None:
        fused = [c for c in ready if c.kind == "forward_backward"]
        if fused:
            self.fused_sizes.append(len(fused))
            try:
                outs = self.trainer.forward_backward([c.payload for c in fused])
            except Exception as e:  # noqa: BLE001 - each call gets the error
                outs = [e] * len(fused)
                if len(fused) > 1 and isinstance(e, (LossError, wire.WireError, KeyError)):
                    outs = [self._alone(c) for c in fused]  # one client's bad input fails that client only
            for call, out in zip(fused, outs, strict=True):
                if isinstance(out, Exception):
                    self._fail(call.request_id, out)
                else:
                    outputs, metrics = out
                    if self.runs is not None and not call.payload.forward_only:
                        self.runs.forward_backward(call.model_id, metrics["loss:sum"], len(outputs))
                    self.futures.resolve(call.request_id, Result(wire.forward_backward_output(outputs, metrics),
                                                                 wire.PROTOBUF))
                self.queue.done(call)
        for call in ready:
            if call.kind == "forward_backward":
                continue
            try:
                answer = getattr(self, f"_run_{call.kind}")(call)
                self.futures.resolve(call.request_id, Result(json.dumps(answer).encode()))
            except Exception as e:  # noqa: BLE001 - the call's future carries it
                self._fail(call.request_id, e)
            self.queue.done(call)
            if call.kind == "unload_model":
                self.queue.forget(call.model_id)

    def _alone(self, call: Call) -> Any:
        try:
            return self.trainer.forward_backward([call.payload])[0]
        except Exception as e:  # noqa: BLE001
            return e

    def _run_create(self, call: Call) -> dict[str, Any]:
        client = self.clients[call.model_id]
        self._revive(client)
        self._save_info(client)
        client.lost = None
        info = client.info
        if self.runs is not None:
            self.runs.started(call.model_id, info, on_created=lambda run_id: self._note_run(client, run_id))
        if call.payload is not None:  # create-via-load
            source, optimizer = call.payload
            self._load(call.model_id, source, optimizer)
            return {"model_id": call.model_id, "path": str(source), "type": "load_weights"}
        return {"model_id": call.model_id, "type": "create_model"}

    def _revive(self, client: Client) -> None:
        """The client's adapter, new, in the trainer (its state comes from a load, if any)."""
        info = client.info
        self.trainer.create(info["model_id"], info["base"], info["rank"], info["seed"], info["train_attn"],
                            info["train_mlp"], info["train_unembed"])
        client.live = True

    def _save_info(self, client: Client) -> None:
        self.store.write_json(("models", model_folder(client.info["model_id"]), "model.json"), client.info)

    def _note_run(self, client: Client, flow_run_id: str) -> None:
        client.info["flow_run_id"] = flow_run_id
        self._save_info(client)

    def _run_optim_step(self, call: Call) -> dict[str, Any]:
        metrics = self.trainer.optim_step(call.model_id, call.payload.get("adam_params") or {})
        if self.runs is not None:
            self.runs.optim_step(call.model_id, metrics)
        return {"metrics": metrics, "type": "optim_step"}

    def _run_save_weights(self, call: Call) -> dict[str, Any]:
        def write(folder: str) -> None:
            with open(f"{folder}/state.pt", "wb") as f:
                f.write(self.trainer.state_bytes(call.model_id))

        path, _ = self._put_snapshot(call, "weights", call.payload.get("path") or f"step-{call.seq_id}", write,
                                     steps=self.trainer.get(call.model_id).steps)
        return {"path": str(path), "type": "save_weights"}

    def _run_save_weights_for_sampler(self, call: Call) -> dict[str, Any]:
        """A named snapshot goes to the store for good; an unnamed one (``save_weights_and_get_sampling_client``)
        to the sampling scratch folder, with a sampling session on it."""
        base, name = self.clients[call.model_id].info["base"], call.payload.get("path")
        write = lambda folder: self.trainer.save_sampler(call.model_id, folder)  # noqa: E731
        if name is None:
            sampler_id = self.sampling.add_unnamed(call.model_id, base, write)
            return {"path": None, "sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}
        path, uri = self._put_snapshot(call, "sampler_weights", name, write, base=base)
        out: dict[str, Any] = {"path": str(path), "type": "save_weights_for_sampler"}
        if call.payload.get("sampling_session_seq_id") is not None:
            sampler_id = f"{call.model_id}:sample:{uuid.uuid4().hex[:12]}"
            self.sampling.add(sampler_id, Sampler(base, adapter_name(str(path)), uri, str(path)))
            out["sampling_session_id"] = sampler_id
        return out

    def _put_snapshot(self, call: Call, kind: str, name: str, write, **meta: Any) -> tuple[TinkerPath, str]:
        """A snapshot of the client (``write`` fills a folder with it) in the store for good, shown
        on its flow run; its path and URI."""
        path = TinkerPath(call.model_id, kind, check_name(name))
        with tempfile.TemporaryDirectory() as tmp:
            write(tmp)
            uri = self.store.put_folder(path, tmp, {"path": str(path), "seq_id": call.seq_id, "saved_at": time.time(),
                                                    "base_model": self.clients[call.model_id].info["base_model"], **meta})
        if self.runs is not None:
            self.runs.checkpoint(call.model_id, str(path))
        return path, uri

    def _run_load_weights(self, call: Call) -> dict[str, Any]:
        source = self.store.resolve(call.payload["path"], "weights")
        client = self.clients[call.model_id]
        if not client.live:  # after a restart: its adapter comes back first
            self._revive(client)
        self._load(call.model_id, source, bool(call.payload.get("optimizer")))
        client.lost = None
        return {"path": str(source), "type": "load_weights"}

    def _run_unload_model(self, call: Call) -> dict[str, Any]:
        self.trainer.remove(call.model_id)
        self._end(self.clients[call.model_id], "COMPLETED", "unloaded")
        self.clients[call.model_id].live = False
        return {"model_id": call.model_id, "type": "unload_model"}

    def _load(self, model_id: str, source: TinkerPath, optimizer: bool) -> None:
        self.trainer.load_state(model_id, self.store.read_file(source, "state.pt"), optimizer)

    # -- sampling

    def create_sampler(self, body: dict[str, Any]) -> str:
        return self.sampling.open(body, self.store, self.base_of)

    def sampler_info(self, sampler_id: str) -> dict[str, Any]:
        return self.sampling.info(sampler_id)

    # -- results

    def _fail(self, request_id: str, error: BaseException) -> None:
        user = isinstance(error, (UserError, LossError, wire.WireError, PathError, KeyError, FileExistsError,
                                  SamplingError, OrderError))
        self.futures.fail(request_id, error, user)


def _new_client(body: dict[str, Any], store: TinkerStore) -> tuple[str, dict[str, Any], TinkerPath | None]:
    """A new training client's base model, LoRA options and the state it starts from: as asked
    (``create_model``), or those of the client that saved the state (create-via-load)."""
    if body.get("type") != "load_weights":
        cfg = body.get("lora_config") or {}
        return body["base_model"], {"rank": int(cfg.get("rank", 32)), "seed": cfg.get("seed"),
                                    "train_attn": cfg.get("train_attn", True), "train_mlp": cfg.get("train_mlp", True),
                                    "train_unembed": cfg.get("train_unembed", True)}, None
    source = store.resolve(body["path"], "weights")
    info = store.read_json(("models", model_folder(source.model_id), "model.json"))
    if not info:
        raise UserError(f"{body['path']}: no training client {source.model_id} in the store")
    lora = {k: info[k] for k in ("rank", "seed", "train_attn", "train_mlp", "train_unembed")}
    return body.get("base_model") or info["base_model"], lora, source
