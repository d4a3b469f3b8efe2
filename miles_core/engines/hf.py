"""In-process transformers rollout engine (the CPU default).

Parts:
- ``HFEngine``: the ``RolloutEngine`` over a Hugging Face causal LM loaded in this process. It
  queues calls, dispatches them to its ``Decoder`` (``hf_decode``: the KV-cached decode loop, so
  each output token's logprob is exactly ``log_softmax(logits / T)`` of the raw logits, raw logits
  when T is 0, the quantity the trainer recomputes) and keeps the weight versions; weights and
  adapters load through ``hf_weights``.
- ``HFEngine.share_weights(model)``: generate with the weight tensors of a model of this process (a
  trainer's, or an adapter bank's base) instead of a copy: a sync run's rollout engine follows its
  trainer's versions, and every engine of a LoRA run shares the frozen base.
- ``HFEngine.stats`` (``EngineStats``): counters of dispatches, decode batches, calls served,
  requests received and first tokens sampled, which tests and logs read to follow the engine.

Concurrency: ``generate`` calls queue up. Whenever the model is free and the engine is not paused,
one dispatcher task takes every queued call and runs all their requests together in a worker
thread (``asyncio.to_thread``, so the event loop keeps running): many concurrent calls of one or
a few requests share batches, as they would on a continuous-batching server, except that a call
arriving mid-batch waits for the next one. Each call resolves as soon as its own rows have
finished (the decode thread settles its future with ``loop.call_soon_threadsafe``), even when
they span several chunks. The running batch holds one ``asyncio.Lock``, so ``update_weights``,
``pause()`` and ``close()`` wait for in-flight generation, and every result carries the weight
version that generated it. ``pause()`` closes a gate the dispatcher waits at (queued calls stay
queued). ``abort()`` settles queued calls at once and sets the ``threading.Event`` of every
running call, which the decode loop checks at each step: that call's rows end with ``abort`` and
leave the batch. A cancelled ``generate`` sets its own call's event the same way; the other calls
sharing its batch are untouched.

LoRA: ``load_adapter(name, uri)`` loads a PEFT adapter folder under a name (or replaces the
adapter of that name); the model becomes a PEFT wrapper of the base and every batch passes one
adapter name per row (``__base__`` for none), so the base and any number of adapters serve
together, unmerged. Base weight updates still load into the base and leave the adapters as they
are. Results of adapter rows carry the version the adapter was loaded as; base rows, the base's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from miles_core.dtypes import torch_dtype
from miles_core.engines import hf_weights
from miles_core.engines.base import GenerateRequest, GenerateResult
from miles_core.engines.hf_decode import BASE_ADAPTER, Call, Decoder, EngineStats, Row, Versions, check_sampling

if TYPE_CHECKING:
    from miles_core.config import HFEngineConfig

__all__ = ["BASE_ADAPTER", "EngineStats", "HFEngine"]


class HFEngine:
    """A transformers causal LM generating in this process.

    ``tokenizer`` is the model folder's tokenizer (flows encode prompts and decode with it).
    ``model_dir`` is a local Hugging Face folder; ``dtype`` is ``float32`` | ``bfloat16``;
    ``seed`` seeds the sampling of requests that carry no seed of their own."""

    def __init__(
        self,
        model_dir: str,
        cfg: HFEngineConfig,
        dtype: str = "float32",
        seed: int = 0,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch_dt = torch_dtype(dtype, "HFEngine")
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        self.storage_options = dict(storage_options or {})
        """fsspec options for reading weight snapshots (e.g. an S3 endpoint); never logged."""
        self.device = torch.device(cfg.device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dt)
        self._base = model.to(self.device).eval()
        self.model = self._base
        """What generates: the base model, or a PEFT wrapper of it once an adapter is loaded."""
        self.stats = EngineStats()
        self._decoder = Decoder(self._base, self.tokenizer, cfg.max_batch_size, seed, self.stats)
        self._version = 0
        self._adapter_versions: dict[str, int] = {}
        self._lock = asyncio.Lock()
        """Held by the running batch and by weight loads."""
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._queue: list[Call] = []
        """Calls waiting for the next dispatch, in arrival order."""
        self._running: set[Call] = set()
        self._dispatcher: asyncio.Task[None] | None = None
        self._closed = False
        self._live_version: Callable[[], int] | None = None
        """Set by ``share_weights`` for weights that change under the engine: the version they are."""
        self._frozen_base = False
        """``share_weights`` of a frozen base: loading base weights would overwrite the lender's."""

    def share_weights(self, model: torch.nn.Module, live_version: Callable[[], int] | None = None) -> None:
        """Generate with ``model``'s weight tensors instead of a copy of them: one copy in memory, not
        two. ``model`` is a module of this process with the same architecture, dtype and device (a
        trainer's; a PEFT model or an adapter bank lends its base weights; every weight must match in
        name and shape).

        ``live_version`` None: the weights never change (a LoRA run's frozen base; adapters still load
        by name). Otherwise they change under the engine (a sync run's trainer, which never steps
        while the engine generates) and are always version ``live_version()``: ``update_weights``
        then reads nothing, and refuses any other version, since loading it would overwrite the
        trainer's weights."""
        hf_weights.share_tensors(self._base, model)
        self._live_version = live_version
        self._frozen_base = live_version is None
        if live_version is not None:
            self._version = live_version()

    # ------------------------------------------------------------------------------ protocol

    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Generate for all requests (any mix of sampling params); results are in request order.
        The requests share batches with those of other concurrent calls; the call returns as soon
        as its own requests are done."""
        self._ensure_open()
        requests = list(requests)
        for req in requests:
            self._check_request(req)
        if not requests:
            return []
        call = Call(requests, asyncio.get_running_loop())
        self._queue.append(call)
        self.stats.requests_received += len(requests)
        self._start_dispatcher()
        try:
            return await call.future
        finally:  # done, failed or cancelled: a cancelled call leaves the queue or the running batch
            call.stop.set()
            if call in self._queue:
                self._queue.remove(call)

    async def update_weights(self, uri: str, version: int) -> None:
        """Load the safetensors snapshot at ``uri`` (a file, or a folder holding ``model.safetensors``
        or a sharded ``model.safetensors.index.json``; any fsspec URL) once in-flight generation
        has finished, then report ``version``. Keys are checked before the model is touched. Once
        this waits for the running batch, calls queued behind it run after the load, on the new weights."""
        self._ensure_open()
        if self._frozen_base:
            raise RuntimeError(f"this engine generates with a frozen base it shares (a LoRA base); it loads "
                               f"adapters, not base weights ({uri})")
        if self._live_version is not None:  # the weights are the trainer's own (``share_weights``)
            if version != self._live_version():
                raise RuntimeError(f"this engine generates with the trainer's weights, version "
                                   f"{self._live_version()}; it cannot load version {version} from {uri}")
            async with self._lock:
                self._version = version
            return
        snapshot = await asyncio.to_thread(hf_weights.open_matching, self._base, uri, self.storage_options)
        loading = False
        try:
            async with self._lock:
                self._ensure_open()
                loading = True  # the load's thread closes the snapshot when done, even if this call is cancelled
                await _in_thread(hf_weights.load_state, self._base, snapshot)
                self._version = version
        finally:
            if not loading:
                snapshot.close()

    async def load_adapter(self, name: str, uri: str, version: int = 0) -> None:
        """Load the LoRA adapter in PEFT's folder format at ``uri`` (a local folder or any fsspec
        URL, e.g. a WeightStore version) under ``name``, or replace the adapter of that name (a new
        version of it), once in-flight generation has finished. Requests with ``adapter=name`` then
        use it, and their results carry ``version``; the base and every loaded adapter serve side by
        side in the same batches, unmerged."""
        self._ensure_open()
        if not name or name == BASE_ADAPTER or name in "lora_":
            # PEFT finds adapter weights by name inside "lora_A.<name>": a name inside "lora_"
            # itself (e.g. "a") can be confused with the prefix when the weights load
            raise ValueError(f"adapter name {name!r} is reserved, empty or part of PEFT's 'lora_' prefix; pick another")
        async with self._lock:
            self._ensure_open()
            try:
                await _in_thread(self._install_adapter, name, uri)
            except BaseException:
                if name not in self.adapters:  # a replacement that failed half way: the name is gone
                    self._adapter_versions.pop(name, None)
                raise
            self._adapter_versions[name] = version

    async def unload_adapter(self, name: str) -> bool:
        """Take adapter ``name`` out of the engine, once in-flight generation has finished (the
        caller makes sure nothing queued still asks for it). False when it is not loaded, or is the
        only one (PEFT keeps at least one; it stays, unused)."""
        async with self._lock:
            if name not in self._adapter_versions or len(self.adapters) <= 1:
                return False
            await _in_thread(hf_weights.delete_adapter, self.model, name)
            self._adapter_versions.pop(name, None)
            return True

    async def prompt_logprobs(self, prompt_ids: list[int], adapter: str | None = None) -> list[float]:
        """log p(token t | tokens before it) for each prompt token, NaN for the first (it has no
        context), under the base or the loaded adapter ``adapter``; one forward pass, between batches."""
        self._ensure_open()
        async with self._lock:
            self._ensure_open()
            return await _in_thread(self._prompt_logprobs, list(prompt_ids), adapter)

    def _prompt_logprobs(self, prompt_ids: list[int], adapter: str | None) -> list[float]:
        ids = torch.tensor([prompt_ids], device=self.device)
        kw: dict[str, Any] = {}
        if getattr(self.model, "peft_config", None):
            kw["adapter_names"] = [adapter or BASE_ADAPTER]
        elif adapter is not None:
            raise ValueError(f"adapter {adapter!r} is not loaded")
        with torch.no_grad():
            logits = self.model(input_ids=ids, use_cache=False, **kw).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        return [float("nan"), *lp.tolist()]

    @property
    def adapters(self) -> list[str]:
        """Names of the loaded LoRA adapters."""
        return sorted(getattr(self.model, "peft_config", {}))

    async def pause(self) -> None:
        """New and queued ``generate`` calls wait until ``resume()``; returns once the running
        batch has finished (call ``abort()`` first to cut it short)."""
        self._resumed.clear()
        async with self._lock:
            pass

    async def resume(self) -> None:
        self._resumed.set()

    async def abort(self) -> None:
        """End every call in flight or queued: unfinished sequences stop at the next decode step
        and come back with the tokens so far and finish reason ``abort`` (queued calls: no tokens).
        Later calls run normally."""
        versions = self._versions()
        for call in self._take_queue():
            call.settle([self._decoder.result(Row(req, call, k, finish="abort"), versions)
                         for k, req in enumerate(call.requests)])
        for call in self._running:
            call.stop.set()

    async def health(self) -> bool:
        return not self._closed

    async def close(self) -> None:
        """Abort what is running, then release the model."""
        await self.abort()
        async with self._lock:
            self._closed = True
            self.model = None

    # --------------------------------------------------------------------------- dispatching

    def _start_dispatcher(self) -> None:
        """Make sure a dispatcher runs on this event loop (one exits when the queue is empty)."""
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch())

    async def _dispatch(self) -> None:
        """Hand all queued calls to the model together, batch after batch, until none is queued.
        Waiting for the lock behind ``update_weights`` or ``pause`` lets them go first."""
        try:
            await self._dispatch_until_empty()
        except Exception as e:  # a failure here must reach the callers, not leave them waiting
            for call in self._take_queue():
                call.fail(e)
            raise

    async def _dispatch_until_empty(self) -> None:
        while self._queue:
            await self._resumed.wait()
            async with self._lock:
                calls = self._take_queue() if self._resumed.is_set() else []  # paused while waiting
                if calls:  # (all of them may have been aborted or cancelled meanwhile)
                    await self._run_calls(calls)

    def _take_queue(self) -> list[Call]:
        calls, self._queue = self._queue, []
        return calls

    async def _run_calls(self, calls: list[Call]) -> None:
        """Run ``calls`` in one dispatch. Each call is settled by the decode thread when its rows
        are done; an error settles those still waiting."""
        if self._closed:
            for call in calls:
                call.fail(RuntimeError("HFEngine is closed"))
            return
        self.stats.dispatches += 1
        self.stats.calls_served += len(calls)
        self._running.update(calls)

        def stop_all() -> None:  # the dispatcher itself is cancelled (its event loop is closing)
            for call in calls:
                call.stop.set()

        try:
            await _in_thread(self._decoder.run, self.model, calls, self._versions(), on_cancel=stop_all)
        except Exception as e:
            for call in calls:
                call.fail(e)
        finally:
            self._running.difference_update(calls)

    # ------------------------------------------------------------------------- async helpers

    def _ensure_open(self) -> None:
        if self._closed:
            raise RuntimeError("HFEngine is closed")

    def _check_request(self, req: GenerateRequest) -> None:
        # the names loaded so far, not the model's adapters right now: while a new version replaces
        # an adapter (under the lock) its name is briefly missing from the model, and a request
        # for it waits for the lock like any other
        if req.adapter is not None and req.adapter not in self._adapter_versions:
            loaded = ", ".join(sorted(self._adapter_versions)) or "none"
            raise ValueError(
                f"request {req.rid!r} asks for adapter {req.adapter!r}, which is not loaded (loaded: {loaded}); "
                "call load_adapter(name, uri) first"
            )
        if not req.prompt_ids:
            raise ValueError(f"request {req.rid!r} has an empty prompt (the engine needs at least one token)")
        vocab = self._decoder.vocab
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab:
            raise ValueError(f"request {req.rid!r} has token ids outside the vocabulary [0, {vocab})")
        check_sampling(req.sampling, req.rid)

    def _versions(self) -> Versions:
        """The version each result carries: an adapter's rows, the version it was loaded as (adapters
        load under the lock, so not during a batch); the base's rows, the base's."""
        return {None: self._version, **self._adapter_versions}

    def _install_adapter(self, name: str, uri: str) -> None:
        """Worker thread, under the lock: read the adapter folder and load it as ``name``."""
        self.model = hf_weights.install_adapter(self.model, self._base, name, uri, self.storage_options)


async def _in_thread(fn: Any, *args: Any, on_cancel: Any = None) -> Any:
    """Run ``fn`` in a worker thread. If the awaiting task is cancelled, tell the thread
    (``on_cancel``) and still wait for it, so the caller's lock is held until the model is free."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        if on_cancel is not None:
            on_cancel()
        await asyncio.wait([fut])
        raise
