"""The loss functions the Tinker SDK names, on one datum's per-token logprobs.

Tinker's losses are token sums with no normalisation (its docs, "Loss functions"); each datum's
``logprobs`` are the learner's log-probabilities of its ``target_tokens`` (position i of the model
input predicts ``target_tokens[i]``), and every loss input has the length of the model input.

- ``cross_entropy``: inputs ``target_tokens``, ``weights``; ``loss = -sum(logprobs * weights)``.
- ``importance_sampling``: inputs ``target_tokens``, ``logprobs`` (the sampler's, q), ``advantages``;
  ``ratio = exp(logprobs - q)``, ``loss = -sum(ratio * advantages)``.
- ``ppo``: the same inputs; ``loss = -sum(min(ratio * A, clip(ratio, low, high) * A))`` with
  ``low``/``high`` from ``loss_fn_config`` (``clip_low_threshold``, ``clip_high_threshold``; 0.8 and
  1.2 by default) or per token from the inputs of those names. That is our PPO surrogate
  (``miles_core.train.losses.clipped_surrogate``) with eps = 1 - low and eps_high = high - 1.

Other names (``cispo``, ``dro``, ``gspo``, ``stable_reinforce``, ``custom``) are refused with
``LossError`` naming the supported ones; ``forward_backward_custom`` works, since the SDK runs it as
two ``cross_entropy`` calls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from miles_core.train.losses import clipped_surrogate


class LossError(ValueError):
    """A loss the service does not compute, or inputs it cannot compute it on (the message says which)."""


def cross_entropy(logprobs: Tensor, inputs: dict[str, Tensor], config: dict) -> Tensor:
    return -(logprobs * inputs["weights"]).sum()


def importance_sampling(logprobs: Tensor, inputs: dict[str, Tensor], config: dict) -> Tensor:
    ratio = torch.exp(logprobs - inputs["logprobs"])
    return -(ratio * inputs["advantages"]).sum()


def ppo(logprobs: Tensor, inputs: dict[str, Tensor], config: dict) -> Tensor:
    ratio = torch.exp(logprobs - inputs["logprobs"])
    low = inputs.get("clip_low_threshold", float(config.get("clip_low_threshold", 0.8)))
    high = inputs.get("clip_high_threshold", float(config.get("clip_high_threshold", 1.2)))
    if isinstance(low, Tensor) or isinstance(high, Tensor):  # per-token thresholds: the formula itself
        clipped = torch.minimum(torch.maximum(ratio, torch.as_tensor(low)), torch.as_tensor(high))
        return -torch.minimum(ratio * inputs["advantages"], clipped * inputs["advantages"]).sum()
    loss, _ = clipped_surrogate(ratio, inputs["advantages"], 1.0 - low, high - 1.0)
    return loss.sum()


LOSSES: dict[str, tuple[Callable[[Tensor, dict[str, Tensor], dict], Tensor], tuple[str, ...]]] = {
    "cross_entropy": (cross_entropy, ("target_tokens", "weights")),
    "importance_sampling": (importance_sampling, ("target_tokens", "logprobs", "advantages")),
    "ppo": (ppo, ("target_tokens", "logprobs", "advantages")),
}


def check_inputs(loss_fn: str, datum_inputs: list[dict], tokens: list[int]) -> None:
    """Refuse an unknown loss, a missing input, or an input whose length is not the model input's."""
    if loss_fn not in LOSSES:
        raise LossError(f"loss_fn {loss_fn!r} is not supported by this service; supported: {sorted(LOSSES)} "
                        "(forward_backward_custom works too)")
    required = LOSSES[loss_fn][1]
    for i, (inputs, n) in enumerate(zip(datum_inputs, tokens, strict=True)):
        missing = [k for k in required if k not in inputs]
        if missing:
            raise LossError(f"datum {i}: loss {loss_fn!r} needs loss_fn_inputs {missing} (it has {sorted(inputs)})")
        for key, value in inputs.items():
            if value.ndim != 1:
                raise LossError(f"datum {i}: loss_fn_inputs[{key!r}] has shape {list(value.shape)}; this service "
                                "takes one value per token (top-k targets are not supported)")
            if len(value) != n:
                raise LossError(f"datum {i}: loss_fn_inputs[{key!r}] has {len(value)} values for a model input of "
                                f"{n} tokens (every loss input has the model input's length)")


def datum_loss(loss_fn: str, logprobs: Tensor, inputs: dict[str, Tensor], config: dict) -> Tensor:
    """One datum's loss (a scalar) from its per-token ``logprobs`` and its loss inputs."""
    return LOSSES[loss_fn][0](logprobs, inputs, config)
