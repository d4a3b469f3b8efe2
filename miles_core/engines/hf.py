"""In-process transformers rollout engine (the CPU default).

Parts:
- ``HFEngine``: the ``RolloutEngine`` over a Hugging Face causal LM loaded in this process. It runs
  its own KV-cached decode loop over left-padded batches (``position_ids = mask.cumsum(-1) - 1``),
  prefilling each distinct prompt of a batch once (the n samples of a prompt then decode from
  copies of its keys and values, as a server's prefix cache would give them), so each output
  token's logprob is exactly ``log_softmax(logits / T)`` of the raw logits (raw logits when T is
  0), the quantity the trainer recomputes.
- ``HFEngine.share_weights(model)``: generate with the weight tensors of a model of this process (a
  trainer's, or an adapter bank's base) instead of a copy: a sync run's rollout engine follows its
  trainer's versions, and every engine of a LoRA run shares the frozen base.
- ``EngineStats``: counters of dispatches, decode batches and calls served (``HFEngine.stats``).
- ``sample_tokens``: one decode step's temperature / top-k / top-p sampling, by inverse CDF.
- ``Snapshot``: a weight snapshot (file, folder, or sharded folder) at any fsspec URL, read one
  tensor at a time as it is loaded.

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

Batching: rows batch together when they sample from the same distribution (temperature, top-p,
top-k); lengths, stops, seeds and LoRA adapters are per row. Within a sampler, shortest prompts go
together, in chunks of ``max_batch_size``.

LoRA: ``load_adapter(name, uri)`` loads a PEFT adapter folder under a name (or replaces the
adapter of that name); the model becomes a PEFT wrapper of the base and every batch passes one
adapter name per row (``__base__`` for none), so the base and any number of adapters serve
together, unmerged. Base weight updates still load into the base and leave the adapters as they
are. Results of adapter rows carry the version the adapter was loaded as; base rows, the base's.

Seeds: a request with ``seed`` draws its uniforms from ``torch.Generator().manual_seed(seed)``
(``max_new_tokens`` of them, up front; new token t uses uniform t), so its output does not depend
on the batch or the calls it shares. Requests without a seed draw from the engine's generator,
seeded once.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import tempfile
import threading
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from miles_core.dtypes import torch_dtype
from miles_core.engines.base import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from miles_core.models.hf_cache import cache_kwarg

if TYPE_CHECKING:
    from miles_core.config import HFEngineConfig

BASE_ADAPTER = "__base__"
"""PEFT's name for "no adapter" in a mixed-adapter batch."""
_COMPACT_SHARE = 0.25
"""Finished rows leave the batch (and its KV cache) once they are this share of the batch."""


@dataclass
class EngineStats:
    """What an ``HFEngine`` has run so far (for tests and logs)."""

    dispatches: int = 0
    """Times the dispatcher handed the queued calls to the model together."""
    batches_run: int = 0
    """Decode loops run: a dispatch runs one per sampler and chunk of ``max_batch_size`` rows."""
    calls_served: int = 0
    """``generate`` calls handed to the model (calls aborted while queued never are)."""


@dataclass(eq=False)  # compared by identity: a call is one caller's wait
class _Call:
    """One ``generate`` call on its way through the engine. The decode thread fills ``results``
    and settles ``future`` on the caller's ``loop`` once the last one is in; ``stop`` (set by
    ``abort()``, or when the caller goes away) ends the call's rows at the next decode step."""

    requests: list[GenerateRequest]
    loop: asyncio.AbstractEventLoop
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.future: asyncio.Future[list[GenerateResult]] = self.loop.create_future()
        self.results: list[GenerateResult | None] = [None] * len(self.requests)
        self.unfinished = len(self.requests)

    def add_result(self, index: int, result: GenerateResult) -> None:
        """Decode thread: one request is done; the last one settles the call."""
        self.results[index] = result
        self.unfinished -= 1
        if self.unfinished == 0:
            _call_soon_threadsafe(self.loop, self.settle, self.results)

    def settle(self, results: list[GenerateResult]) -> None:
        if not self.future.done():  # the caller may have been cancelled
            self.future.set_result(results)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@dataclass
class _Row:
    """One request of a dispatch and what it has produced so far."""

    req: GenerateRequest
    call: _Call
    index: int
    """The request's place in its call."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None


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
        self._eos_ids = _eos_ids(self.tokenizer, self.model)
        pad = self.tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else min(self._eos_ids, default=0)
        self._vocab = self.model.get_output_embeddings().weight.shape[0]
        self._cache_kwarg = cache_kwarg(self.model)  # the cache is ours, under whichever name transformers takes it
        self._generator = torch.Generator().manual_seed(seed)
        self._version = 0
        self._adapter_versions: dict[str, int] = {}
        self.stats = EngineStats()
        self._lock = asyncio.Lock()
        """Held by the running batch and by weight loads."""
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._queue: list[_Call] = []
        """Calls waiting for the next dispatch, in arrival order."""
        self._running: set[_Call] = set()
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
        lender = model.get_base_model() if hasattr(model, "get_base_model") else model
        theirs = _plain_params(lender)
        pairs = []
        for name, param in _plain_params(self._base).items():
            other = theirs.get(name)
            if other is None or other.shape != param.shape or other.dtype != param.dtype \
                    or other.device != param.device:
                found = "missing" if other is None else f"{tuple(other.shape)} {other.dtype} on {other.device}"
                raise ValueError(f"cannot share weight {name} ({tuple(param.shape)} {param.dtype} on "
                                 f"{param.device}) with the model: {found}")
            pairs.append((param, other))
        for param, other in pairs:  # all checked first: a refused model leaves the engine as it was
            param.data = other.data
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
        call = _Call(requests, asyncio.get_running_loop())
        self._queue.append(call)
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
        snapshot = await asyncio.to_thread(self._read_matching_state, uri)
        loading = False
        try:
            async with self._lock:
                self._ensure_open()
                loading = True  # the load's thread closes the snapshot when done, even if this call is cancelled
                await _in_thread(self._load_state, snapshot)
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
        for call in self._take_queue():
            call.settle([self._result(_Row(req, call, k, finish="abort"), self._version)
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

    def _take_queue(self) -> list[_Call]:
        calls, self._queue = self._queue, []
        return calls

    async def _run_calls(self, calls: list[_Call]) -> None:
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
            await _in_thread(self._generate_sync, calls, on_cancel=stop_all)
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
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= self._vocab:
            raise ValueError(f"request {req.rid!r} has token ids outside the vocabulary [0, {self._vocab})")
        _check_sampling(req.sampling, req.rid)

    def _result(self, row: _Row, version: int) -> GenerateResult:
        if row.req.adapter is not None:  # adapters load under the lock, so not during this batch
            version = self._adapter_versions[row.req.adapter]
        text = self.tokenizer.decode(row.output_ids, skip_special_tokens=True)
        return GenerateResult(row.output_ids, text, row.logprobs, row.finish or "abort", version, row.req.rid)

    # ----------------------------------------------------------------- generation (worker thread)

    @torch.inference_mode()
    def _generate_sync(self, calls: list[_Call]) -> None:
        """Run the requests of all ``calls``: rows with the same sampler share batches of up to
        ``max_batch_size``, shortest prompts together."""
        version = self._version
        for sampler, rows in _rows_by_sampler(calls).items():
            rows.sort(key=lambda row: len(row.req.prompt_ids))
            for start in range(0, len(rows), self.cfg.max_batch_size):
                self._run_batch(rows[start : start + self.cfg.max_batch_size], sampler, version)

    def _run_batch(self, rows: list[_Row], sampler: SamplingParams, version: int) -> None:
        """The decode loop of one batch. A row finishes, and goes to its call, when it stops, reaches
        its length or its call is stopped. Finished rows leave the batch and its KV cache once they
        are a quarter of it, or at once when a call was stopped (its rows may have far to go); the
        rest keep decoding with their own positions."""
        rows = [row for row in rows if not self._finished_before_start(row, version)]
        if not rows:
            return
        self.stats.batches_run += 1
        uniforms = self._uniforms(rows, sampler)
        cache = DynamicCache(config=self.model.config)
        kv = {self._cache_kwarg: cache, "use_cache": True}
        adapters = [row.req.adapter or BASE_ADAPTER for row in rows] if self.adapters else None
        # each distinct prompt (and adapter) is prefilled once; its rows then share its keys and values
        prompts: dict[tuple, int] = {}
        which = [prompts.setdefault((tuple(row.req.prompt_ids), adapters and adapters[i]), i) for i, row in enumerate(rows)]
        firsts = list(dict.fromkeys(which))
        ids, mask = self._left_pad([rows[i].req.prompt_ids for i in firsts])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if adapters is not None:  # PEFT's mixed-adapter batches: one adapter (or the base) per row
            kv["adapter_names"] = [adapters[i] for i in firsts]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1, **kv)
        logits = out.logits[:, -1].float()
        if len(firsts) < len(rows):
            slot = {first: k for k, first in enumerate(firsts)}
            expand = torch.tensor([slot[i] for i in which], device=self.device)
            cache.batch_select_indices(expand)
            mask, logits = mask[expand], logits[expand]
            if adapters is not None:
                kv["adapter_names"] = adapters
        next_pos = mask.sum(-1, keepdim=True)
        live = list(range(len(rows)))  # batch row -> index into rows
        for step in range(max(row.req.sampling.max_new_tokens for row in rows)):
            stopped = self._end_stopped_rows(rows, live, version)
            u = None if uniforms is None else uniforms[live, step]
            tokens, logprobs = sample_tokens(logits, sampler, u)
            self._record(rows, live, tokens.tolist(), logprobs.tolist(), version)
            active = [b for b, i in enumerate(live) if rows[i].finish is None]
            if not active:
                break
            if stopped or len(live) - len(active) >= _COMPACT_SHARE * len(live):
                index = torch.tensor(active, device=self.device)
                cache.batch_select_indices(index)
                mask, next_pos, tokens = mask[index], next_pos[index], tokens[index]
                live = [live[b] for b in active]
                if adapters is not None:
                    kv["adapter_names"] = [adapters[i] for i in live]
            mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=-1)
            out = self.model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_pos, **kv)
            logits = out.logits[:, -1].float()
            next_pos = next_pos + 1

    def _finished_before_start(self, row: _Row, version: int) -> bool:
        """End a row that needs no decoding: its call is stopped, or it asks for no tokens."""
        if row.call.stop.is_set():
            self._finish(row, "abort", version)
        elif row.req.sampling.max_new_tokens == 0:
            self._finish(row, "length", version)
        else:
            return False
        return True

    def _end_stopped_rows(self, rows: list[_Row], live: list[int], version: int) -> bool:
        """End the rows of aborted or cancelled calls, with the tokens so far; whether there were any."""
        stopped = [i for i in live if rows[i].finish is None and rows[i].call.stop.is_set()]
        for i in stopped:
            self._finish(rows[i], "abort", version)
        return bool(stopped)

    def _finish(self, row: _Row, reason: FinishReason, version: int) -> None:
        row.finish = reason
        row.call.add_result(row.index, self._result(row, version))

    def _record(
        self, rows: list[_Row], live: list[int], tokens: list[int], logprobs: list[float], version: int
    ) -> None:
        """Append this step's token to every unfinished row and decide whether the row ends."""
        for b, i in enumerate(live):
            row = rows[i]
            if row.finish is not None:
                continue
            row.output_ids.append(tokens[b])
            row.logprobs.append(logprobs[b])
            p = row.req.sampling
            if tokens[b] in self._eos_ids or tokens[b] in p.stop_token_ids or (
                p.stop and self._ends_in_stop(row.output_ids, p.stop)
            ):
                self._finish(row, "stop", version)
            elif len(row.output_ids) >= p.max_new_tokens:
                self._finish(row, "length", version)

    def _ends_in_stop(self, output_ids: list[int], stops: tuple[str, ...]) -> bool:
        """Whether the newest token completed a stop string. Rows are checked after every token, so
        a new match lies in the response's tail: decoding a tail window keeps each check short."""
        window = 2 * max(len(s) for s in stops) + 8
        text = self.tokenizer.decode(output_ids[-window:], skip_special_tokens=True)
        return any(s in text for s in stops)

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[b, width - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _uniforms(self, rows: list[_Row], sampler: SamplingParams) -> torch.Tensor | None:
        """One uniform per row and new token, up to the longest row (None when greedy: nothing is
        drawn). A seeded row draws its own ``max_new_tokens``, whatever the batch."""
        if sampler.temperature == 0:
            return None
        width = max(row.req.sampling.max_new_tokens for row in rows)
        u = torch.zeros((len(rows), width), dtype=torch.float64)
        unseeded = [b for b, row in enumerate(rows) if row.req.sampling.seed is None]
        if unseeded:
            u[unseeded] = torch.rand((len(unseeded), width), generator=self._generator, dtype=torch.float64)
        for b, row in enumerate(rows):
            p = row.req.sampling
            if p.seed is not None:
                g = torch.Generator().manual_seed(p.seed & 0xFFFF_FFFF_FFFF_FFFF)
                u[b, : p.max_new_tokens] = torch.rand(p.max_new_tokens, generator=g, dtype=torch.float64)
        return u.to(self.device)

    # ------------------------------------------------------------------------------- weights

    def _read_matching_state(self, uri: str) -> Snapshot:
        """Open the snapshot and check it against the model's keys and shapes (from the files' headers).
        Tied weights (one tensor under several names, such as ``lm_head.weight`` and
        ``model.embed_tokens.weight``) may come under any of their names."""
        snapshot = Snapshot(uri, self.storage_options)
        try:
            own = {name: self._base.state_dict()[actual] for name, actual in self._base_names().items()}
            for names in _alias_groups(own):
                present = [n for n in names if n in snapshot.names]
                if present:
                    for n in names:
                        snapshot.names.setdefault(n, snapshot.names[present[0]])
            missing, unexpected = sorted(own.keys() - snapshot.names.keys()), sorted(snapshot.names.keys() - own.keys())
            if missing or unexpected:
                raise ValueError(
                    f"weights at {uri} do not fit the model: "
                    f"missing keys {_few(missing)}, unexpected keys {_few(unexpected)}"
                )
            bad = [f"{k}: {snapshot.shape(k)} vs model {tuple(t.shape)}" for k, t in own.items()
                   if snapshot.shape(k) != tuple(t.shape)]
            if bad:
                raise ValueError(f"weights at {uri} have wrong shapes: {_few(bad)}")
        except BaseException:
            snapshot.close()
            raise
        return snapshot

    @torch.no_grad()
    def _load_state(self, snapshot: Snapshot) -> None:
        """Copy the snapshot's weights into the base model, one tensor at a time (cast to the model's
        dtype); loaded adapters stay as they are."""
        try:
            own = self._base.state_dict()
            for name, actual in self._base_names().items():
                snapshot.load_into(name, own[actual])
        finally:
            snapshot.close()

    def _base_names(self) -> dict[str, str]:
        """Snapshot name -> the base model's own name of each weight. A LoRA layer renames the
        weight it wraps to ``<module>.base_layer.weight`` and adds adapter weights, which base
        snapshots do not carry."""
        return {_plain_name(k): k for k in self._base.state_dict() if ".lora_" not in k}

    def _install_adapter(self, name: str, uri: str) -> None:
        """Worker thread, under the lock: read the adapter folder and load it as ``name``."""
        from peft import PeftModel

        with _local_folder(uri, self.storage_options) as folder:
            if not isinstance(self.model, PeftModel):
                self.model = PeftModel.from_pretrained(self._base, folder, adapter_name=name).eval()
                return
            if name in self.model.peft_config:  # a new version of a loaded adapter
                with warnings.catch_warnings():  # PEFT warns that the deleted adapter was "active";
                    warnings.simplefilter("ignore")  # batches name their adapters per row, none is active
                    self.model.delete_adapter(name)
            self.model.load_adapter(folder, adapter_name=name)
            self.model.eval()


# -------------------------------------------------------------------------------- sampling


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` [B, V] and return (tokens, logprobs), both [B].

    The logprob is ``log_softmax(logits / T)`` (raw logits when T is 0), before truncation; top-k
    then top-p truncate the temperature-scaled distribution that is sampled. ``uniforms`` [B] in
    [0, 1) pick the token by inverse CDF (unused when greedy)."""
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    logprobs = torch.log_softmax(scaled, -1)
    probs = _truncate(scaled, params.top_k, params.top_p).softmax(-1).double()
    cdf = probs.cumsum(-1)
    tokens = (cdf <= uniforms[:, None] * cdf[:, -1:]).sum(-1).clamp_(max=probs.shape[-1] - 1)
    # Rounding in the cumsum can land on a token of probability 0: take the nearest allowed one below.
    vocab = torch.arange(probs.shape[-1], device=probs.device)
    allowed_at_or_below = torch.where(probs > 0, vocab, -1).cummax(-1).values
    tokens = allowed_at_or_below.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _truncate(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k, then outside the top-p nucleus, to -inf."""
    if 0 < top_k < scaled.shape[-1]:
        values, index = scaled.topk(top_k, dim=-1)
        scaled = torch.full_like(scaled, float("-inf")).scatter_(-1, index, values)
    if top_p < 1.0:
        values, index = scaled.sort(dim=-1, descending=True)
        probs = values.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        values = values.masked_fill(mass_before >= top_p, float("-inf"))  # the nucleus is already full
        scaled = torch.empty_like(scaled).scatter_(-1, index, values)
    return scaled


def _check_sampling(p: SamplingParams, rid: str | None) -> None:
    problems = []
    if p.max_new_tokens < 0:
        problems.append(f"max_new_tokens={p.max_new_tokens} must be >= 0")
    if p.temperature < 0:
        problems.append(f"temperature={p.temperature} must be >= 0 (0 is greedy)")
    if not 0 < p.top_p <= 1:
        problems.append(f"top_p={p.top_p} must be in (0, 1]")
    if p.top_k != -1 and p.top_k < 1:
        problems.append(f"top_k={p.top_k} must be -1 (off) or >= 1")
    if any(not s for s in p.stop):
        problems.append("stop strings must not be empty")
    if problems:
        raise ValueError(f"request {rid!r}: bad sampling params: " + "; ".join(problems))


def _sampler(p: SamplingParams) -> SamplingParams:
    """The distribution a request samples from: requests batch together when theirs agree (length,
    stops and seed are per row). Greedy ignores top-p and top-k."""
    if p.temperature == 0:
        return SamplingParams(temperature=0.0)
    return SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k)


def _rows_by_sampler(calls: list[_Call]) -> dict[SamplingParams, list[_Row]]:
    groups: dict[SamplingParams, list[_Row]] = defaultdict(list)
    for call in calls:
        for k, req in enumerate(call.requests):
            groups[_sampler(req.sampling)].append(_Row(req, call, k))
    return groups


# ------------------------------------------------------------------------------ weights I/O


@contextmanager
def _local_folder(uri: str, storage_options: dict[str, Any] | None = None) -> Iterator[str]:
    """A local folder with the files at ``uri``: the folder itself, or a temporary copy of a remote
    one (removed afterwards)."""
    from miles_core.storage.fs import copy_to_disk, is_local, open_fs

    fs, path = open_fs(uri, storage_options)
    if not fs.isdir(path):
        raise FileNotFoundError(f"adapter folder not found: {uri}")
    if is_local(fs):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="miles-adapter-") as tmp:
        yield copy_to_disk(uri, tmp, storage_options)


class Snapshot:
    """A weight snapshot opened for loading (a ``.safetensors`` file, or a folder holding
    ``model.safetensors`` or the shards listed by ``model.safetensors.index.json``, at any fsspec
    URL): ``names`` maps each tensor's name to the one it is stored under (tied names added by the
    engine), ``shape`` reads a header, ``load_into`` reads one tensor into a parameter. Loading
    holds no second copy of the weights: a tensor of the parameter's dtype is read straight into it,
    another one (a bf16 snapshot of a float32 model) through one temporary tensor. A remote
    snapshot is copied to a local temporary folder first (removed by ``close``)."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None) -> None:
        from miles_core.storage.fs import is_local, open_fs
        from miles_core.storage.weights import SafetensorsFile

        fs, path = open_fs(uri, storage_options)
        if fs.isdir(path):
            files = _snapshot_files(fs, path.rstrip("/"), uri)
        elif fs.exists(path):
            files = [path]
        else:
            raise FileNotFoundError(f"no weights at {uri}")
        self._tmp = None
        if not is_local(fs):
            self._tmp = tempfile.TemporaryDirectory(prefix="miles-weights-")
            local = [os.path.join(self._tmp.name, f"{i}.safetensors") for i in range(len(files))]
            for remote, here in zip(files, local):
                fs.get_file(remote, here)
            files = local
        self._files: dict[str, SafetensorsFile] = {}
        self.names: dict[str, str] = {}
        for f in files:
            try:
                opened = SafetensorsFile(f)
            except (ValueError, OSError) as e:
                self.close()
                raise ValueError(f"{uri}: {f} is not a readable safetensors file: {e}") from e
            for name in opened.entries:
                self._files[name] = opened
                self.names[name] = name

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files[self.names[name]].shape(self.names[name])

    def load_into(self, name: str, param: torch.Tensor) -> None:
        stored = self.names[name]
        file = self._files[stored]
        if file.dtype(stored) == param.dtype and param.is_contiguous():
            file.read_into(stored, param)
        else:
            param.copy_(file.tensor(stored))

    def close(self) -> None:
        self._files = {}
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _snapshot_files(fs: Any, folder: str, uri: str) -> list[str]:
    single = f"{folder}/model.safetensors"
    if fs.exists(single):
        return [single]
    index = f"{single}.index.json"
    if fs.exists(index):
        weight_map = json.loads(fs.cat_file(index))["weight_map"]
        return [f"{folder}/{name}" for name in sorted(set(weight_map.values()))]
    raise FileNotFoundError(f"{uri} is a folder without model.safetensors or model.safetensors.index.json")


_WRAPPED_RE = re.compile(r"\.(?:base_layer|base)\.(weight|bias)$")


def _plain_name(name: str) -> str:
    """A weight's name in the plain model: a LoRA layer keeps the layer it wraps as ``base_layer``
    (PEFT) or ``base`` (``AdapterBank``)."""
    return _WRAPPED_RE.sub(r".\1", name)


def _plain_params(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``module``'s base weights by their plain names (LoRA weights left out; tied ones under each name)."""
    return {_plain_name(k): v for k, v in module.named_parameters(remove_duplicate=False) if ".lora_" not in k}


def _alias_groups(state: dict[str, torch.Tensor]) -> list[list[str]]:
    """Names that share one tensor (tied weights)."""
    by_ptr: dict[tuple[int, tuple[int, ...]], list[str]] = defaultdict(list)
    for name, t in state.items():
        if t.numel():
            by_ptr[(t.data_ptr(), tuple(t.shape))].append(name)
    return [names for names in by_ptr.values() if len(names) > 1]


def _few(items: list[str], n: int = 5) -> str:
    shown = ", ".join(items[:n]) or "none"
    return shown + (f" (+{len(items) - n} more)" if len(items) > n else "")


def _eos_ids(tokenizer: Any, model: Any) -> set[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids


def _call_soon_threadsafe(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop has closed: nobody waits for the result any more
        pass


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
