"""Sampling for the Tinker service: ``Samplers`` (sampling sessions, the engines, their adapters).

- One ``HFEngine`` per base model, sharing the base's weights with the trainer (one copy in memory).
- A sampling session samples from the base, or from a snapshot of a training client's adapter,
  which the engine loads under a name of its own (``adapter_name``) the first time it is used.
  Named snapshots (``save_weights_for_sampler(name)``) live in the store and never change; unnamed
  ones (``save_weights_and_get_sampling_client``, one per RL step) live in a scratch folder, and
  only the newest ``unnamed_kept`` of each training client are kept: a sampling client older than
  that is refused, saying why.
- At most ``engine_adapters`` snapshots are loaded in an engine at once; the one used least
  recently (and not by a request in flight) leaves first, and comes back from its files if used again.
- ``sample``: ``num_samples`` requests of one prompt (a seed given is the first sample's; sample i
  gets seed + i), each sequence with its tokens (a stop string's tokens included), their
  logprobs, and ``stop`` or ``length``; with ``prompt_logprobs``, the prompt's logprobs too.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles_core.tinker import wire
from miles_core.tinker.futures import Futures, Result

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
UNSUPPORTED = ("topk_prompt_logprobs", "topk_sample_logprobs", "target_prompt_logprobs", "prompt_alt_tokens_k",
               "record_stability_info")
"""Sampling options the service refuses rather than ignores (a client asking for them would get none)."""


class SamplingError(ValueError):
    """A sampling call the service refuses because of what the client sent."""


@dataclass
class Sampler:
    base: str
    adapter: str | None = None
    """The engine's name for the snapshot's adapter (None: the base model)."""
    uri: str | None = None
    model_path: str | None = None
    owner: str | None = None
    """The training client of an unnamed snapshot (its folder is ``uri``, in the scratch folder)."""


def adapter_name(path: str) -> str:
    """The engine's name for a snapshot (PEFT module names may not hold '.' or ':')."""
    return "s" + hashlib.sha1(path.encode()).hexdigest()[:16]


class Samplers:
    """Sampling sessions over one engine per base model (module docstring)."""

    def __init__(self, engines: dict[str, Any], futures: Futures, engine_adapters: int = 16,
                 unnamed_kept: int = 4) -> None:
        self.engines = engines
        self.futures = futures
        self.engine_adapters = engine_adapters
        self.unnamed_kept = unnamed_kept
        self.sessions: dict[str, Sampler] = {}
        self._lock = threading.Lock()  # sessions are added by the training thread, used on the event loop
        self._unnamed: dict[str, collections.deque[str]] = collections.defaultdict(collections.deque)
        self._scratch = tempfile.mkdtemp(prefix="miles-tinker-samplers-")
        self._loads: dict[tuple[str, str], asyncio.Task] = {}
        self._recent: dict[str, collections.OrderedDict[str, None]] = collections.defaultdict(collections.OrderedDict)
        self._in_use: collections.Counter[str] = collections.Counter()
        self._tasks: set[asyncio.Task] = set()

    def close(self) -> None:
        shutil.rmtree(self._scratch, ignore_errors=True)

    # -- sessions

    def add(self, sampler_id: str, sampler: Sampler) -> None:
        with self._lock:
            self.sessions[sampler_id] = sampler

    def add_unnamed(self, owner: str, base: str, write: Callable[[str], None]) -> str:
        """A session on an unnamed snapshot of training client ``owner`` (``write`` puts the adapter's
        files in the folder it is given, in the scratch folder); the oldest of its beyond
        ``unnamed_kept`` go. Returns the session's id."""
        folder = tempfile.mkdtemp(dir=self._scratch)
        write(folder)
        sampler_id = f"{owner}:sample:{uuid.uuid4().hex[:12]}"
        with self._lock:
            self.sessions[sampler_id] = Sampler(base, adapter_name(folder), folder, owner=owner)
            kept = self._unnamed[owner]
            kept.append(sampler_id)
            while len(kept) > self.unnamed_kept:
                old = self.sessions.pop(kept.popleft(), None)
                if old is not None:
                    shutil.rmtree(old.uri, ignore_errors=True)
        return sampler_id

    def open(self, body: dict[str, Any], store: Any, base_of: Callable[[str], str]) -> str:
        """``create_sampling_session``: a session on a snapshot in ``store`` (``model_path``) or on a
        base model (``base_model``, named as ``base_of`` knows it); returns its id."""
        model_path, base_model = body.get("model_path"), body.get("base_model")
        sampler_id = f"{body.get('session_id')}:sample:{body.get('sampling_session_seq_id', uuid.uuid4().hex[:8])}"
        if model_path:
            path = store.resolve(model_path, "sampler_weights")
            meta = store.meta(path)
            if meta["base"] not in self.engines:
                raise SamplingError(f"{model_path} was trained on {meta['base_model']!r}, which is not served here")
            self.add(sampler_id, Sampler(meta["base"], adapter_name(model_path), store.url(*store.checkpoint(path)),
                                         model_path))
        elif base_model:
            self.add(sampler_id, Sampler(base_of(base_model)))
        else:
            raise SamplingError("create_sampling_client needs a model_path or a base_model")
        return sampler_id

    def info(self, sampler_id: str) -> dict[str, Any]:
        sampler = self.get(sampler_id)
        return {"sampler_id": sampler_id, "base_model": sampler.base, "model_path": sampler.model_path}

    def get(self, sampler_id: str) -> Sampler:
        with self._lock:
            sampler = self.sessions.get(sampler_id)
        if sampler is None:
            raise SamplingError(
                f"no sampling session {sampler_id!r} on this service: it restarted since, the id is wrong, or it "
                f"sampled an unnamed snapshot older than the newest {self.unnamed_kept} of its training client "
                "(save_weights_for_sampler(name) keeps one for good)")
        return sampler

    # -- sampling

    def sample(self, body: dict[str, Any]) -> tuple[str, list[str]]:
        """``asample``: the request id of its future and one sequence id per sample (on the event loop)."""
        sampler = self.get(body.get("sampling_session_id"))
        unsupported = [k for k in UNSUPPORTED if body.get(k)]
        if unsupported:
            raise SamplingError(f"sample: {', '.join(unsupported)} are not supported by this service (docs/tinker.md)")
        if (body.get("sampling_params") or {}).get("stop") == []:
            raise SamplingError("sample: stop=[] (no stop at the end-of-sequence token) is not supported by this "
                                "service; leave stop out to stop at EOS, or give stop strings or token ids")
        n = int(body.get("num_samples", 1))
        prompt = prompt_tokens(body.get("prompt") or {})
        request_id = self.futures.new("sample")
        task = asyncio.get_running_loop().create_task(self._sample(request_id, sampler, body, prompt, n))
        self._tasks.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._tasks.discard)
        return request_id, [f"{request_id}:{i}" for i in range(n)]

    async def _sample(self, request_id: str, sampler: Sampler, body: dict[str, Any], prompt: list[int],
                      n: int) -> None:
        from miles_core.engines.base import GenerateRequest

        engine = self.engines[sampler.base]
        params = body.get("sampling_params") or {}
        max_tokens = params.get("max_tokens") or DEFAULT_MAX_TOKENS
        if sampler.adapter is not None:
            self._in_use[sampler.adapter] += 1
        try:
            if sampler.adapter is not None:
                await self._ensure_loaded(engine, sampler)
            requests = [GenerateRequest(prompt, sampling_params(params, max_tokens, i), adapter=sampler.adapter)
                        for i in range(n)]
            sequences = []
            for res in await engine.generate(requests):
                if res.finish_reason == "abort":
                    raise RuntimeError("the engine aborted the generation (it is shutting down)")
                sequences.append((res.output_ids, res.logprobs, "length" if res.finish_reason == "length" else "stop"))
            prompt_lp = None
            if body.get("prompt_logprobs"):
                prompt_lp = await engine.prompt_logprobs(prompt, sampler.adapter)
                last_n = body.get("prompt_logprobs_last_n")
                if last_n is not None:  # the SDK asks for the last n only: the others are "none"
                    keep = max(0, len(prompt_lp) - int(last_n))
                    prompt_lp = [float("nan")] * keep + prompt_lp[keep:]
            self.futures.resolve(request_id, Result(wire.sample_response(sequences, prompt_lp), wire.PROTOBUF))
        except Exception as e:  # noqa: BLE001 - the future carries it
            self.futures.fail(request_id, e, user=isinstance(e, (SamplingError, ValueError)))
        finally:
            if sampler.adapter is not None:
                self._in_use[sampler.adapter] -= 1

    async def _ensure_loaded(self, engine: Any, sampler: Sampler) -> None:
        """Load the snapshot into the engine once (every caller waits for the one load); evict the
        least recently used snapshots beyond ``engine_adapters``."""
        key = (sampler.base, sampler.adapter)
        task = self._loads.get(key)
        if task is None:
            task = asyncio.ensure_future(engine.load_adapter(sampler.adapter, sampler.uri))
            self._loads[key] = task
        try:
            await asyncio.shield(task)
        except Exception:
            if self._loads.get(key) is task:  # the next call tries again
                del self._loads[key]
            raise
        recent = self._recent[sampler.base]
        recent[sampler.adapter] = None
        recent.move_to_end(sampler.adapter)
        for name in list(recent):
            if len(recent) <= self.engine_adapters:
                break
            if self._in_use[name] == 0 and name != sampler.adapter:
                del recent[name]
                self._loads.pop((sampler.base, name), None)
                await engine.unload_adapter(name)


def prompt_tokens(prompt: dict[str, Any]) -> list[int]:
    tokens: list[int] = []
    for chunk in prompt.get("chunks") or []:
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise SamplingError(f"a prompt chunk of type {chunk.get('type')!r}; this service samples from text "
                                "tokens only")
        tokens.extend(int(t) for t in chunk["tokens"])
    if not tokens:
        raise SamplingError("the prompt has no tokens")
    return tokens


def sampling_params(params: dict[str, Any], max_tokens: int, index: int) -> Any:
    """The SDK's ``SamplingParams`` as the engine's: ``stop`` may be strings or token ids."""
    from miles_core.engines.base import SamplingParams

    stop = params.get("stop")
    stop_strings: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()
    if isinstance(stop, str):
        stop_strings = (stop,)
    elif stop:
        stop_strings = tuple(s for s in stop if isinstance(s, str))
        stop_ids = tuple(int(s) for s in stop if not isinstance(s, str))
    seed = params.get("seed")
    return SamplingParams(max_new_tokens=int(max_tokens), temperature=float(params.get("temperature", 1.0)),
                          top_p=float(params.get("top_p", 1.0)), top_k=int(params.get("top_k", -1)),
                          stop=stop_strings, stop_token_ids=stop_ids,
                          seed=None if seed is None else int(seed) + index)
