"""Policy-gradient loss math: pure functions on tensors, masks always explicit.

Parts:
- ``token_logprobs`` / ``entropy_from_logits``: per-token quantities from logits.
- ``reduce_tokens`` / ``reducer_denominator``: how a ``[B, T]`` tensor of token values becomes one
  number (``token_mean`` or ``seq_mean``), with an optional external denominator so that micro-batch
  pieces of a minibatch add up to exactly the minibatch's value (gradient accumulation).
- ``ppo_clip_loss``: the clipped surrogate objective (PPO / GRPO), with its diagnostics and an
  optional per-token weight (the rollout correction below).
- ``kl_penalty``: Schulman's k1 / k2 / k3 estimators of KL(pi || pi_ref), per token.
- Rollout correction (off-policy samples): ``truncated_is_weights`` (TIS) and ``masked_is_weights``
  (MIS: ratio-band rejection), both behind ``rollout_correction(mode, ...)``, and
  ``mismatch_metrics`` (how far the trainer's logprobs are from the rollout engine's).

Shapes: ``logprobs``, ``old_logprobs``, ``ref_logprobs`` and ``mask`` are ``[B, T]``; advantages
are ``[B]`` (one per sequence, broadcast over its tokens) or ``[B, T]``. ``mask`` is 1 on tokens
that are trained and 0 elsewhere (prompt, padding, tool output, failed samples).

Three policies meet in the rollout correction: the rollout engine's mu (``rollout_logprobs``, the
weights that sampled the tokens, possibly several versions old), the trainer's weights before the
update pi_old (``old_logprobs``, recomputed) and the policy being trained pi (``logprobs``). The
PPO ratio pi / pi_old keeps the update close to pi_old; the importance weight pi_old / mu corrects
for the tokens having been sampled from mu, not pi_old.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Reducer = Literal["token_mean", "seq_mean"]
KLKind = Literal["k1", "k2", "k3"]
ISMode = Literal["truncate", "mask"]


def token_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """logp[b, t] = log_softmax(logits[b, t] / T)[labels[b, t]], computed in fp32; T <= 0 means T = 1."""
    scale = temperature if temperature > 0 else 1.0
    z = logits.float() / scale
    return z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H[b, t] = -sum_v p_v log p_v with p = softmax(logits[b, t]), computed in fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


# -------------------------------------------------------------------------------------- reducers


@dataclass(frozen=True)
class _ReducerMath:
    numerator: Callable[[Tensor, Tensor], Tensor]
    denominator: Callable[[Tensor], Tensor]


def _token_sum(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum()


def _sum_of_sequence_means(values: Tensor, mask: Tensor) -> Tensor:
    per_seq_tokens = mask.sum(dim=-1)
    return ((values * mask).sum(dim=-1) / per_seq_tokens.clamp(min=1)).sum()


_REDUCERS: dict[str, _ReducerMath] = {
    # sum over all masked tokens / number of masked tokens
    "token_mean": _ReducerMath(_token_sum, lambda mask: mask.sum()),
    # mean over sequences (those with at least one masked token) of their token means
    "seq_mean": _ReducerMath(_sum_of_sequence_means, lambda mask: (mask.sum(dim=-1) > 0).sum()),
}


def _reducer(name: str) -> _ReducerMath:
    try:
        return _REDUCERS[name]
    except KeyError:
        raise ValueError(f"unknown loss reducer {name!r}; expected one of {sorted(_REDUCERS)}") from None


def reducer_denominator(mask: Tensor, reducer: Reducer) -> float:
    """token_mean: sum(mask); seq_mean: number of sequences with sum_t mask > 0."""
    return float(_reducer(reducer).denominator(mask.float()))


def reduce_tokens(values: Tensor, mask: Tensor, reducer: Reducer, denom: float | None = None) -> Tensor:
    """token_mean: sum(v m) / D; seq_mean: sum_b [sum_t v m / sum_t m] / D; D = denom or own denominator.

    Passing the denominator of a whole minibatch makes the values of its micro-batches sum to the
    minibatch value. An empty mask gives 0 (the denominator is clamped to at least 1)."""
    mask = mask.to(values.dtype)
    math = _reducer(reducer)
    numerator = math.numerator(values, mask)
    if denom is None:
        return numerator / math.denominator(mask).clamp(min=1)
    return numerator / max(float(denom), 1.0)


# ------------------------------------------------------------------------------------------ loss


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    reducer: Reducer = "token_mean",
    denom: float | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """loss = reduce(w max(-A r, -A clip(r, 1 - eps, 1 + eps_high))), r = exp(logp - old_logp), w = weights or 1.

    ``weights`` (``[B, T]``, no gradient) are the rollout-correction weights of
    ``rollout_correction``; they scale each token's loss and are constants of the minibatch, so
    micro-batch pieces still add up to the minibatch loss. Metrics (detached, reduced like the
    loss, so micro-batch values add up too, and unweighted): ``clipfrac`` (share of tokens where
    the clipped term is in force), ``ratio_mean``, ``ratio_dev`` (mean |r - 1|, how far the policy
    has moved from ``old_logprobs`` on these tokens) and ``approx_kl`` (0.5 (logp - old_logp)^2,
    the k2 estimate of KL(old || new))."""
    high = eps_clip if eps_clip_high is None else eps_clip_high
    if advantages.dim() == logprobs.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = reduce_tokens(per_token, mask, reducer, denom)
    with torch.no_grad():
        metrics = {
            "clipfrac": reduce_tokens((clipped > unclipped).to(per_token.dtype), mask, reducer, denom),
            "ratio_mean": reduce_tokens(ratio.detach(), mask, reducer, denom),
            "ratio_dev": reduce_tokens((ratio.detach() - 1.0).abs(), mask, reducer, denom),
            "approx_kl": reduce_tokens(0.5 * log_ratio.detach() ** 2, mask, reducer, denom),
        }
    return loss, metrics


def _k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs


def _k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return 0.5 * (logprobs - ref_logprobs) ** 2


def _k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    log_r = ref_logprobs - logprobs
    return torch.exp(log_r) - 1.0 - log_r


_KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per token, with log r = ref_logp - logp: k1 = -log r, k2 = 0.5 (log r)^2, k3 = (r - 1) - log r.

    Tokens are sampled from pi, so each estimates KL(pi || pi_ref): k1 unbiased (can be negative),
    k2 biased, low variance, k3 unbiased and never negative."""
    try:
        estimator = _KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {sorted(_KL_ESTIMATORS)}") from None
    return estimator(logprobs, ref_logprobs)


# ---------------------------------------------------------------------------- rollout correction


@dataclass(frozen=True)
class RolloutCorrection:
    """Per-token rollout correction, ``[B, T]`` each, all without gradient."""

    weights: Tensor
    """Multiplies each token's policy-gradient loss (``ppo_clip_loss(weights=...)``)."""
    keep: Tensor
    """1 where the token is still trained, 0 where it is rejected (mask mode); multiply the loss
    mask by it *before* taking denominators, so rejected tokens leave the denominator too."""
    corrected: Tensor
    """1 where the weight is not the raw ratio exp(old - rollout): truncated, or rejected."""


def truncated_is_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, clip: float, clip_low: float = 0.0) -> Tensor:
    """TIS: w_t = clamp(exp(old_t - rollout_t), clip_low, clip), i.e. min(rho_t, C) when clip_low is 0; detached."""
    return torch.clamp(torch.exp(old_logprobs.detach() - rollout_logprobs.detach()), min=clip_low, max=clip)


def masked_is_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """MIS: rho_t = exp(old_t - rollout_t); keep_t = [low <= rho_t <= high]; w_t = rho_t keep_t; detached.

    Returns ``(weights, keep)``. A rejected token gets weight 0, and ``keep`` lets the caller drop it
    from the loss mask as well (rejection sampling: the token counts as never sampled)."""
    rho = torch.exp(old_logprobs.detach() - rollout_logprobs.detach())
    keep = ((rho >= low) & (rho <= high)).to(rho.dtype)
    return torch.where(keep > 0, rho, torch.zeros_like(rho)), keep


def _truncate(old: Tensor, rollout: Tensor, clip: float, clip_low: float) -> RolloutCorrection:
    weights = truncated_is_weights(old, rollout, clip, clip_low)
    rho = torch.exp(old.detach() - rollout.detach())
    return RolloutCorrection(weights, torch.ones_like(weights), (weights != rho).to(weights.dtype))


def _mask(old: Tensor, rollout: Tensor, clip: float, clip_low: float) -> RolloutCorrection:
    weights, keep = masked_is_weights(old, rollout, clip_low, clip)
    return RolloutCorrection(weights, keep, 1.0 - keep)


_IS_MODES: dict[str, Callable[[Tensor, Tensor, float, float], RolloutCorrection]] = {
    "truncate": _truncate,
    "mask": _mask,
}


def rollout_correction(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mode: ISMode, clip: float, clip_low: float = 0.0
) -> RolloutCorrection:
    """truncate: w = clamp(rho, clip_low, clip), every token kept; mask: w = rho on tokens with
    clip_low <= rho <= clip, others rejected; rho = exp(old_logprobs - rollout_logprobs)."""
    try:
        correct = _IS_MODES[mode]
    except KeyError:
        raise ValueError(f"unknown rollout correction mode {mode!r}; expected one of {sorted(_IS_MODES)}") from None
    return correct(old_logprobs, rollout_logprobs, clip, clip_low)


def mismatch_metrics(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, correction: RolloutCorrection | None = None
) -> dict[str, Tensor]:
    """Token means over ``mask`` with d = old - rollout: mismatch_kl = mean(e^d - 1 - d), abs_diff = mean |d|.

    ``mismatch_kl`` is the k3 estimate of KL(mu || pi_old) (tokens are sampled from the rollout
    policy mu): 0 when the logprobs agree, positive otherwise. ``train_rollout_logprob_abs_diff`` is
    mean |d|. With a correction: ``tis_weight_mean`` (mean applied weight, rejected tokens counting
    0) and ``tis_clipfrac`` (share of tokens truncated or rejected). Tokens outside ``mask`` never
    enter, whatever their values."""
    mask = mask.to(old_logprobs.dtype)
    d = torch.where(mask > 0, old_logprobs.detach() - rollout_logprobs.detach(), torch.zeros_like(old_logprobs))
    metrics = {
        "mismatch_kl": reduce_tokens(torch.exp(d) - 1.0 - d, mask, "token_mean"),
        "train_rollout_logprob_abs_diff": reduce_tokens(d.abs(), mask, "token_mean"),
    }
    if correction is not None:
        metrics["tis_weight_mean"] = reduce_tokens(correction.weights, mask, "token_mean")
        metrics["tis_clipfrac"] = reduce_tokens(correction.corrected, mask, "token_mean")
    return metrics
