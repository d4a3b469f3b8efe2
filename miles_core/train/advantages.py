"""Advantages: one number per sample, from the rewards of a batch of groups.

- ``grpo_advantages(rewards)``: a ``[groups, n]`` tensor, or a list of groups (lists may be ragged
  and may hold ``None``), to advantages of the same shape (GRPO; Dr.GRPO without the std).
- ``sample_advantages(groups)``: one advantage per sample, in the order of
  ``miles_core.types.flatten(groups)`` (the order a ``TrainBatch`` lists samples in).
- ``reinforce_pp_advantages(rewards, token_counts)``: REINFORCE++, rewards whitened over the batch.
- ``reinforce_pp_baseline_advantages(rewards, token_counts)``: REINFORCE++-baseline, group-centred
  rewards whitened over the batch.
- ``compute_advantages(loss_cfg, groups)``: the estimator the loss config's ``type`` names.

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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, overload

from miles_core.types import flatten

if TYPE_CHECKING:
    import torch

    from miles_core.config import LossConfig
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


def reinforce_pp_advantages(
    rewards: Sequence[float | None], token_counts: Sequence[int], eps: float = 1e-6
) -> list[float]:
    """A_i = (r_i - mu) / (sigma + eps), mu and sigma the mean and population std of the reward over
    every trained token of the batch (sample i counted token_counts[i] times); ``None`` -> 0.

    REINFORCE++ (Hu et al. 2025) with an outcome reward and no KL in the reward: each token's return
    is the sample's reward, and advantages are whitened over the whole batch (no group baseline, no
    critic). A sample with no trained token does not enter mu or sigma."""
    if len(rewards) != len(token_counts):
        raise ValueError(f"{len(rewards)} rewards but {len(token_counts)} token counts")
    scored = [(float(r), n) for r, n in zip(rewards, token_counts) if r is not None and n > 0]
    tokens = sum(n for _, n in scored)
    if not tokens:
        return [0.0] * len(rewards)
    mean = sum(r * n for r, n in scored) / tokens
    std = math.sqrt(sum(n * (r - mean) ** 2 for r, n in scored) / tokens)
    return [0.0 if r is None else (float(r) - mean) / (std + eps) for r in rewards]


def reinforce_pp_baseline_advantages(
    rewards: Sequence[Sequence[float | None]], token_counts: Sequence[Sequence[int]], eps: float = 1e-6
) -> list[list[float]]:
    """REINFORCE++-baseline: each reward minus its group's mean (over the group's scored samples),
    then ``reinforce_pp_advantages`` of those centred rewards (whitened over every trained token of
    the batch). Groups are lists, ragged and holding ``None`` as ``grpo_advantages`` takes them; the
    result has the same shape. The group baseline removes the prompt's difficulty; the batch
    whitening keeps the advantage scale steady across batches."""
    centred: list[float | None] = []
    for group in rewards:
        scored = [float(r) for r in group if r is not None]
        mean = sum(scored) / len(scored) if scored else 0.0
        centred.extend(None if r is None else float(r) - mean for r in group)
    flat = reinforce_pp_advantages(centred, [n for counts in token_counts for n in counts], eps)
    out, start = [], 0
    for group in rewards:
        out.append(flat[start : start + len(group)])
        start += len(group)
    return out


def _grpo(cfg: Any, groups: Sequence[Group]) -> list[float]:
    return sample_advantages(groups, cfg.advantage_std_normalize)


def _dr_grpo(cfg: Any, groups: Sequence[Group]) -> list[float]:
    return sample_advantages(groups, normalize_std=False)


def _reinforce_pp(cfg: Any, groups: Sequence[Group]) -> list[float]:
    samples = flatten(list(groups))
    return reinforce_pp_advantages([s.reward for s in samples], [sum(s.loss_mask) for s in samples])


def _reinforce_pp_baseline(cfg: Any, groups: Sequence[Group]) -> list[float]:
    per_group = reinforce_pp_baseline_advantages(
        [g.rewards for g in groups], [[sum(s.loss_mask) for s in g.samples] for g in groups]
    )
    return [a for group in per_group for a in group]


_ESTIMATORS: dict[str, Callable[[Any, Sequence[Group]], list[float]]] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "gspo": _grpo,
    "reinforce_plus_plus": _reinforce_pp,
    "reinforce_plus_plus_baseline": _reinforce_pp_baseline,
}


def compute_advantages(loss_cfg: LossConfig, groups: Sequence[Group]) -> list[float]:
    """Per-sample advantages for the loss ``loss_cfg.type`` names, in ``types.flatten`` order."""
    try:
        estimate = _ESTIMATORS[loss_cfg.type]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {loss_cfg.type!r}; expected one of {sorted(_ESTIMATORS)}") from None
    return estimate(loss_cfg, groups)
