"""Policy-gradient loss math: pure functions on tensors, masks always explicit.

Parts:
- ``token_logprobs_and_entropy`` (and ``token_logprobs`` / ``entropy_from_logits``): per-token
  quantities from logits, computed over chunks of tokens with a backward of their own, so a 49k
  vocabulary never costs more full-vocabulary tensors of the whole micro-batch than its logits and
  their gradient.
- ``reduce_tokens`` / ``reducer_denominator``: how a ``[B, T]`` tensor of token values becomes one
  number (``token_mean``, ``seq_mean`` or ``seq_sum``), with an optional external denominator so that micro-batch
  pieces of a minibatch add up to exactly the minibatch's value (gradient accumulation).
- Policy losses, one pure function each, on top of ``clipped_surrogate`` (PPO clip, optional dual
  clip): ``ppo_clip_loss`` (per-token ratio; GRPO and REINFORCE++), ``dr_grpo_loss`` (token sums
  over a constant length) and ``gspo_loss`` (one ratio per sequence). Each returns its diagnostics
  and takes an optional per-token weight (the rollout correction below). ``setup_policy_loss(cfg)``
  picks one by ``cfg.type`` (``miles_core.config.LossConfig``) and binds its settings.
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
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

if TYPE_CHECKING:
    from miles_core.config import LossConfig

Reducer = Literal["token_mean", "seq_mean", "seq_sum"]
KLKind = Literal["k1", "k2", "k3"]
ISMode = Literal["truncate", "mask"]


CHUNK_ELEMENTS = 1 << 24
"""Logits a chunk of tokens spans (tokens x vocabulary): 64 MB of fp32 for each temporary of a chunk
(341 tokens of a 49,152-token vocabulary)."""


def token_logprobs_and_entropy(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Per token of ``logits`` [..., V] (any float dtype) at temperature T (T <= 0 means 1), in fp32:
    logp = log_softmax(z)[label] and H = -sum_v p_v log p_v, z = logits / T.

    Memory at the floor: the work runs over chunks of ``CHUNK_ELEMENTS`` logits, so no full-vocabulary
    temporary of the whole batch is made (the plain formulas make five: the fp32 copy, z, exp, log_softmax,
    p log p), and autograd keeps the caller's logits and one number per token, not a softmax. The
    backward recomputes each chunk's softmax and writes d/dlogits once:
    dlogp/dz = onehot(label) - p, dH/dz = -p (log p + H), each divided by T."""
    return _LogprobEntropy.apply(logits, labels, 1.0 / (temperature if temperature > 0 else 1.0))


def token_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """logp[b, t] = log_softmax(logits[b, t] / T)[labels[b, t]], in fp32 (``token_logprobs_and_entropy``)."""
    return token_logprobs_and_entropy(logits, labels, temperature)[0]


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H[b, t] = -sum_v p_v log p_v with p = softmax(logits[b, t]), in fp32 (``token_logprobs_and_entropy``)."""
    return token_logprobs_and_entropy(logits, torch.zeros(logits.shape[:-1], dtype=torch.long,
                                                          device=logits.device))[1]


def _chunks(rows: int, vocab: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    return [(s, min(s + step, rows)) for s in range(0, rows, step)]


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, inv_t: float) -> tuple[Tensor, Tensor]:
        vocab = logits.shape[-1]
        flat, flat_labels = logits.reshape(-1, vocab), labels.reshape(-1, 1)
        logp = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        entropy, lse = torch.empty_like(logp), torch.empty_like(logp)
        for s, e in _chunks(flat.shape[0], vocab):
            z = flat[s:e].float() * inv_t  # a new tensor: .float() of fp32 logits is the logits themselves
            lse[s:e] = torch.logsumexp(z, dim=-1)
            log_p = z.sub_(lse[s:e, None])
            logp[s:e] = log_p.gather(-1, flat_labels[s:e]).squeeze(-1)
            entropy[s:e] = -(log_p.exp() * log_p).sum(-1)  # not lse - sum p z: that cancels digits away
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.inv_t = inv_t
        ctx.set_materialize_grads(False)  # an output nobody differentiates comes back as None: its term is skipped
        return logp.view(labels.shape), entropy.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        logits, labels, lse, entropy = ctx.saved_tensors
        vocab, inv_t = logits.shape[-1], ctx.inv_t
        flat, flat_labels = logits.reshape(-1, vocab), labels.reshape(-1, 1)
        g_lp = None if grad_logp is None else grad_logp.reshape(-1, 1).float()
        g_h = None if grad_entropy is None else grad_entropy.reshape(-1, 1).float()
        grad = torch.empty_like(flat)
        for s, e in _chunks(flat.shape[0], vocab):
            log_p = (flat[s:e].float() * inv_t).sub_(lse[s:e, None])
            p = log_p.exp()
            if g_h is not None:  # dH/dz = -p (log p + H)
                g = log_p.add_(entropy[s:e, None]).mul_(p).mul_(-g_h[s:e])
            else:
                g = torch.zeros_like(p)
            if g_lp is not None:  # dlogp/dz = onehot - p
                g.sub_(p.mul_(g_lp[s:e]))
                g.scatter_add_(-1, flat_labels[s:e], g_lp[s:e])
            grad[s:e] = g.mul_(inv_t)
        return grad.view_as(logits), None, None


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
    # mean over sequences (those with at least one masked token) of their token sums (Dr.GRPO)
    "seq_sum": _ReducerMath(_token_sum, lambda mask: (mask.sum(dim=-1) > 0).sum()),
}


def _reducer(name: str) -> _ReducerMath:
    try:
        return _REDUCERS[name]
    except KeyError:
        raise ValueError(f"unknown loss reducer {name!r}; expected one of {sorted(_REDUCERS)}") from None


def reducer_denominator(mask: Tensor, reducer: Reducer) -> float:
    """token_mean: sum(mask); seq_mean and seq_sum: number of sequences with sum_t mask > 0."""
    return float(_reducer(reducer).denominator(mask.float()))


def reduce_tokens(values: Tensor, mask: Tensor, reducer: Reducer, denom: float | None = None) -> Tensor:
    """token_mean, seq_sum: sum(v m) / D; seq_mean: sum_b [sum_t v m / sum_t m] / D; D = denom or own denominator.

    Passing the denominator of a whole minibatch makes the values of its micro-batches sum to the
    minibatch value. An empty mask gives 0 (the denominator is clamped to at least 1)."""
    mask = mask.to(values.dtype)
    math = _reducer(reducer)
    numerator = math.numerator(values, mask)
    if denom is None:
        return numerator / math.denominator(mask).clamp(min=1)
    return numerator / max(float(denom), 1.0)


# ------------------------------------------------------------------------------------------ loss


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float, eps_clip_c: float | None = None
) -> tuple[Tensor, Tensor]:
    """l = max(-A r, -A clip(r, 1 - eps, 1 + eps_high)); dual clip: l = min(l, c |A|) where A < 0.

    Returns ``(l, clipped)`` where ``clipped`` is 1 where a clip (either) is in force. The dual clip
    (Ye et al. 2020, verl's ``clip_ratio_c``) bounds the loss of a negative-advantage token whose
    ratio has grown large, which the plain max leaves unbounded."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    in_force = clipped > unclipped
    if eps_clip_c is not None:
        dual = torch.minimum(loss, -advantages * eps_clip_c)
        dual_in_force = (advantages < 0) & (dual < loss)
        loss = torch.where(advantages < 0, dual, loss)
        in_force = in_force | dual_in_force
    return loss, in_force.to(loss.dtype)


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
    eps_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """loss = reduce(w clipped_surrogate(r, A)), r = exp(logp - old_logp) per token, w = weights or 1.

    ``weights`` (``[B, T]``, no gradient) are the rollout-correction weights of
    ``rollout_correction``; they scale each token's loss and are constants of the minibatch, so
    micro-batch pieces still add up to the minibatch loss. Metrics (detached, reduced like the
    loss, so micro-batch values add up too, and unweighted): ``clipfrac`` (share of tokens where
    a clip is in force), ``ratio_mean``, ``ratio_dev`` (mean |r - 1|, how far the policy
    has moved from ``old_logprobs`` on these tokens) and ``approx_kl`` (0.5 (logp - old_logp)^2,
    the k2 estimate of KL(old || new))."""
    log_ratio = logprobs - old_logprobs
    return _surrogate_loss(torch.exp(log_ratio), log_ratio, advantages, mask, eps_clip, eps_clip_high,
                           eps_clip_c, reducer, denom, weights)


def dr_grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    max_len: int,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    denom: float | None = None,
    weights: Tensor | None = None,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """loss = (1 / S) sum_b sum_t m w clipped_surrogate(r, A) / max_len, S = sequences with a trained token.

    Dr.GRPO (Liu et al. 2025): no 1 / |o_b| per sequence, so long and short answers weigh the same
    per token. ``denom`` is S of the minibatch (reducer ``seq_sum``). The metrics are reduced the
    same way, so ``clipfrac`` is clipped tokens per ``max_len`` token budget."""
    loss, metrics = ppo_clip_loss(logprobs, old_logprobs, advantages, mask, eps_clip, eps_clip_high, "seq_sum",
                                  denom, weights, eps_clip_c)
    return loss / max_len, {k: v / max_len for k, v in metrics.items()}


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log s[b] = sum_t m (logp - old_logp) / sum_t m, ``[B]`` (0 for a sequence with no trained token)."""
    mask = mask.to(logprobs.dtype)
    return ((logprobs - old_logprobs) * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_clip: float = 3e-4,
    eps_clip_high: float | None = 4e-4,
    denom: float | None = None,
    weights: Tensor | None = None,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """loss = mean_b clipped_surrogate(s_b, A_b), s_b = exp(min(mean_t (logp - old_logp), 10)) over b's
    trained tokens (the cap: ``GSPO_MAX_LOG_RATIO``).

    GSPO (Zheng et al. 2025): one ratio per sequence, clipped per sequence. The sequence loss is
    spread over its tokens and reduced by ``seq_mean`` (``denom``: sequences of the minibatch), which
    gives exactly the mean over sequences; ``weights`` still scale tokens. Metrics are per sequence
    (``ratio_*``, ``clipfrac``) except ``approx_kl`` (per token)."""
    log_ratio = torch.clamp(sequence_log_ratio(logprobs, old_logprobs, mask), max=GSPO_MAX_LOG_RATIO)
    log_ratio = log_ratio.unsqueeze(-1).expand_as(logprobs)
    return _surrogate_loss(torch.exp(log_ratio), logprobs - old_logprobs, advantages, mask, eps_clip,
                           eps_clip_high, eps_clip_c, "seq_mean", denom, weights)


def _surrogate_loss(
    ratio: Tensor,
    token_log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_clip: float,
    eps_clip_high: float | None,
    eps_clip_c: float | None,
    reducer: Reducer,
    denom: float | None,
    weights: Tensor | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    high = eps_clip if eps_clip_high is None else eps_clip_high
    if advantages.dim() == ratio.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    per_token, clipped = clipped_surrogate(ratio, advantages, eps_clip, high, eps_clip_c)
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = reduce_tokens(per_token, mask, reducer, denom)
    with torch.no_grad():
        metrics = {
            "clipfrac": reduce_tokens(clipped, mask, reducer, denom),
            "ratio_mean": reduce_tokens(ratio.detach(), mask, reducer, denom),
            "ratio_dev": reduce_tokens((ratio.detach() - 1.0).abs(), mask, reducer, denom),
            "approx_kl": reduce_tokens(0.5 * token_log_ratio.detach() ** 2, mask, reducer, denom),
        }
    return loss, metrics


# ------------------------------------------------------------------------------- loss registry

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
"""``fn(logprobs, old_logprobs, advantages, mask, denom=..., weights=...) -> (loss, metrics)``."""


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss with its settings bound, and the reducer whose denominator it expects."""

    fn: PolicyLossFn
    reducer: Reducer


def _ppo_clip(cfg: Any) -> PolicyLoss:
    clip = dict(eps_clip=cfg.eps_clip, eps_clip_high=cfg.clip_high, eps_clip_c=cfg.eps_clip_c)
    return PolicyLoss(partial(ppo_clip_loss, reducer=cfg.reducer, **clip), cfg.reducer)


def _dr_grpo(cfg: Any) -> PolicyLoss:
    if cfg.max_len is None:
        raise ValueError("train.loss.max_len is None: set it (a RunConfig fills it from rollout.rollout_max_response_len)")
    fn = partial(dr_grpo_loss, max_len=cfg.max_len, eps_clip=cfg.eps_clip, eps_clip_high=cfg.clip_high,
                 eps_clip_c=cfg.eps_clip_c)
    return PolicyLoss(fn, "seq_sum")


def _gspo(cfg: Any) -> PolicyLoss:
    fn = partial(gspo_loss, eps_clip=cfg.eps_clip, eps_clip_high=cfg.clip_high, eps_clip_c=cfg.eps_clip_c)
    return PolicyLoss(fn, "seq_mean")


_POLICY_LOSSES: dict[str, Callable[[Any], PolicyLoss]] = {
    "grpo": _ppo_clip,
    "dr_grpo": _dr_grpo,
    "gspo": _gspo,
    "reinforce_plus_plus": _ppo_clip,
    "reinforce_plus_plus_baseline": _ppo_clip,
}


def setup_policy_loss(cfg: LossConfig) -> PolicyLoss:
    """The policy loss ``cfg.type`` names (``miles_core.config.LossConfig``), its settings bound."""
    try:
        build = _POLICY_LOSSES[cfg.type]
    except KeyError:
        raise ValueError(f"unknown loss type {cfg.type!r}; expected one of {sorted(_POLICY_LOSSES)}") from None
    return build(cfg)


def _k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs


def _k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return 0.5 * (logprobs - ref_logprobs) ** 2


K3_LOG_RATIO_BOUND = 20.0
K3_MAX = 10.0
GSPO_MAX_LOG_RATIO = 10.0
"""Overflow guards, as the reference implementations have them: k3's log-ratio is clamped to
[-20, 20] and its value to at most 10; GSPO's sequence log-ratio to at most 10 (exp(25) would
overflow what the surrogate and its gradient can hold; the clamped tokens train nothing)."""


def _k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    log_r = torch.clamp(ref_logprobs - logprobs, -K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return torch.clamp(torch.exp(log_r) - 1.0 - log_r, max=K3_MAX)


_KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per token, with log r = ref_logp - logp: k1 = -log r, k2 = 0.5 (log r)^2, k3 = (r - 1) - log r
    (log r clamped to [-20, 20], k3 to at most 10: ``K3_LOG_RATIO_BOUND``, ``K3_MAX``).

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
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, correction: RolloutCorrection | None = None,
    denom: float | None = None,
) -> dict[str, Tensor]:
    """Token means over ``mask`` with d = old - rollout: mismatch_kl = mean(e^d - 1 - d), abs_diff = mean |d|.

    ``mismatch_kl`` is the k3 estimate of KL(mu || pi_old) (tokens are sampled from the rollout
    policy mu): 0 when the logprobs agree, positive otherwise. ``train_rollout_logprob_abs_diff`` is
    mean |d|. With a correction: ``tis_weight_mean`` (mean applied weight, rejected tokens counting
    0) and ``tis_clipfrac`` (share of tokens truncated or rejected). Tokens outside ``mask`` never
    enter, whatever their values. ``denom``: the token count of the whole batch, so that the values
    of its micro-batches sum to the batch's (as ``reduce_tokens``)."""
    mask = mask.to(old_logprobs.dtype)
    d = torch.where(mask > 0, old_logprobs.detach() - rollout_logprobs.detach(), torch.zeros_like(old_logprobs))
    metrics = {
        "mismatch_kl": reduce_tokens(torch.exp(d) - 1.0 - d, mask, "token_mean", denom),
        "train_rollout_logprob_abs_diff": reduce_tokens(d.abs(), mask, "token_mean", denom),
    }
    if correction is not None:
        metrics["tis_weight_mean"] = reduce_tokens(correction.weights, mask, "token_mean", denom)
        metrics["tis_clipfrac"] = reduce_tokens(correction.corrected, mask, "token_mean", denom)
    return metrics
