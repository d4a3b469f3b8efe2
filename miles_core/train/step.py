"""The arithmetic of a trainer step over a ``TokenBatch``: no model, no optimizer, so every trainer
(``TorchTrainer``, ``DeepSpeedTrainer``, an ``AdapterBank``'s adapters) computes it the same way.

- ``correct_for_rollout``: the mismatch between recomputed and rollout logprobs and, with
  ``use_tis``, the importance weights (and rejected tokens), fixed before any update.
- ``kl_penalised_advantages``: with ``kl_coef``, the advantages again from R - kl_coef * KL.
- ``micro_batch_loss``: one micro-batch's share of the minibatch loss from its logits:
  policy loss + kl_loss_coef * KL(pi || pi_ref) - entropy_coef * H, all reduced the same way.
- ``summarize``: a step's metrics from its optimizer steps' sums.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from miles_core.train.losses import (
    PolicyLoss,
    kl_penalty,
    mismatch_metrics,
    reduce_tokens,
    rollout_correction,
    token_logprobs_and_entropy,
)

if TYPE_CHECKING:
    from miles_core.config import TrainConfig
    from miles_core.train.base import TrainBatch
    from miles_core.train.batch import TokenBatch

AVERAGED = ("loss", "pg_loss", "kl", "entropy", "clipfrac", "ratio_mean", "ratio_dev", "approx_kl", "grad_norm", "lr")
# averaged over the optimizer steps after the first one of a batch (its off-policy steps)
OFF_POLICY = {"offpolicy_ratio_dev": "ratio_dev", "offpolicy_clipfrac": "clipfrac"}
MISMATCH = ("mismatch_kl", "train_rollout_logprob_abs_diff", "tis_weight_mean", "tis_clipfrac")  # the last two with TIS


def correct_for_rollout(cfg: TrainConfig, tokens: TokenBatch) -> dict[str, float]:
    """Mismatch metrics between the recomputed (``tokens.old_logprobs``) and the rollout logprobs,
    over the trained tokens of the samples that carry rollout logprobs (none: no metrics). With
    ``use_tis``, attach the importance weights and drop rejected tokens from the loss mask, before
    any denominator."""
    mask = tokens.loss_mask * tokens.has_rollout_logprobs.unsqueeze(-1)
    if not mask.any():
        return {}
    correction = None
    if cfg.use_tis:
        correction = rollout_correction(
            tokens.old_logprobs, tokens.rollout_logprobs, cfg.tis_mode, cfg.tis_clip, cfg.tis_clip_low
        )
    metrics = mismatch_metrics(tokens.old_logprobs, tokens.rollout_logprobs, mask, correction)
    if correction is not None:
        tokens.is_weights = correction.weights
        tokens.loss_mask = tokens.loss_mask * correction.keep
    return {k: float(v) for k, v in metrics.items()}


def kl_penalised_advantages(cfg: TrainConfig, batch: TrainBatch, tokens: TokenBatch) -> dict[str, float]:
    """KL penalty in the reward: R' = R - kl_coef * sum_t KL_t over each sample's trained tokens
    (KL_t: the ``kl_type`` estimate of log pi_old - log pi_ref), then the loss's advantages of R'
    replace ``tokens.advantages``. Reports ``kl_reward_penalty``: the mean of kl_coef * sum_t KL_t
    over the scored samples."""
    from miles_core.train.advantages import compute_advantages

    seq_kl = (kl_penalty(tokens.old_logprobs, tokens.ref_logprobs, cfg.kl_type) * tokens.loss_mask).sum(-1)
    penalties = (cfg.kl_coef * seq_kl).tolist()
    rewards = [None if s.reward is None else s.reward - p for s, p in zip(batch.samples, penalties)]
    advantages = compute_advantages(cfg.loss, batch.regrouped(rewards))
    tokens.advantages = torch.tensor(advantages, dtype=torch.float32, device=tokens.advantages.device)
    scored = [p for s, p in zip(batch.samples, penalties) if s.reward is not None]
    return {"kl_reward_penalty": mean(scored)}


def micro_batch_loss(cfg: TrainConfig, policy_loss: PolicyLoss, mb: TokenBatch, logits: Tensor, denom: float,
                     temperature: float, mismatch_denom: float | None) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the minibatch loss (divided by the minibatch's ``denom``) from
    its raw logits (the policy's) and the batch's temperature, and its metrics.

    One pass (``mb.old_logprobs`` is None): this pass's detached logprobs are the denominator, and
    with ``use_tis`` (truncate) the importance weights too; with ``mismatch_denom`` (the batch's
    tokens that carry rollout logprobs) the mismatch metrics are this micro-batch's share."""
    reducer = policy_loss.reducer
    logprobs, token_entropy = token_logprobs_and_entropy(logits, mb.labels, temperature)
    old_logprobs, weights, correction = mb.old_logprobs, mb.is_weights, None
    if old_logprobs is None:  # one pass: this pass's logprobs are the denominator
        old_logprobs = logprobs.detach()
        if cfg.use_tis:  # truncate: per-token weights of these logprobs, every token kept (no denominator change)
            correction = rollout_correction(old_logprobs, mb.rollout_logprobs, cfg.tis_mode, cfg.tis_clip,
                                            cfg.tis_clip_low)
            weights = correction.weights
    pg_loss, metrics = policy_loss.fn(logprobs, old_logprobs, mb.advantages, mb.loss_mask, denom=denom, weights=weights)
    if mb.old_logprobs is None and mismatch_denom:  # this micro-batch's share of the batch's
        mask = mb.loss_mask * mb.has_rollout_logprobs.unsqueeze(-1)
        metrics.update(mismatch_metrics(old_logprobs, mb.rollout_logprobs, mask, correction, denom=mismatch_denom))
    loss = pg_loss
    kl = torch.zeros(())
    if mb.ref_logprobs is not None:
        kl = reduce_tokens(kl_penalty(logprobs, mb.ref_logprobs, cfg.kl_type), mb.loss_mask, reducer, denom)
    if cfg.kl_loss_coef > 0:
        loss = loss + cfg.kl_loss_coef * kl
    # the entropy's term of the backward is computed only when it is part of the loss
    entropy = reduce_tokens(token_entropy if cfg.entropy_coef > 0 else token_entropy.detach(), mb.loss_mask,
                            reducer, denom)
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * entropy
    metrics.update(loss=loss.detach(), pg_loss=pg_loss.detach(), kl=kl.detach(), entropy=entropy.detach())
    return loss, metrics


def summarize(batch: TrainBatch, tokens: TokenBatch, correction_metrics: dict[str, float],
              results: list[dict[str, float] | None], one_pass_mismatch: bool, version: int) -> dict[str, float]:
    """A step's metrics from its optimizer steps' results (None: a minibatch with nothing to train;
    ``{"nonfinite": 1.0}``: a step not taken); ``one_pass_mismatch``: the mismatch metrics were
    summed over the loss pass's micro-batches (the first step's sums are the batch's)."""
    per_step = [m for m in results if m is not None and "nonfinite" not in m]
    nonfinite = sum(1 for m in results if m is not None and "nonfinite" in m)
    summary = {k: mean(m[k] for m in per_step) for k in AVERAGED}
    if len(per_step) > 1:
        summary.update({name: mean(m[k] for m in per_step[1:]) for name, k in OFF_POLICY.items()})
    summary.update(correction_metrics)
    if one_pass_mismatch and per_step:  # one pass: the micro-batches' shares, summed
        summary.update({k: per_step[0][k] for k in MISMATCH if k in per_step[0]})
    excluded = sum(1 for s in batch.samples if s.reward is None)
    summary.update(
        num_optimizer_steps=float(len(per_step)),
        num_nonfinite_steps=float(nonfinite),
        train_tokens=float(tokens.loss_mask.sum()),
        num_samples=float(tokens.num_rows),
        num_excluded_samples=float(excluded),
        version=float(version),
    )
    return summary


def mean(values: Iterable[float]) -> float:
    """The mean; NaN for none."""
    values = list(values)
    return sum(values) / len(values) if values else math.nan
