"""A custom rollout function: the whole generate-and-score step of sync and async modes.

``rollout.rollout_function_path = "package.module:function"`` names a function
``fn(ctx: RolloutContext, step: int) -> list[Group]`` (plain or ``async``). It draws prompts with
``ctx.next_prompts(n)``, generates with ``ctx.engine`` (or ``ctx.generate_groups``), scores with
``await ctx.score(groups)``, and returns scored groups; the run appends them to the sample stream
and trains on them. ``examples/custom_rollout.py`` is a worked example.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_core.engines.base import RolloutEngine, SamplingParams
from miles_core.rollout.generate import PromptItem, generate_groups
from miles_core.types import Group, Sample

if TYPE_CHECKING:
    from miles_core.config import RunConfig


@dataclass
class RolloutContext:
    cfg: RunConfig
    engine: RolloutEngine
    tokenizer: Any
    next_prompts: Callable[[int], list[PromptItem]]
    """The next ``n`` training prompts (the run's prompt cursor moves)."""
    sampling: SamplingParams
    """The run's sampling params."""
    score: Callable[[list[Group]], Awaitable[Any]]
    """Scores groups in place with the run's reward and reward post-processing."""

    async def generate_groups(self, items: list[PromptItem], n: int, first_group_index: int,
                              sampling: SamplingParams | None = None, seed: int | None = None) -> list[Group]:
        """The default generation: ``n`` samples per prompt in one engine call."""
        return await generate_groups(self.engine, items, n, sampling or self.sampling, first_group_index, seed)


async def run_rollout_function(path: str, ctx: RolloutContext, step: int) -> list[Group]:
    """Call the rollout function at ``path`` and check what it returns (errors name the function)."""
    from miles_core.plugins import load_object

    fn = load_object(path, "rollout function")
    result = fn(ctx, step)
    if inspect.isawaitable(result):
        result = await result
    where = f"rollout function {path!r} at step {step}"
    if not isinstance(result, list) or not result or not all(isinstance(g, Group) for g in result):
        raise TypeError(f"{where} must return a non-empty list of Group, got {type(result).__name__}")
    for g in result:
        bad = [s for s in g.samples if not isinstance(s, Sample)]
        if not g.samples or bad:
            raise TypeError(f"{where}: group {g.group_index if g.samples else '?'} must hold Samples")
    unscored = sum(s.reward is None and s.error is None for g in result for s in g.samples)
    if unscored:
        raise ValueError(f"{where}: {unscored} samples have no reward; call `await ctx.score(groups)` before returning")
    return result
