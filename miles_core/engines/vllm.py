"""``VLLMEngine``: the ``RolloutEngine`` as a client of a vLLM server; ``LocalVLLMServer`` launches one.

The mapping (vLLM 0.32; endpoints read in its source, ``vllm/entrypoints``):
- ``generate``: one ``POST /v1/completions`` per request (vLLM batches across requests), ``prompt``
  the token ids, ``logprobs = 0`` (the sampled token's only), ``return_token_ids`` and
  ``return_tokens_as_token_ids`` (ids, not text, both ways), ``include_stop_str_in_output`` (the
  protocol keeps a matched stop string), every sampling field sent (a server started with
  ``--generation-config auto`` would fill missing ones from the model's ``generation_config.json``).
  ``choices[0].token_ids`` and ``choices[0].logprobs.token_logprobs`` pair up; ``finish_reason``
  is ``stop`` | ``length`` | ``abort`` (``repetition``, a stop of vLLM's own, reads as ``stop``).
  The logprobs are ``log_softmax(logits / temperature)`` when the server runs with
  ``--logprobs-mode processed_logprobs`` (the launcher's) and no top-p/top-k truncation; with
  truncation vLLM renormalises over the kept tokens (the trainer's recompute does not).
- ``update_weights(uri, version)``: ``POST /pause?mode=keep`` (running requests freeze where they
  are), ``POST /collective_rpc`` with ``reload_weights(weights_path=<snapshot folder>)`` (every
  worker reloads its model's weights in place from the folder's safetensors), ``POST
  /reset_prefix_cache`` (cached prefixes were computed by the old weights), ``POST
  /update_weight_version``, ``POST /resume``. vLLM has no ``update_weights_from_disk``: its RL
  endpoints (``/update_weights``) take weights over NCCL or IPC, not from a folder. These need
  ``VLLM_SERVER_DEV_MODE=1``.
- ``load_adapter(name, uri, version)``: ``POST /v1/load_lora_adapter`` with ``load_inplace`` (a
  new version replaces the old under the same name; each version is another folder, so cached
  prefixes of the old one are never reused); requests name the adapter as their ``model``.
- ``pause`` / ``resume``: ``/pause?mode=keep`` / ``/resume``; ``abort``: ``/abort_requests`` with no
  ids (every request ends with ``abort`` and its tokens so far); ``health``: ``GET /health``.

A result's ``weight_version`` is the version loaded when its request was sent (vLLM does not
report one per completion): a request that straddles an update is counted as the older version,
so staleness is never under-stated. Base-model and adapter requests share batches: an earlier
note of this project saw wrong outputs when they did; with the launcher's settings (float32,
``--enforce-eager``) the integration test co-batches both and their logprobs match PEFT's.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import tempfile
import threading
import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_core import processes
from miles_core.engines.base import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from miles_core.engines.http import EngineHTTPError, HTTPEngine, Transport
from miles_core.storage.fs import copy_to_disk

if TYPE_CHECKING:
    from miles_core.config import VLLMEngineConfig

SERVED_NAME = "policy"
"""The name a launched server serves the run's model under (requests without an adapter use it)."""
DEFAULT_PYTHON = ".cache/vllm-env/bin/python"
CONTROL_PATHS = ("/pause", "/collective_rpc", "/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                 "/resume")


class VLLMEngine(HTTPEngine):
    """A ``RolloutEngine`` that talks to a vLLM server at ``url``. ``model``: the served name of the
    base model (None: the first of ``GET /v1/models`` without a parent). ``server``: a
    ``LocalVLLMServer`` this engine owns and stops on ``close()``. ``seed``: seeds requests without
    one (deterministically, in the order they are submitted; None: vLLM's own generator).
    ``model_dir``: the served model's folder, which weight snapshots are checked against before a
    reload (default: the launched server's; None with a server at a URL: not checked). Weights and adapters on remote storage
    (``s3://...``, read with ``storage_options``) are copied to this machine's disk first when the
    server runs here (launched, or at a loopback URL); a remote server must read them itself."""

    name = "vllm"

    def __init__(self, url: str, cfg: VLLMEngineConfig, server: LocalVLLMServer | None = None,
                 transport: Transport | None = None, model: str | None = None, model_dir: str | None = None,
                 storage_options: dict[str, Any] | None = None, seed: int | None = None) -> None:
        super().__init__(url, cfg, server, transport, exempt=CONTROL_PATHS)
        self._seeds = None if seed is None else random.Random(seed)
        """Seeds of requests that carry none, drawn in the order they are submitted: vLLM's own
        generator serves concurrent requests in arrival order, which differs from run to run."""
        self.storage_options = dict(storage_options or {})
        self._adapter_copies: dict[str, list[str]] = {}
        """Adapter name -> the folders we copied for it (its loaded version's, and any of a load
        that got no answer): removed when its next version loads."""
        self._leftovers: list[str] = []
        """Scratch folders of weight reloads that got no answer, removed once one succeeds."""
        self._model = model
        self.model_dir = model_dir if model_dir is not None else getattr(server, "model_dir", None)
        self._paused = False

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Results for ``requests`` in request order (one completion request each, concurrently)."""
        if not requests:
            return []
        model = await self._base_model()
        seeds = [self._seeds.getrandbits(63) if req.sampling.seed is None and self._seeds else None for req in requests]
        return list(await asyncio.gather(*(self._generate_one(req, model, seed) for req, seed in zip(requests, seeds))))

    async def _generate_one(self, req: GenerateRequest, model: str, seed: int | None) -> GenerateResult:
        version = self._version if req.adapter is None else self._adapter_versions.get(req.adapter, 0)
        body = completion_body(req, model if req.adapter is None else req.adapter)
        if seed is not None:
            body["seed"] = seed
        url = f"{self.url}/v1/completions"
        self.longest_tokens = max(self.longest_tokens, req.sampling.max_new_tokens)
        reply = await self._post("/v1/completions", body, timeout=self.generate_timeout_s(req.sampling.max_new_tokens))
        return parse_completion(reply, req.rid, version, url)

    async def update_weights(self, uri: str, version: int) -> None:
        """Reload the weights from the snapshot ``uri`` (a folder of safetensors, or one file) and
        report ``version`` from then on (running requests freeze meanwhile, and continue under the
        new weights). With a launched server, the snapshot's tensors are checked against the served
        model's first: vLLM reloads in place, tensor by tensor, and would keep the old values of
        missing ones. What is made on the way for a server on this machine (a copy of remote
        weights, a staging folder), all in one scratch folder, is removed once the server has
        answered: vLLM reads it during the call only. After a call with no answer (a timeout, a
        cancellation) the server may still be reading it, so it stays until a reload succeeds (the
        server runs them one at a time), or the engine closes."""
        scratch = tempfile.mkdtemp(prefix="miles-vllm-weights-") if self._server_here() else None
        mine = [scratch] if scratch else []
        reloaded = refused = False
        try:
            path = await asyncio.to_thread(self._snapshot_folder, uri, scratch)
            paused_here = not self._paused
            if paused_here:
                await self._post("/pause?mode=keep")
            try:
                await self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}},
                                 timeout=await asyncio.to_thread(self.push_timeout_s, uri, self.longest_tokens))
                reloaded = True
                await self._post("/reset_prefix_cache")
                await self._post("/update_weight_version", {"new_version": str(version)})
                self._version = version
            finally:
                if paused_here:
                    await self._post("/resume")
        except EngineHTTPError:
            refused = not reloaded  # the server answered no: it is not reading this folder
            raise
        finally:
            if refused:
                _remove(mine)
            else:
                self._leftovers += mine
            if reloaded:  # the server is done with this folder, and with those of earlier calls
                _remove(self._leftovers)
                self._leftovers.clear()

    def _snapshot_folder(self, uri: str, scratch: str | None) -> str:
        """The folder vLLM reloads ``uri`` from: the snapshot folder itself, or a staging folder (in
        ``scratch``) of links to its files when it is one file (vLLM reads folders) or when the
        served model ties ``lm_head`` to the embeddings and the snapshot leaves ``lm_head.weight``
        out: vLLM 0.32's in-place reload then keeps the old ``lm_head`` (measured: logprobs off by
        0.44 on the tiny model), so the staging folder adds it, a copy of the new embeddings. A run's
        own snapshots are folders with ``lm_head.weight``, so a server elsewhere (no ``scratch``) never
        needs one."""
        path = self._local(uri, scratch)
        given = check_snapshot(uri, path, self.model_dir) if self.model_dir is not None else None
        add_head = given is not None and "lm_head.weight" not in given and _ties_embeddings(self.model_dir)
        if not os.path.isfile(path) and not add_head:
            return path
        if scratch is None:
            raise ValueError(f"weights {uri}: a vLLM server on another machine reloads a snapshot folder as it "
                             "is; give it a folder of safetensors with every weight (lm_head.weight included)")
        stage = Path(scratch) / "stage"
        stage.mkdir()
        files = [Path(path)] if os.path.isfile(path) else sorted(Path(path).glob("*.safetensors"))
        for f in files:
            (stage / ("model.safetensors" if os.path.isfile(path) else f.name)).symlink_to(f.resolve())
        index = None if os.path.isfile(path) else Path(path) / "model.safetensors.index.json"
        if add_head:
            _write_tied_head(files, stage / "lm_head.safetensors")
        if index is not None and index.exists():  # vLLM reads the files the index names
            import json

            data = json.loads(index.read_text())
            if add_head:
                data.setdefault("weight_map", {})["lm_head.weight"] = "lm_head.safetensors"
            (stage / index.name).write_text(json.dumps(data))
        return str(stage)

    def _server_here(self) -> bool:
        """Whether the server reads this machine's disk (launched here, or at a loopback URL)."""
        from urllib.parse import urlparse

        return self.server is not None or urlparse(self.url).hostname in ("127.0.0.1", "localhost", "::1")

    def _local(self, uri: str, scratch: str | None) -> str:
        """A path on this machine for ``uri``: itself when local; for remote storage, a copy of its
        file or folder in ``scratch`` (given when the server runs here, and so reads this disk)."""
        if scratch is None or not _remote(uri):
            return local_path(uri)  # raises for remote storage: a server elsewhere reads its own disk
        return copy_to_disk(uri, os.path.join(scratch, "copy"), self.storage_options)

    async def load_adapter(self, name: str, uri: str, version: int = 0) -> None:
        """Load (or replace) adapter ``name`` from the PEFT folder ``uri``. A copy of a remote
        folder stays while that version may be loaded (vLLM reloads an evicted adapter from its
        path): until the next version of ``name`` loads, or a launched server stops."""
        scratch = tempfile.mkdtemp(prefix="miles-vllm-adapter-") if _remote(uri) and self._server_here() else None
        mine = [scratch] if scratch else []
        try:
            path = await asyncio.to_thread(self._local, uri, scratch)
            body = {"lora_name": name, "lora_path": path, "load_inplace": name in self._adapter_versions}
            await self._post("/v1/load_lora_adapter", body, timeout=self.cfg.request_timeout_s)
        except EngineHTTPError:
            _remove(mine)  # refused: the server does not use it
            raise
        except BaseException:
            self._adapter_copies.setdefault(name, []).extend(mine)  # it may have loaded all the same
            raise
        self._adapter_versions[name] = version
        _remove(self._adapter_copies.pop(name, []))
        self._adapter_copies[name] = mine

    async def unload_adapter(self, name: str) -> bool:
        """``/v1/unload_lora_adapter``: adapter ``name`` leaves the server (the caller makes sure no
        request still asks for it). False when this client never loaded it."""
        if name not in self._adapter_versions:
            return False
        await self._post("/v1/unload_lora_adapter", {"lora_name": name})
        self._adapter_versions.pop(name)
        _remove(self._adapter_copies.pop(name, []))
        return True

    async def prompt_logprobs(self, prompt_ids: list[int], adapter: str | None = None) -> list[float]:
        """log p(token t | tokens before it) for each prompt token, NaN for the first, under the
        base or the loaded adapter ``adapter``: a one-token completion with ``prompt_logprobs=0``
        (at temperature 1, so processed logprobs are the model's own)."""
        body = {"model": adapter or await self._base_model(), "prompt": list(prompt_ids), "max_tokens": 1,
                "temperature": 1.0, "seed": 0, "prompt_logprobs": 0, "stream": False}
        reply = await self._post("/v1/completions", body, timeout=self.generate_timeout_s(1))
        return parse_prompt_logprobs(reply, list(prompt_ids), f"{self.url}/v1/completions")

    async def close(self) -> None:
        """Close the client (and stop a launched server). Copies of weights are removed; copies of
        adapters too when this engine launched the server (a server of your own may still serve
        them, so they stay in the temporary folder)."""
        try:
            await super().close()
        finally:
            _remove(self._leftovers)
            self._leftovers.clear()
            if self.server is not None:
                _remove([folder for copies in self._adapter_copies.values() for folder in copies])
                self._adapter_copies.clear()

    async def pause(self) -> None:
        await self._post("/pause?mode=keep")
        self._paused = True

    async def resume(self) -> None:
        await self._post("/resume")
        self._paused = False

    async def abort(self) -> None:
        """Every running and queued request ends with finish reason ``abort`` and its tokens so far."""
        await self._post("/abort_requests", {"request_ids": []})

    async def _base_model(self) -> str:
        if self._model is None:
            reply = await self._get("/v1/models")
            names = [m.get("id") for m in (reply or {}).get("data", []) if not m.get("parent")]
            if not names:
                raise EngineHTTPError(f"{self.url}/v1/models", 200, f"no base model served: {reply!r}")
            self._model = names[0]
        return self._model


# ------------------------------------------------------------------------------ JSON mapping


def completion_body(req: GenerateRequest, model: str) -> dict[str, Any]:
    """The ``/v1/completions`` body of one request."""
    p: SamplingParams = req.sampling
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(req.prompt_ids),
        "max_tokens": p.max_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "n": 1,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "include_stop_str_in_output": True,
        "skip_special_tokens": True,
        "stream": False,
        "request_id": f"{req.rid or 'req'}-{uuid.uuid4().hex[:12]}",
    }
    if p.stop:
        body["stop"] = list(p.stop)
    if p.stop_token_ids:
        body["stop_token_ids"] = list(p.stop_token_ids)
    if p.seed is not None:
        body["seed"] = p.seed
    return body


def parse_completion(reply: Any, rid: str | None, version: int, where: str) -> GenerateResult:
    """A ``/v1/completions`` reply (one choice) as a ``GenerateResult``."""
    try:
        choice = reply["choices"][0]
        output_ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        if len(logprobs) != len(output_ids):
            raise ValueError(f"{len(output_ids)} token ids but {len(logprobs)} logprobs")
        finish = finish_reason(choice.get("finish_reason"))
        text = choice.get("text") or ""
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise EngineHTTPError(where, 200, f"unexpected reply for request {rid!r}: {e!r} in {str(reply)[:300]}") from e
    return GenerateResult(output_ids, text, logprobs, finish, version, rid)


def parse_prompt_logprobs(reply: Any, prompt_ids: list[int], where: str) -> list[float]:
    """``choices[0].prompt_logprobs`` of a ``/v1/completions`` reply (None, then one dict per prompt
    token: its id, as a string, -> ``{"logprob", ...}``) as floats, NaN for the first token."""
    try:
        entries = reply["choices"][0]["prompt_logprobs"]
        if len(entries) != len(prompt_ids):
            raise ValueError(f"{len(entries)} prompt logprobs for {len(prompt_ids)} prompt tokens")
        out = [float("nan")]
        for token, entry in zip(prompt_ids[1:], entries[1:]):
            out.append(float(entry[str(token)]["logprob"]))
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise EngineHTTPError(where, 200, f"unexpected prompt logprobs: {e!r} in {str(reply)[:300]}") from e
    return out


def finish_reason(reason: Any) -> FinishReason:
    if reason in ("stop", "length", "abort"):
        return reason
    if reason == "repetition":  # vLLM's repetition detection ends a response as a stop condition does
        return "stop"
    raise ValueError(f"finish_reason {reason!r} is not one of stop, length, abort")


def check_snapshot(uri: str, path: str, model_dir: str) -> dict[str, list[int]]:
    """The snapshot's tensor shapes; raises (naming ``uri`` and the tensor) unless the snapshot at
    ``path`` holds exactly the served model's tensors with their shapes (``lm_head.weight`` may be
    left out, or added where the model ties it to the embeddings). Reads safetensors headers only."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"weights {uri}: no such file or folder")
    given = _tensor_shapes(path)
    served = _tensor_shapes(model_dir)
    optional = {"lm_head.weight"}
    extra = sorted(set(given) - set(served) - optional)
    missing = sorted(set(served) - set(given) - optional)
    wrong = sorted(k for k in set(given) & set(served) if given[k] != served[k])
    if not (extra or missing or wrong):
        return given
    parts = ([f"not weights of the served model: {', '.join(extra[:5])}"] if extra else []) + \
            ([f"missing: {', '.join(missing[:5])}"] if missing else []) + \
            ([f"other shapes: {', '.join(f'{k} {given[k]} (served {served[k]})' for k in wrong[:5])}"] if wrong else [])
    raise ValueError(f"weights {uri} do not fit the served model {model_dir}: {'; '.join(parts)}")


def _ties_embeddings(model_dir: str) -> bool:
    import json

    try:
        return bool(json.loads((Path(model_dir) / "config.json").read_text()).get("tie_word_embeddings"))
    except (OSError, ValueError):
        return False


def _write_tied_head(files: list[Path], out: Path) -> None:
    """``lm_head.weight`` = the snapshot's ``model.embed_tokens.weight``, in a file of its own."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            if "model.embed_tokens.weight" in st.keys():
                save_file({"lm_head.weight": st.get_tensor("model.embed_tokens.weight").contiguous()}, str(out))
                return
    raise ValueError(f"{files[0].parent}: no model.embed_tokens.weight to tie lm_head.weight to")


def _tensor_shapes(path: str) -> dict[str, list[int]]:
    """Tensor name -> shape of a safetensors file, or of every ``*.safetensors`` in a folder (a file
    that is not one, or is cut short, is refused here, before the server reads it)."""
    from miles_core.storage.weights import SafetensorsFile

    files = [Path(path)] if os.path.isfile(path) else sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors file there")
    shapes: dict[str, list[int]] = {}
    for f in files:
        shapes.update({k: e["shape"] for k, e in SafetensorsFile(str(f)).entries.items()})
    return shapes


def _remove(folders: list[str]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def _remote(uri: str) -> bool:
    """Whether ``uri`` is on remote storage (``s3://...``), not a local path or ``file://`` URL."""
    return "://" in uri and not uri.startswith("file://")


def local_path(uri: str) -> str:
    """The folder path a vLLM server reads for ``uri`` (a local path or ``file://`` URL)."""
    if uri.startswith("file://"):
        return uri[len("file://"):]
    if _remote(uri):
        raise ValueError(f"{uri}: a vLLM server loads weights from a folder on its own disk; keep the run's "
                         "weights on a filesystem the server reads (storage.root), or serve them there")
    return uri


# ------------------------------------------------------------------------------------ launcher


class LocalVLLMServer:
    """``vllm.entrypoints.openai.api_server`` over ``model_dir``, started from ``cfg.python`` on a free
    port of ``host`` under ``watchdog.py`` (its process group goes down with this process, even
    killed), its output in ``log_path``. ``lora``: start it with LoRA enabled.

    ``with LocalVLLMServer(model_dir, cfg) as server: VLLMEngine(server.url, cfg, model=SERVED_NAME)``."""

    def __init__(self, model_dir: str, cfg: VLLMEngineConfig, dtype: str = "float32", seed: int = 0,
                 lora: bool = False, log_path: str | None = None, host: str = "127.0.0.1") -> None:
        self.model_dir, self.cfg, self.dtype, self.seed, self.lora, self.host = str(model_dir), cfg, dtype, seed, lora, host
        self.python = cfg.python or str(Path.cwd() / DEFAULT_PYTHON)
        self.log_path = log_path or str(Path.cwd() / ".cache" / "vllm-logs" / f"vllm-{os.getpid()}-{uuid.uuid4().hex[:6]}.log")
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cores = self.cfg.cpu_affinity
        cmd = [self.python, str(Path(__file__).with_name("watchdog.py")), "--parent-pid", str(os.getpid()),
               "--log", self.log_path]
        if cores:
            cmd += ["--cpu-affinity", ",".join(map(str, cores))]
        cmd += ["--", self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                "--tokenizer", self.model_dir, "--served-model-name", SERVED_NAME, "--host", self.host,
                "--port", str(self.port), "--dtype", self.dtype, "--seed", str(self.seed), "--enforce-eager",
                "--max-num-seqs", str(self.cfg.max_num_seqs),
                "--max-num-batched-tokens", str(self.cfg.max_num_batched_tokens), "--generation-config", "vllm",
                "--logprobs-mode", "processed_logprobs", "--disable-uvicorn-access-log"]
        if self.cfg.max_model_len is not None:
            cmd += ["--max-model-len", str(self.cfg.max_model_len)]
        if self.lora:
            cmd += ["--enable-lora", "--max-lora-rank", str(self.cfg.max_lora_rank), "--max-loras", str(self.cfg.max_loras)]
        return cmd + list(self.cfg.extra_args)

    def environment(self) -> dict[str, str]:
        cores = self.cfg.cpu_affinity
        threads = self.cfg.num_threads or (len(cores) if cores else 1)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update({
            "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc (weight reload), /pause, /resume, /abort_requests
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.cfg.kv_cache_gb),
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)) if cores else "nobind",
            "OMP_NUM_THREADS": str(threads),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        })
        return env

    def start(self) -> LocalVLLMServer:
        """Start the server and wait until ``/health`` answers 200; raises with the end of its log
        if it exits or does not answer within ``cfg.startup_timeout_s``."""
        with self._lock:
            if self.proc is not None:
                raise RuntimeError(f"{self!r} was started already")
            if not Path(self.python).exists():
                raise FileNotFoundError(
                    f"engine.python {self.python} does not exist: build vLLM's environment with "
                    "scripts/setup-vllm.sh (or set engine.python to a Python with vllm installed)")
            self.port = processes.free_port(self.host)
            Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
            self.proc = subprocess.Popen(self.command(), env=self.environment(), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._finalizer = weakref.finalize(self, processes.terminate, self.proc)  # the watchdog takes the server's group down
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Terminate the server's process group (killed 10 s later by the watchdog). Idempotent."""
        with self._lock:
            proc, self.proc = self.proc, None
        if proc is None:
            return
        processes.terminate(proc)
        if self._finalizer is not None:
            self._finalizer.detach()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "".join(Path(self.log_path).read_text(errors="replace").splitlines(keepends=True)[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> LocalVLLMServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalVLLMServer({self.model_dir!r}, port={self.port})"

    def _wait_ready(self) -> None:
        proc = self.proc
        assert proc is not None
        processes.wait_ready(lambda: processes.http_status(f"{self.url}/health", timeout=2) == 200,
                             what=f"vLLM server for {self.model_dir}", probe=f"{self.url}/health",
                             timeout_s=self.cfg.startup_timeout_s, ended=lambda: processes.ended(proc),
                             tail=lambda: f"the end of its log ({self.log_path}):\n{self.log_tail()}",
                             setting="engine.startup_timeout_s", poll_s=0.5)


