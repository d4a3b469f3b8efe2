"""Turn prompts into scored groups of samples.

``generate_groups`` sends n requests per prompt to a ``RolloutEngine`` in one call, turns the
results into ``Sample``s (status from the finish reason, logprobs and weight version kept), and
``rollout_metrics`` summarises a rollout batch.

A custom generate function (``rollout.custom_generate_function_path``, e.g. multi-turn or tool
use) replaces the one request per sample: ``async def fn(ctx: GenerateContext, item: PromptItem)
-> Sample``. It may call ``ctx.engine.generate`` any number of times; it returns the sample with
``response_ids``, ``loss_mask`` (0 on tokens the policy did not generate, such as tool output),
``rollout_logprobs`` and one span per engine call; ``ctx.new_sample(item)`` fills in the rest.
``examples/multi_turn.py`` is a worked example.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from miles_core.engines.base import GenerateRequest, GenerateResult, RolloutEngine, SamplingParams
from miles_core.types import Group, Sample, SampleStatus

log = logging.getLogger(__name__)

FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}
"""A sample's status from the engine's finish reason."""


@dataclass
class PromptItem:
    """One prompt ready for the engine: rendered text, token ids, label, where it came from."""

    text: str
    prompt_ids: list[int]
    label: str | None
    prompt_index: int
    metadata: dict[str, Any]


def sampling_params(
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop=tuple(stop),
        stop_token_ids=tuple(stop_token_ids),
    )


@dataclass
class GenerateContext:
    """What a custom generate function gets besides the prompt."""

    engine: RolloutEngine
    tokenizer: Any
    sampling: SamplingParams
    """The run's sampling params, with this sample's seed."""
    group_index: int
    sample_index: int

    def new_sample(self, item: PromptItem) -> Sample:
        """An empty sample of ``item`` with this context's indices and the engine's current version."""
        version = self.engine.weight_version
        return Sample(
            prompt=item.text, prompt_ids=list(item.prompt_ids), label=item.label, span_starts=[], span_versions=[],
            submit_version=version, group_index=self.group_index, sample_index=self.sample_index,
            prompt_index=item.prompt_index, metadata=dict(item.metadata),
        )


CustomGenerate = Callable[[GenerateContext, PromptItem], Awaitable[Sample]]


def load_custom_generate(path: str | None) -> CustomGenerate | None:
    if path is None:
        return None
    from miles_core.plugins import load_object

    fn = load_object(path, "custom generate function")
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"custom generate function {path!r} must be 'async def fn(ctx, item) -> Sample'")
    return fn


async def run_custom_generate(fn: CustomGenerate, ctx: GenerateContext, item: PromptItem) -> Sample:
    """Call a custom generate function and check what it returns (errors name the sample)."""
    where = f"custom generate function, group {ctx.group_index} sample {ctx.sample_index}"
    sample = await fn(ctx, item)
    if not isinstance(sample, Sample):
        raise TypeError(f"{where}: returned {type(sample).__name__}, expected a Sample")
    n = len(sample.response_ids)
    if len(sample.loss_mask) != n or (sample.rollout_logprobs and len(sample.rollout_logprobs) != n):
        raise ValueError(
            f"{where}: loss_mask ({len(sample.loss_mask)}) and rollout_logprobs ({len(sample.rollout_logprobs)}) "
            f"must have one entry per response token ({n})"
        )
    if not sample.span_starts:
        sample.span_starts, sample.span_versions = [0], [sample.submit_version]
    sample.group_index, sample.sample_index = ctx.group_index, ctx.sample_index
    return sample


def _to_sample(
    item: PromptItem, result: GenerateResult, group_index: int, sample_index: int, submit_version: int
) -> Sample:
    return Sample(
        prompt=item.text,
        prompt_ids=list(item.prompt_ids),
        response_ids=list(result.output_ids),
        response=result.text,
        label=item.label,
        loss_mask=[1] * len(result.output_ids),
        rollout_logprobs=list(result.logprobs),
        span_starts=[0],
        span_versions=[result.weight_version],
        submit_version=submit_version,
        status=FINISH_STATUS[result.finish_reason],
        group_index=group_index,
        sample_index=sample_index,
        prompt_index=item.prompt_index,
        metadata=dict(item.metadata),
    )


async def generate_groups(
    engine: RolloutEngine,
    items: Sequence[PromptItem],
    n_samples: int,
    sampling: SamplingParams,
    first_group_index: int,
    seed: int | None = None,
    custom: CustomGenerate | None = None,
    tokenizer: Any = None,
) -> list[Group]:
    """Generate ``n_samples`` responses for each prompt; group ``i`` gets index ``first_group_index + i``.

    With ``seed`` set, request ``k`` of the batch samples with seed ``seed + k`` (reproducible runs).
    With ``custom``, each sample comes from the custom generate function instead of one request."""
    if custom is not None:
        return await _custom_groups(custom, engine, tokenizer, items, n_samples, sampling, first_group_index, seed)
    requests = []
    for i, item in enumerate(items):
        for j in range(n_samples):
            k = i * n_samples + j
            params = sampling if seed is None else _with_seed(sampling, seed + k)
            requests.append(GenerateRequest(item.prompt_ids, params, rid=f"g{first_group_index + i}-s{j}"))
    submit_version = engine.weight_version
    results = await _generate(engine, requests)
    groups = []
    for i, item in enumerate(items):
        chunk = results[i * n_samples : (i + 1) * n_samples]
        groups.append(Group([_to_sample(item, r, first_group_index + i, j, submit_version) for j, r in enumerate(chunk)]))
    return groups


async def _generate(engine: RolloutEngine, requests: list[GenerateRequest]) -> list[GenerateResult]:
    """``engine.generate(requests)``, sent once more when the engine did not answer (a server frozen
    past ``engine.health_timeout_s`` that comes back is used again); a second silence ends the rollout."""
    from miles_core.engines.http import EngineUnreachable

    try:
        return await engine.generate(requests)
    except EngineUnreachable as e:
        log.warning("the rollout's %d requests got no answer (%s); sending them once more", len(requests), e)
    return await engine.generate(requests)


async def _custom_groups(custom, engine, tokenizer, items, n_samples, sampling, first_group_index, seed):
    async def one(i: int, j: int) -> Sample:
        k = i * n_samples + j
        params = sampling if seed is None else _with_seed(sampling, seed + k)
        ctx = GenerateContext(engine, tokenizer, params, first_group_index + i, j)
        return await run_custom_generate(custom, ctx, items[i])

    samples = await asyncio.gather(*(one(i, j) for i in range(len(items)) for j in range(n_samples)))
    return [Group(list(samples[i * n_samples : (i + 1) * n_samples])) for i in range(len(items))]


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)


def rollout_metrics(groups: Sequence[Group]) -> dict[str, float]:
    samples = [s for g in groups for s in g.samples]
    scored = [s for s in samples if s.reward is not None]
    n = max(len(samples), 1)
    rewards = [s.reward for s in scored]
    resp_lens = [len(s.response_ids) for s in samples]
    uniform = sum(1 for g in groups if len({s.reward for s in g.samples}) <= 1)
    return {
        "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "accuracy": sum(s.is_correct for s in scored) / len(scored) if scored else float("nan"),
        "response_len_mean": sum(resp_lens) / n,
        "truncated_ratio": sum(s.status == SampleStatus.TRUNCATED for s in samples) / n,
        "failed_samples": float(sum(s.status == SampleStatus.FAILED for s in samples)),
        "aborted_samples": float(sum(s.status == SampleStatus.ABORTED for s in samples)),
        "zero_signal_groups": float(uniform),
        "response_tokens": float(sum(resp_lens)),
    }
