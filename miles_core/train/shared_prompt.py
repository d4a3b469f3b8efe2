"""Shared-prompt forward: the samples of one prompt share one forward (and backward) pass of it.

A GRPO batch holds ``n_samples_per_prompt`` responses to every prompt, and the plain forward pass
runs prompt + response on every row: each prompt is computed n times, forward and backward. Here
a micro-batch's distinct prompts (``TokenBatch.prompt_index``) go through the model once, keeping
the attention cache; then every row's response runs on top of its prompt's cached keys and
values, selected per row. The cache is part of the autograd graph, so each prompt's computation
receives the sum of its rows' gradients: the same gradient as the plain pass, up to floating-point
rounding (``tests/unit/test_trainer.py`` compares logprobs and gradients).

Layout: prompt rows are RIGHT-padded to the longest distinct prompt; a prompt's padding sits
between its last token and its responses, hidden by the attention mask, and the responses' position
ids continue from the prompt's real length, so every token sees exactly what it sees in the plain
pass and no query row is ever fully masked. The logits come back in the plain layout (column p
predicts the token at p + 1; the last prompt column comes from the prompt pass, the response
columns from the response pass, the other prompt columns are zero and masked out of every loss),
so the losses and metrics are computed exactly as before.

What it saves: (n - 1) / n of the prompt tokens' compute. On the toy task (prompts ~70% of the
tokens, n = 8) the trainer's step went from 91 to 71 ms (``bench/train_step.py --profile``); with a
single response per prompt there is nothing to share and the plain pass runs.

``route(rows)``: the context each of the two passes runs in, given, for every row of that pass,
the micro-batch row it stands for (the adapter bank routes rows to adapters with it).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple

import torch
from torch import Tensor, nn

from miles_core.models.hf_cache import cache_kwarg

Route = Callable[[Tensor], AbstractContextManager]


class Rows(NamedTuple):
    """What a forward pass needs of its rows (``TokenBatch`` has these fields too)."""

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    lengths: Tensor
    prompt_lens: Tensor
    prompt_index: Tensor


def forward_logits(model: nn.Module, rows: Rows, share: bool, route: Route | None = None,
                   prompt_columns: bool = False) -> Tensor:
    """Raw logits [B, W, V] of ``rows`` in the plain layout: the shared-prompt pass when ``share``
    and some prompt occurs twice, else one plain pass of every row (under ``route(all rows)``).
    ``prompt_columns``: every prompt column's logits, not only the last one's."""
    if share and worth_sharing(rows.prompt_index):
        return shared_prompt_logits(model, rows.input_ids, rows.lengths, rows.prompt_lens, rows.prompt_index, route,
                                    prompt_columns)
    with (route or _no_route)(torch.arange(rows.input_ids.shape[0], device=rows.input_ids.device)):
        return model(input_ids=rows.input_ids, attention_mask=rows.attention_mask, position_ids=rows.position_ids,
                     use_cache=False).logits


def _no_route(rows: Tensor) -> AbstractContextManager:
    return nullcontext()


def worth_sharing(prompt_index: Tensor | None) -> bool:
    """Whether some prompt occurs in two rows or more (else the plain pass is cheaper)."""
    return prompt_index is not None and len(prompt_index) > 1 and bool(
        torch.unique(prompt_index).numel() < len(prompt_index))


def shared_prompt_logits(model: nn.Module, input_ids: Tensor, lengths: Tensor, prompt_lens: Tensor,
                         prompt_index: Tensor, route: Route | None = None, prompt_columns: bool = False) -> Tensor:
    """Logits [B, W, V] of right-padded rows ``input_ids`` [B, W] (``lengths`` real tokens, the
    first ``prompt_lens`` of them the prompt; rows with equal ``prompt_index`` have the same
    prompt), in the plain pass's layout (module docstring); with ``prompt_columns``, every prompt
    column holds its logits (as in the plain pass), not only the last."""
    from transformers import DynamicCache

    route = route or _no_route
    rows, width = input_ids.shape
    device = input_ids.device
    keys, inverse = torch.unique(prompt_index, return_inverse=True)  # keys sorted: an adapter's prompts stay together
    first = torch.full((len(keys),), rows, dtype=torch.long, device=device).scatter_reduce(
        0, inverse, torch.arange(rows, device=device), "amin")
    p_lens = prompt_lens[first]
    p_width = int(p_lens.max())
    p_mask = (torch.arange(p_width, device=device) < p_lens[:, None]).long()
    p_ids = input_ids[first, :p_width] * p_mask
    cache = DynamicCache()
    last = torch.unique(p_lens - 1)  # the prompt columns whose logits are used: each prompt's last one
    if prompt_columns:
        last = torch.arange(p_width, device=device)
    with route(first):
        p_logits = model(input_ids=p_ids, attention_mask=p_mask,
                         position_ids=torch.arange(p_width, device=device).expand(len(keys), p_width),
                         use_cache=True, logits_to_keep=last, **{cache_kwarg(model): cache}).logits
    cache.batch_select_indices(inverse)  # each row's prompt keys and values (a gather: gradients sum per prompt)
    r_lens = lengths - prompt_lens
    r_width = max(int(r_lens.max()), 1)
    r_cols = prompt_lens[:, None] + torch.arange(r_width, device=device)
    r_mask = torch.arange(r_width, device=device) < r_lens[:, None]
    r_ids = input_ids.gather(1, r_cols.clamp(max=width - 1)) * r_mask
    with route(torch.arange(rows, device=device)):
        r_logits = model(input_ids=r_ids, attention_mask=torch.cat([p_mask[inverse], r_mask.long()], 1),
                         position_ids=r_cols, use_cache=False, **{cache_kwarg(model): cache}).logits
    out = r_logits.new_zeros(rows, width, r_logits.shape[-1])  # filled in place: one full-vocabulary tensor
    every = torch.arange(rows, device=device)
    if prompt_columns:
        in_prompt = torch.arange(p_width, device=device) < prompt_lens[:, None]
        p_rows, p_cols = every[:, None].expand(rows, p_width)[in_prompt], last.expand(rows, p_width)[in_prompt]
        out.index_put_((p_rows, p_cols), p_logits[inverse[p_rows], p_cols])
    else:
        out.index_put_((every, prompt_lens - 1), p_logits[inverse, torch.searchsorted(last, prompt_lens - 1)])
    r_rows = every[:, None].expand(rows, r_width)[r_mask]
    return out.index_put_((r_rows, r_cols[r_mask]), r_logits[r_mask])
