"""Policy-gradient loss math: pure functions on tensors, masks always explicit.

Parts:
- ``token_logprobs`` / ``entropy_from_logits``: per-token quantities from logits.
- ``reduce_tokens`` / ``reducer_denominator``: how a ``[B, T]`` tensor of token values becomes one
  number (``token_mean`` or ``seq_mean``), with an optional external denominator so that micro-batch
  pieces of a minibatch add up to exactly the minibatch's value (gradient accumulation).
- ``ppo_clip_loss``: the clipped surrogate objective (PPO / GRPO), with its diagnostics.
- ``kl_penalty``: Schulman's k1 / k2 / k3 estimators of KL(pi || pi_ref), per token.

Shapes: ``logprobs``, ``old_logprobs``, ``ref_logprobs`` and ``mask`` are ``[B, T]``; advantages
are ``[B]`` (one per sequence, broadcast over its tokens) or ``[B, T]``. ``mask`` is 1 on tokens
that are trained and 0 elsewhere (prompt, padding, tool output, failed samples).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Reducer = Literal["token_mean", "seq_mean"]
KLKind = Literal["k1", "k2", "k3"]


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
) -> tuple[Tensor, dict[str, Tensor]]:
    """loss = reduce(max(-A r, -A clip(r, 1 - eps, 1 + eps_high))), r = exp(logp - old_logp).

    Metrics (detached, reduced like the loss, so micro-batch values add up too): ``clipfrac``
    (share of tokens where the clipped term is in force), ``ratio_mean`` and ``approx_kl``
    (0.5 (logp - old_logp)^2, the k2 estimate of KL(old || new))."""
    high = eps_clip if eps_clip_high is None else eps_clip_high
    if advantages.dim() == logprobs.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    loss = reduce_tokens(per_token, mask, reducer, denom)
    with torch.no_grad():
        metrics = {
            "clipfrac": reduce_tokens((clipped > unclipped).to(per_token.dtype), mask, reducer, denom),
            "ratio_mean": reduce_tokens(ratio.detach(), mask, reducer, denom),
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
