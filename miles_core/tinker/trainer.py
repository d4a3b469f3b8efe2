"""Training clients as LoRA adapters on shared base models: ``TinkerTrainer``.

Each base model is loaded once as an ``AdapterBank``; each Tinker training client (a ``model_id``)
is an adapter attached to it (``attach``), with its own AdamW. Calls:

- ``forward_backward(calls)``: any number of calls, of any clients and bases, run together: per
  base, the datums of every call go through the same forward passes (each client's rows routed to
  its adapter, micro-batches of at most ``tokens_per_pass`` tokens computed; rows of one client
  side by side that begin alike, as an RL group's samples of one prompt do, run that prefix once:
  ``shared_prefixes``; ``bench/tinker_passes.py`` measures both), each datum's loss is its
  Tinker loss (``miles_core.tinker.losses``), and one backward pass of the sum gives each adapter
  exactly its own gradient (adapters share no parameter). Gradients add up across calls until
  ``optim_step``, as the SDK expects. Forward-only calls run without gradients.
- ``optim_step(model_id, adam)``: AdamW with the call's hyperparameters (decoupled weight decay,
  clipping when ``grad_clip_norm`` > 0), then gradients are zeroed.
- ``save_state`` / ``load_state``: the adapter and its optimizer as one file; ``save_sampler``: the
  adapter in PEFT's folder format, which engines load by name.

One thread calls these at a time (the service's training thread).
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from miles_core.tinker.losses import check_inputs, datum_loss
from miles_core.tinker.wire import ForwardBackward
from miles_core.train.adapter_bank import AdapterBank
from miles_core.train.losses import token_logprobs
from miles_core.train.shared_prompt import Rows, forward_logits

MIN_SHARED_PREFIX = 8
"""Rows side by side (of one client) whose tokens begin alike for at least this many tokens run that
prefix once (``shared_prefixes``)."""

log = logging.getLogger(__name__)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)


@dataclass
class Adapter:
    """One training client: its adapter on a base and its optimizer."""

    model_id: str
    key: str
    """The adapter's name in the bank and in engines (model ids hold ':' and run long)."""
    base: str
    lora: Any
    """Its ``miles_core.config.LoraConfig``."""
    params: dict[str, nn.Parameter]
    optimizer: torch.optim.AdamW | None = None
    steps: int = 0
    info: dict[str, Any] = field(default_factory=dict)


class TinkerTrainer:
    """Base models (name -> local folder) and the adapters of training clients on them (module docstring)."""

    def __init__(self, bases: dict[str, str], lora_alpha: float = 32.0, tokens_per_pass: int = 512) -> None:
        self.folders = dict(bases)
        self.lora_alpha = lora_alpha
        self.tokens_per_pass = tokens_per_pass
        self.banks: dict[str, AdapterBank] = {}
        self.adapters: dict[str, Adapter] = {}
        self._keys = 0

    def bank(self, base: str) -> AdapterBank:
        if base not in self.banks:
            self.banks[base] = AdapterBank(self.folders[base])
        return self.banks[base]

    # -- clients

    def create(self, model_id: str, base: str, rank: int, seed: int | None = None, train_attn: bool = True,
               train_mlp: bool = True, train_unembed: bool = True) -> Adapter:
        from miles_core.config import LoraConfig

        if base not in self.folders:
            raise ValueError(f"base model {base!r} is not served here; served: {sorted(self.folders)}")
        targets = [*(ATTENTION if train_attn else ()), *(MLP if train_mlp else ()), *(UNEMBED if train_unembed else ())]
        if not targets:
            raise ValueError("train_attn, train_mlp and train_unembed are all off: the adapter would train nothing")
        bank = self.bank(base)
        present = {name.rsplit(".", 1)[-1] for name, _ in bank.model.named_modules()}
        targets = [t for t in targets if t in present] or targets  # attach() names what matched nothing
        lora = LoraConfig(rank=rank, alpha=self.lora_alpha, target_modules=targets)
        self._keys += 1
        key = f"tinker{self._keys}"
        params = bank.attach(key, lora, seed if seed is not None else 0)
        adapter = Adapter(model_id, key, base, lora, params)
        self.adapters[model_id] = adapter
        return adapter

    def remove(self, model_id: str) -> None:
        adapter = self.adapters.pop(model_id, None)
        if adapter is not None:
            self.banks[adapter.base].detach(adapter.key)

    def get(self, model_id: str) -> Adapter:
        try:
            return self.adapters[model_id]
        except KeyError:
            raise KeyError(f"no training client {model_id!r} on this service") from None

    # -- forward and backward

    def forward_backward(self, calls: list[ForwardBackward]) -> list[tuple[list[dict[str, np.ndarray]], dict]]:
        """Each call's per-datum outputs (``logprobs``) and metrics (``loss:sum``), the calls run
        together (module docstring). A call's bad input raises before anything runs."""
        for call in calls:
            self.get(call.model_id)
            check_inputs(call.loss_fn, [d.inputs for d in call.data], [len(d.tokens) for d in call.data])
        results: dict[int, tuple[list, dict]] = {}
        by_base: dict[tuple[str, bool], list[int]] = {}
        for i, call in enumerate(calls):
            by_base.setdefault((self.adapters[call.model_id].base, call.forward_only), []).append(i)
        for (base, forward_only), indices in by_base.items():
            outs = self._run(self.banks[base], [calls[i] for i in indices], forward_only)
            results.update(zip(indices, outs, strict=True))
        return [results[i] for i in range(len(calls))]

    def _run(self, bank: AdapterBank, calls: list[ForwardBackward], forward_only: bool) -> list[tuple[list, dict]]:
        rows = [(k, j) for k, call in enumerate(calls) for j in range(len(call.data))]
        logprobs: dict[tuple[int, int], np.ndarray] = {}
        losses = [0.0] * len(calls)
        for part in self._passes(calls, rows):
            with torch.set_grad_enabled(not forward_only):
                got = self._pass(bank, calls, part)
                total = None
                for (k, j), lp in zip(part, got, strict=True):
                    call = calls[k]
                    inputs = {n: torch.as_tensor(v) for n, v in call.data[j].inputs.items() if n != "target_tokens"}
                    loss = datum_loss(call.loss_fn, lp, inputs, call.config)
                    losses[k] += float(loss.detach())
                    total = loss if total is None else total + loss
                    logprobs[(k, j)] = lp.detach().numpy().astype(np.float32)
                if not forward_only and total is not None and total.requires_grad:
                    total.backward()
        return [([{"logprobs": logprobs[(k, j)]} for j in range(len(call.data))], {"loss:sum": losses[k]})
                for k, call in enumerate(calls)]

    def _passes(self, calls: list[ForwardBackward], rows: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """Rows cut into passes of at most ``tokens_per_pass`` computed tokens (a prefix that rows
        of the pass share counts once), in order, so each client's rows stay side by side."""
        tokens = [calls[k].data[j].tokens for k, j in rows]
        prefix, run = shared_prefixes(tokens, [calls[k].model_id for k, _ in rows])
        passes: list[list[tuple[int, int]]] = [[]]
        cost, runs = 0, set()
        for r, row in enumerate(rows):
            n = len(tokens[r]) - (int(prefix[r]) if int(run[r]) in runs else 0)
            if passes[-1] and cost + n > self.tokens_per_pass:
                passes.append([])
                cost, runs, n = 0, set(), len(tokens[r])
            passes[-1].append(row)
            cost += n
            runs.add(int(run[r]))
        return [p for p in passes if p]

    def _pass(self, bank: AdapterBank, calls: list[ForwardBackward], part: list[tuple[int, int]]) -> list[torch.Tensor]:
        """One forward pass of ``part``'s datums, each row through its client's adapter; each
        datum's logprobs of its targets (``[N]``)."""
        datums = [calls[k].data[j] for k, j in part]
        width = max(len(d.tokens) for d in datums)
        ids = torch.zeros(len(datums), width, dtype=torch.long)
        targets = torch.zeros(len(datums), width, dtype=torch.long)
        mask = torch.zeros(len(datums), width, dtype=torch.long)
        for r, d in enumerate(datums):
            n = len(d.tokens)
            ids[r, :n] = torch.as_tensor(d.tokens)
            targets[r, :n] = torch.as_tensor(d.inputs["target_tokens"].astype(np.int64))
            mask[r, :n] = 1
        keys = [self.adapters[calls[k].model_id].key for k, _ in part]
        index = {key: i for i, key in enumerate(dict.fromkeys(keys))}  # rows (prompt pass's too) in client order
        owner = torch.as_tensor([index[key] for key in keys])
        lengths = torch.as_tensor([len(d.tokens) for d in datums])
        prompt_lens, prompt_index = shared_prefixes([d.tokens for d in datums], keys)
        rows = Rows(ids, mask, torch.arange(width).expand(len(datums), width), lengths, prompt_lens, prompt_index)
        logits = forward_logits(bank.model, rows, share=True, route=bank.router(owner, list(index)), prompt_columns=True)
        lp = token_logprobs(logits, targets)
        return [lp[r, : len(d.tokens)] for r, d in enumerate(datums)]

    # -- optimizer

    def optim_step(self, model_id: str, adam: dict[str, Any]) -> dict[str, float]:
        adapter = self.get(model_id)
        params = list(adapter.params.values())
        lr = float(adam.get("learning_rate", 1e-4))
        group = {"lr": lr, "betas": (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95))),
                 "eps": float(adam.get("eps", 1e-12)), "weight_decay": float(adam.get("weight_decay", 0.0))}
        if adapter.optimizer is None:
            adapter.optimizer = torch.optim.AdamW(params, foreach=True, **group)  # one op over all tensors
        adapter.optimizer.param_groups[0].update(group)
        grads = [p.grad for p in params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
        if not np.isfinite(norm):
            adapter.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"{model_id}: the gradient norm is {norm}; the step was not taken and the "
                                     "gradients were dropped")
        clip = float(adam.get("grad_clip_norm", 0.0) or 0.0)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        adapter.optimizer.step()
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.steps += 1
        # names of our own: a client logs these beside its metrics (the cookbook's "step" is its own)
        return {"grad_norm": norm, "learning_rate": lr, "optimizer_steps": float(adapter.steps)}

    # -- state

    def state_bytes(self, model_id: str) -> bytes:
        """The adapter's weights, its optimizer state and step count, as one ``torch.save`` file."""
        adapter = self.get(model_id)
        state = {"weights": {k: p.detach().cpu() for k, p in adapter.params.items()},
                 "optimizer": adapter.optimizer.state_dict() if adapter.optimizer else None,
                 "steps": adapter.steps, "rank": adapter.lora.rank,
                 "target_modules": list(adapter.lora.target_modules)}
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    def load_state(self, model_id: str, data: bytes, with_optimizer: bool) -> None:
        adapter = self.get(model_id)
        state = torch.load(io.BytesIO(data), weights_only=True)
        weights = state["weights"]
        if sorted(weights) != sorted(adapter.params) or any(
                weights[k].shape != p.shape for k, p in adapter.params.items()):
            raise ValueError(f"the saved state (rank {state.get('rank')}, modules {state.get('target_modules')}) does "
                             f"not fit training client {model_id} (rank {adapter.lora.rank}, modules "
                             f"{list(adapter.lora.target_modules)})")
        with torch.no_grad():
            for k, p in adapter.params.items():
                p.copy_(weights[k])
                p.grad = None
        adapter.optimizer = None
        adapter.steps = int(state.get("steps", 0))
        if with_optimizer and state.get("optimizer") is not None:
            adapter.optimizer = torch.optim.AdamW(list(adapter.params.values()))
            adapter.optimizer.load_state_dict(state["optimizer"])

    def save_sampler(self, model_id: str, folder: str) -> None:
        """The adapter in PEFT's folder format in ``folder`` (a local directory)."""
        adapter = self.get(model_id)
        self.banks[adapter.base].save_peft(adapter.key, adapter.lora, folder)


def shared_prefixes(tokens: list[np.ndarray], owners: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that share a prefix: runs of consecutive rows of one owner whose tokens begin alike for
    at least ``MIN_SHARED_PREFIX`` tokens (an RL group's samples of one prompt; a chat template's
    system prompt). Per row, the length of its run's common prefix (at most its length - 1) and its
    run's index: the forward pass computes each run's prefix once (``train.shared_prompt``)."""
    runs: list[tuple[int, int, int]] = []  # (first row, end row, common prefix length)
    for r, row in enumerate(tokens):
        if runs and owners[r] == owners[runs[-1][0]]:
            first, _, common = runs[-1]
            n = min(common, len(row) - 1)
            same = np.flatnonzero(tokens[first][:n] != row[:n])
            n = int(same[0]) if len(same) else n
            if n >= MIN_SHARED_PREFIX:
                runs[-1] = (first, r + 1, n)
                continue
        runs.append((r, r + 1, len(row) - 1))
    lens = torch.empty(len(tokens), dtype=torch.long)
    index = torch.empty(len(tokens), dtype=torch.long)
    for k, (first, end, common) in enumerate(runs):
        lens[first:end], index[first:end] = max(common, 1), k
    return lens, index
