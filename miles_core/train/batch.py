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

Rows with the same prompt tokens share a ``prompt_index``: the trainer runs such a prompt once
per micro-batch (``shared_prompt``).

``TokenBatch.select(rows)`` takes a subset of rows (a minibatch or micro-batch), trimmed to its own
longest row; per-row and per-token tensors the trainer attaches (advantages, old / reference
logprobs, rollout-correction weights) ride along.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import chain

import numpy as np
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
    prompt_lens: Tensor
    """[B] prompt tokens per row (the first ``prompt_lens`` of its ``lengths``)."""
    prompt_index: Tensor
    """[B] rows with the same prompt tokens have the same index (``shared_prompt``)."""
    advantages: Tensor | None = None
    """[B] one advantage per row."""
    old_logprobs: Tensor | None = None
    """[B, L] PPO ratio denominator, aligned like labels."""
    ref_logprobs: Tensor | None = None
    """[B, L] reference-policy logprobs, aligned like labels."""
    is_weights: Tensor | None = None
    """[B, L] rollout-correction weight of each token's policy-gradient loss (None: weight 1)."""
    has_rollout_logprobs: Tensor | None = None
    """[B] float: 1 on rows whose sample carries one rollout logprob per response token."""

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
    """Right-padded tensors of ``samples``; see the module docstring for the alignment. Built with
    one scatter per tensor over the whole batch (no per-sample tensor work)."""
    for i, s in enumerate(samples):
        _check_sample(i, s)
    n = len(samples)
    lengths = np.array([s.total_len for s in samples], dtype=np.int64)
    prompt_lens = np.array([len(s.prompt_ids) for s in samples], dtype=np.int64)
    width = int(lengths.max())
    # every token of every row: its row, its column, its id
    rows = np.repeat(np.arange(n), lengths)
    cols = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    ids = np.fromiter(chain.from_iterable(s.prompt_ids + s.response_ids for s in samples), np.int64, len(rows))
    input_ids = np.full((n, width), pad_id, dtype=np.int64)
    input_ids[rows, cols] = ids
    labels = np.full((n, width), pad_id, dtype=np.int64)
    later = cols > 0
    labels[rows[later], cols[later] - 1] = ids[later]  # column p predicts the token at p + 1
    attention_mask = (np.arange(width) < lengths[:, None]).astype(np.int64)
    # every response token: the column predicting it, its loss mask (0 for a failed sample), its logprob
    response_lens = lengths - prompt_lens
    r_rows = np.repeat(np.arange(n), response_lens)
    r_cols = (np.arange(int(response_lens.sum())) - np.repeat(np.cumsum(response_lens) - response_lens, response_lens)
              + np.repeat(prompt_lens - 1, response_lens))
    mask = np.fromiter(chain.from_iterable(s.loss_mask if s.reward is not None else [0] * len(s.response_ids)
                                           for s in samples), np.float32, len(r_rows))
    loss_mask = np.zeros((n, width), dtype=np.float32)
    loss_mask[r_rows, r_cols] = mask
    logprobs = np.fromiter(chain.from_iterable(s.rollout_logprobs or [0.0] * len(s.response_ids) for s in samples),
                           np.float32, len(r_rows))
    rollout_logprobs = np.zeros((n, width), dtype=np.float32)
    rollout_logprobs[r_rows, r_cols] = logprobs
    return TokenBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        position_ids=torch.arange(width).expand(n, width).clone(),
        labels=torch.from_numpy(labels),
        loss_mask=torch.from_numpy(loss_mask),
        rollout_logprobs=torch.from_numpy(rollout_logprobs),
        lengths=torch.from_numpy(lengths),
        prompt_lens=torch.from_numpy(prompt_lens),
        prompt_index=torch.tensor(_prompt_index(samples), dtype=torch.long),
        has_rollout_logprobs=torch.tensor([len(s.rollout_logprobs) == len(s.response_ids) for s in samples],
                                          dtype=torch.float32),
    )


def _prompt_index(samples: list[Sample]) -> list[int]:
    """Each sample's prompt as a number: equal prompt tokens, equal numbers (in order of first appearance)."""
    seen: dict[tuple[int, ...], int] = {}
    return [seen.setdefault(tuple(s.prompt_ids), len(seen)) for s in samples]


def micro_batch_rows(lengths: Tensor, size: int, max_tokens: int | None = None) -> list[Tensor]:
    """The row indices of each micro-batch of rows with ``lengths`` tokens, in order: ``size`` rows
    each, or, with ``max_tokens`` (Miles' dynamic batch size), as many rows as fit in ``max_tokens``
    tokens once padded to the longest of them (rows x longest), at least one row each (a row longer
    than ``max_tokens`` goes alone)."""
    n = len(lengths)
    if max_tokens is None:
        return [torch.arange(start, min(start + size, n)) for start in range(0, n, size)]
    cuts, start, longest = [], 0, 0
    for i, length in enumerate(lengths.tolist()):
        longest = max(longest, length)
        if i > start and (i - start + 1) * longest > max_tokens:
            cuts.append(torch.arange(start, i))
            start, longest = i, length
    if n:
        cuts.append(torch.arange(start, n))
    return cuts
