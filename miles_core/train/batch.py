"""Samples -> padded tensors for a causal-LM forward pass, aligned for next-token prediction.

Layout (``collate``): each row is ``prompt_ids + response_ids``, RIGHT-padded to the longest row.
Right padding keeps position p of every row at position id p, and a causal model never lets a real
token see the padding after it, so padding does not change the logits of real tokens.

Every per-token tensor is aligned with the *logits*: column p holds what the logits at position p
predict, the token at p + 1. So response token j of sample i (``response_ids[j]``) is
``labels[i, len(prompt_ids) + j - 1]``, and its mask and rollout logprob sit in the same column.
The last column predicts nothing (mask 0).

A sample whose reward is None (a failed sample, see ``advantages``) keeps its row but gets a zero
loss mask, so it adds nothing to any loss, KL term or token count.

``TokenBatch.select(rows)`` takes a subset of rows (a minibatch or micro-batch), trimmed to its own
longest row; per-row and per-token tensors the trainer attaches (advantages, old / reference
logprobs, rollout-correction weights) ride along.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from miles_core.types import Sample


@dataclass
class TokenBatch:
    input_ids: Tensor
    """[B, L] prompt + response ids, right-padded."""
    attention_mask: Tensor
    """[B, L] 1 on real tokens."""
    position_ids: Tensor
    """[B, L] 0..L-1 on every row."""
    labels: Tensor
    """[B, L] labels[:, p] = input_ids[:, p + 1] (pad in the last column)."""
    loss_mask: Tensor
    """[B, L] float: 1 where labels[:, p] is a response token trained on."""
    rollout_logprobs: Tensor
    """[B, L] the engine's logprob of labels[:, p] (0 where unknown)."""
    lengths: Tensor
    """[B] real tokens per row."""
    advantages: Tensor | None = None
    """[B] one advantage per row."""
    old_logprobs: Tensor | None = None
    """[B, L] PPO ratio denominator, aligned like labels."""
    ref_logprobs: Tensor | None = None
    """[B, L] reference-policy logprobs, aligned like labels."""
    is_weights: Tensor | None = None
    """[B, L] rollout-correction weight of each token's policy-gradient loss (None: weight 1)."""

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: Tensor) -> TokenBatch:
        """The given rows, trimmed to the longest of them."""
        width = int(self.lengths[rows].max()) if len(rows) else 0
        picked = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                picked[f.name] = None
            elif value.dim() == 2:
                picked[f.name] = value[rows, :width]
            else:
                picked[f.name] = value[rows]
        return TokenBatch(**picked)

    def to(self, device: torch.device | str) -> TokenBatch:
        return TokenBatch(
            **{f.name: None if (v := getattr(self, f.name)) is None else v.to(device) for f in dataclasses.fields(self)}
        )


def _check_sample(i: int, s: Sample) -> None:
    if not s.prompt_ids:
        raise ValueError(f"sample {i} has no prompt tokens; its first response token would have no logits")
    if len(s.loss_mask) != len(s.response_ids):
        raise ValueError(
            f"sample {i}: loss_mask has {len(s.loss_mask)} entries for {len(s.response_ids)} response "
            "tokens (set one 0/1 per response token)"
        )
    if s.rollout_logprobs and len(s.rollout_logprobs) != len(s.response_ids):
        raise ValueError(
            f"sample {i}: rollout_logprobs has {len(s.rollout_logprobs)} entries for "
            f"{len(s.response_ids)} response tokens"
        )


def collate(samples: list[Sample], pad_id: int = 0) -> TokenBatch:
    """Right-padded tensors of ``samples``; see the module docstring for the alignment."""
    for i, s in enumerate(samples):
        _check_sample(i, s)
    width = max(s.total_len for s in samples)
    n = len(samples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    labels = torch.full((n, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    rollout_logprobs = torch.zeros((n, width), dtype=torch.float32)
    for i, s in enumerate(samples):
        ids = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        total, first = len(ids), len(s.prompt_ids) - 1  # column predicting response token 0
        input_ids[i, :total] = ids
        attention_mask[i, :total] = 1
        labels[i, : total - 1] = ids[1:]
        cols = slice(first, first + len(s.response_ids))
        if s.reward is not None:
            loss_mask[i, cols] = torch.tensor(s.loss_mask, dtype=torch.float32)
        if s.rollout_logprobs:
            rollout_logprobs[i, cols] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    return TokenBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=torch.arange(width).expand(n, width).clone(),
        labels=labels,
        loss_mask=loss_mask,
        rollout_logprobs=rollout_logprobs,
        lengths=attention_mask.sum(dim=-1),
    )
