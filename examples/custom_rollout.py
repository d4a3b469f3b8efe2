"""A custom rollout function: sample twice as many prompts as needed, keep the informative half.

Use it with ``--rollout-function-path examples.custom_rollout:rollout`` (sync or async mode, run
from the repo root). It generates ``2 * rollout_batch_size`` groups, scores them, and keeps the
``rollout_batch_size`` groups whose rewards vary the most (a group where every sample scored the
same gives GRPO nothing to learn from). Group indices stay unique across steps.
"""

from __future__ import annotations

import statistics

from miles_core.rollout.custom import RolloutContext
from miles_core.types import Group


async def rollout(ctx: RolloutContext, step: int) -> list[Group]:
    batch = ctx.cfg.rollout.rollout_batch_size
    items = ctx.next_prompts(2 * batch)
    groups = await ctx.generate_groups(items, ctx.cfg.rollout.n_samples_per_prompt, step * 2 * batch,
                                       seed=ctx.cfg.seed * 7_919 + step)
    await ctx.score(groups)
    spread = lambda g: statistics.pstdev([s.reward or 0.0 for s in g.samples])  # noqa: E731
    return sorted(groups, key=spread, reverse=True)[:batch]
