"""A custom generate function with two policy turns and a tool answer in between.

Use it with ``--custom-generate-function-path examples.multi_turn:generate`` (run from the repo
root). Turn 1: the policy writes up to half the token budget. The "tool" (here it only says
``=``) answers; its tokens are part of the response but have ``loss_mask`` 0, so the policy is
not trained on them, and logprob 0 (the policy did not sample them). Turn 2: the policy continues
from everything so far with the rest of the budget. Each policy turn is its own span, stamped with
the weight version that generated it.
"""

from __future__ import annotations

from dataclasses import replace

from miles_core.engines.base import GenerateRequest
from miles_core.rollout.generate import GenerateContext, PromptItem
from miles_core.types import Sample, SampleStatus

TOOL_TEXT = "="


async def generate(ctx: GenerateContext, item: PromptItem) -> Sample:
    sample = ctx.new_sample(item)
    budget = ctx.sampling.max_new_tokens
    first = await _turn(ctx, list(item.prompt_ids), max(1, budget // 2), sample)
    if first.finish_reason != "length":  # the policy ended its answer in turn 1: no tool call
        sample.status = _status(first.finish_reason)
        return sample
    tool_ids = ctx.tokenizer(TOOL_TEXT, add_special_tokens=False)["input_ids"]
    sample.response_ids += tool_ids
    sample.response += TOOL_TEXT
    sample.loss_mask += [0] * len(tool_ids)
    sample.rollout_logprobs += [0.0] * len(tool_ids)
    left = budget - len(sample.response_ids)
    if left <= 0:
        sample.status = SampleStatus.TRUNCATED
        return sample
    second = await _turn(ctx, list(item.prompt_ids) + sample.response_ids, left, sample)
    sample.status = _status(second.finish_reason)
    return sample


async def _turn(ctx: GenerateContext, prompt_ids: list[int], max_new_tokens: int, sample: Sample):
    request = GenerateRequest(prompt_ids, replace(ctx.sampling, max_new_tokens=max_new_tokens))
    (result,) = await ctx.engine.generate([request])
    sample.span_starts.append(len(sample.response_ids))
    sample.span_versions.append(result.weight_version)
    sample.response_ids += result.output_ids
    sample.response += result.text
    sample.loss_mask += [1] * len(result.output_ids)
    sample.rollout_logprobs += result.logprobs
    return result


def _status(finish_reason: str) -> SampleStatus:
    return {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED}.get(finish_reason, SampleStatus.ABORTED)
