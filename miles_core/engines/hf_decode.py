"""The decode kernel of the in-process engine: batches of rows through a KV-cached decode loop.

Parts:
- ``Call``: one ``generate`` call on its way through the engine, settled on its caller's event loop.
- ``Decoder``: runs the requests of the calls of one dispatch in a worker thread. Rows batch
  together when they sample from the same distribution (temperature, top-p, top-k); lengths,
  stops, seeds and LoRA adapters are per row. Within a sampler, shortest prompts go together, in
  chunks of ``max_batch_size``. Batches are left-padded (``position_ids = mask.cumsum(-1) - 1``)
  and each distinct prompt of a batch is prefilled once (the n samples of a prompt then decode from
  copies of its keys and values, as a server's prefix cache would give them).
- ``EngineStats``: counters of what the engine has run; the engine and its decoder share one.
- ``sample_tokens``: one decode step's temperature / top-k / top-p sampling, by inverse CDF.
- ``check_sampling``: the sampling params a request may carry.

Seeds: a request with ``seed`` draws its uniforms from ``torch.Generator().manual_seed(seed)``
(``max_new_tokens`` of them, up front; new token t uses uniform t), so its output does not depend
on the batch or the calls it shares. Requests without a seed draw from the decoder's generator,
seeded once.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from miles_core.engines.base import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from miles_core.models.hf_cache import cache_kwarg

BASE_ADAPTER = "__base__"
"""PEFT's name for "no adapter" in a mixed-adapter batch."""
_COMPACT_SHARE = 0.25
"""Finished rows leave the batch (and its KV cache) once they are this share of the batch."""

Versions = dict[str | None, int]
"""The weight version of each adapter name of a dispatch; ``None``, the base's."""


@dataclass
class EngineStats:
    """What an ``HFEngine`` has run so far (for tests and logs)."""

    dispatches: int = 0
    """Times the dispatcher handed the queued calls to the model together."""
    batches_run: int = 0
    """Decode loops run: a dispatch runs one per sampler and chunk of ``max_batch_size`` rows."""
    calls_served: int = 0
    """``generate`` calls handed to the model (calls aborted while queued never are)."""
    requests_received: int = 0
    """Requests that have reached the engine (queued for a dispatch)."""
    first_tokens: int = 0
    """Requests whose first token has been sampled: from then on an abort returns tokens."""


@dataclass(eq=False)  # compared by identity: a call is one caller's wait
class Call:
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
class Row:
    """One request of a dispatch and what it has produced so far."""

    req: GenerateRequest
    call: Call
    index: int
    """The request's place in its call."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None


class Decoder:
    """The decode loop of one model, run in a worker thread: ``run(model, calls, versions)`` decodes
    the requests of ``calls`` and hands each result to its call as soon as its row ends; ``result``
    makes the result of a row. ``model`` is passed per dispatch (the base, or a PEFT wrapper of it once
    an adapter is loaded); the tokenizer, the EOS ids and the sampling generator are the decoder's."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_batch_size: int, seed: int,
                 stats: EngineStats) -> None:
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.stats = stats
        self.device = next(model.parameters()).device
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self._eos_ids = _eos_ids(tokenizer, model)
        pad = tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else min(self._eos_ids, default=0)
        self._cache_kwarg = cache_kwarg(model)  # the cache is ours, under whichever name transformers takes it
        self._generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def run(self, model: torch.nn.Module, calls: list[Call], versions: Versions) -> None:
        """Run the requests of all ``calls``: rows with the same sampler share batches of up to
        ``max_batch_size``, shortest prompts together. ``versions`` gives each result its version."""
        for sampler, rows in _rows_by_sampler(calls).items():
            rows.sort(key=lambda row: len(row.req.prompt_ids))
            for start in range(0, len(rows), self.max_batch_size):
                self._run_batch(model, rows[start : start + self.max_batch_size], sampler, versions)

    def result(self, row: Row, versions: Versions) -> GenerateResult:
        """Adapter rows carry the version their adapter was loaded as; base rows, the base's."""
        text = self.tokenizer.decode(row.output_ids, skip_special_tokens=True)
        return GenerateResult(row.output_ids, text, row.logprobs, row.finish or "abort", versions[row.req.adapter],
                              row.req.rid)

    def _run_batch(self, model: torch.nn.Module, rows: list[Row], sampler: SamplingParams, versions: Versions) -> None:
        """The decode loop of one batch. A row finishes, and goes to its call, when it stops, reaches
        its length or its call is stopped. Finished rows leave the batch and its KV cache once they
        are a quarter of it, or at once when a call was stopped (its rows may have far to go); the
        rest keep decoding with their own positions."""
        rows = [row for row in rows if not self._finished_before_start(row, versions)]
        if not rows:
            return
        self.stats.batches_run += 1
        uniforms = self._uniforms(rows, sampler)
        cache = DynamicCache(config=model.config)
        kv = {self._cache_kwarg: cache, "use_cache": True}
        adapters = [row.req.adapter or BASE_ADAPTER for row in rows] if getattr(model, "peft_config", None) else None
        # each distinct prompt (and adapter) is prefilled once; its rows then share its keys and values
        prompts: dict[tuple, int] = {}
        which = [prompts.setdefault((tuple(row.req.prompt_ids), adapters and adapters[i]), i) for i, row in enumerate(rows)]
        firsts = list(dict.fromkeys(which))
        ids, mask = self._left_pad([rows[i].req.prompt_ids for i in firsts])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if adapters is not None:  # PEFT's mixed-adapter batches: one adapter (or the base) per row
            kv["adapter_names"] = [adapters[i] for i in firsts]
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1, **kv)
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
            stopped = self._end_stopped_rows(rows, live, versions)
            u = None if uniforms is None else uniforms[live, step]
            tokens, logprobs = sample_tokens(logits, sampler, u)
            self._record(rows, live, tokens.tolist(), logprobs.tolist(), versions)
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
            out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_pos, **kv)
            logits = out.logits[:, -1].float()
            next_pos = next_pos + 1

    def _finished_before_start(self, row: Row, versions: Versions) -> bool:
        """End a row that needs no decoding: its call is stopped, or it asks for no tokens."""
        if row.call.stop.is_set():
            self._finish(row, "abort", versions)
        elif row.req.sampling.max_new_tokens == 0:
            self._finish(row, "length", versions)
        else:
            return False
        return True

    def _end_stopped_rows(self, rows: list[Row], live: list[int], versions: Versions) -> bool:
        """End the rows of aborted or cancelled calls, with the tokens so far; whether there were any."""
        stopped = [i for i in live if rows[i].finish is None and rows[i].call.stop.is_set()]
        for i in stopped:
            self._finish(rows[i], "abort", versions)
        return bool(stopped)

    def _finish(self, row: Row, reason: FinishReason, versions: Versions) -> None:
        row.finish = reason
        row.call.add_result(row.index, self.result(row, versions))

    def _record(
        self, rows: list[Row], live: list[int], tokens: list[int], logprobs: list[float], versions: Versions
    ) -> None:
        """Append this step's token to every unfinished row and decide whether the row ends."""
        for b, i in enumerate(live):
            row = rows[i]
            if row.finish is not None:
                continue
            row.output_ids.append(tokens[b])
            row.logprobs.append(logprobs[b])
            if len(row.output_ids) == 1:
                self.stats.first_tokens += 1
            p = row.req.sampling
            if tokens[b] in self._eos_ids or tokens[b] in p.stop_token_ids or (
                p.stop and self._ends_in_stop(row.output_ids, p.stop)
            ):
                self._finish(row, "stop", versions)
            elif len(row.output_ids) >= p.max_new_tokens:
                self._finish(row, "length", versions)

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

    def _uniforms(self, rows: list[Row], sampler: SamplingParams) -> torch.Tensor | None:
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


def check_sampling(p: SamplingParams, rid: str | None) -> None:
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


def _rows_by_sampler(calls: list[Call]) -> dict[SamplingParams, list[Row]]:
    groups: dict[SamplingParams, list[Row]] = defaultdict(list)
    for call in calls:
        for k, req in enumerate(call.requests):
            groups[_sampler(req.sampling)].append(Row(req, call, k))
    return groups


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
