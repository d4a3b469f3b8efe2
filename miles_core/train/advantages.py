"""GRPO advantages: rewards centred (and optionally scaled) within each group of one prompt.

- ``grpo_advantages(rewards)``: a ``[groups, n]`` tensor, or a list of groups (lists may be ragged
  and may hold ``None``), to advantages of the same shape.
- ``sample_advantages(groups)``: one advantage per sample, in the order of
  ``miles_core.types.flatten(groups)`` (the order a ``TrainBatch`` lists samples in).

Definitions (chosen once, used everywhere):

- The group std is the *population* std (``correction=0``, divide by n, not n - 1). It is defined
  for a group of one (std 0, advantage 0), which matters once failed samples leave a group with a
  single scored sample; the unbiased std would be NaN there.
- ``A = (r - mean) / (std + eps)`` when ``normalize_std``, else ``A = r - mean`` (Dr.GRPO-style).
  A group whose rewards are all equal gets advantage 0 exactly (0 / (0 + eps)).
- A reward of ``None`` marks a failed sample (generation or reward failed). It is left out of its
  group's mean and std and gets advantage 0. The trainer also gives it a zero loss mask (see
  ``miles_core.train.batch.collate``), so it adds nothing to the loss, KL term or token counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:
    import torch

    from miles_core.types import Group


@overload
def grpo_advantages(
    rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor: ...


@overload
def grpo_advantages(
    rewards: Sequence[Sequence[float | None]], normalize_std: bool = True, eps: float = 1e-6
) -> list[list[float]]: ...


def grpo_advantages(rewards, normalize_std=True, eps=1e-6):
    """A[g, i] = (r[g, i] - mean_i r[g, i]) / (std_i r[g, i] + eps), population std; ``None`` -> 0."""
    if hasattr(rewards, "dim"):  # a tensor: every sample scored, groups of equal size
        centred = rewards - rewards.mean(dim=-1, keepdim=True)
        if not normalize_std:
            return centred
        return centred / (rewards.std(dim=-1, correction=0, keepdim=True) + eps)
    return [_group_advantages(group, normalize_std, eps) for group in rewards]


def _group_advantages(rewards: Sequence[float | None], normalize_std: bool, eps: float) -> list[float]:
    scored = [float(r) for r in rewards if r is not None]
    if not scored:
        return [0.0] * len(rewards)
    mean = sum(scored) / len(scored)
    scale = 1.0
    if normalize_std:
        std = math.sqrt(sum((r - mean) ** 2 for r in scored) / len(scored))
        scale = std + eps
    return [0.0 if r is None else (float(r) - mean) / scale for r in rewards]


def sample_advantages(groups: Sequence[Group], normalize_std: bool = True, eps: float = 1e-6) -> list[float]:
    """Per-sample GRPO advantages of ``groups``, flattened in ``types.flatten`` order."""
    per_group = grpo_advantages([g.rewards for g in groups], normalize_std, eps)
    return [a for group in per_group for a in group]
