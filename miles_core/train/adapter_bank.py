"""Many LoRA adapters trained on one base model, their steps fused: ``AdapterBank``.

A multi-LoRA run with one ``TorchTrainer`` per adapter holds N copies of the base, and its N
adapter threads each step their own model at once, contending for the same cores. The bank holds
the base once and gives each adapter a ``BankedLoraTrainer``: the ``Trainer`` of that adapter alone
(its own optimizer, learning rate, loss settings, version counter, shuffling generator, checkpoint,
and PEFT-format export), over the bank's model.

- The model: the base with each target linear module replaced by a ``BankLinear`` holding every
  adapter's ``A`` (rank x in) and ``B`` (out x rank, zero at the start: version 0 is the base) for
  which that module is a target. Adapters may differ in rank, alpha, dropout and target modules.
  Which rows of a forward pass go through which adapter is the bank's routing (``route``): each
  adapter's rows get ``base(x) + (alpha / rank) * B(A(dropout(x)))``; rows routed to no adapter
  (the KL reference) get the base alone.
- Fused steps: ``BankedLoraTrainer.step(batch)`` hands its batch to the bank and waits. When every
  adapter still training (``leave`` takes one out) has handed one in, or ``gather_timeout_s``
  after the first one did, one thread steps them all together: each adapter's batch is prepared
  and cut into minibatches and micro-batches as its own ``TorchTrainer`` would (``plan``), then
  micro-batch j of minibatch i of every adapter goes through ONE forward pass (their rows side by
  side, padded to the widest), each adapter's loss is computed on its own rows with its own
  denominator, and one backward pass of their sum gives each adapter exactly its own gradient
  (their parameters are disjoint). Each adapter then clips and steps its own optimizer. The
  result is each adapter's own ``TorchTrainer`` step, up to floating-point rounding of the wider
  matrix products (a unit test compares them).
- Passes that are not the loss pass (old logprobs when two passes are needed, the reference) run
  per adapter, routed to it alone.

Used by ``miles_core.multi_lora`` when ``multi_lora.shared_base`` is on (the default) and the
trainer is the one-process torch backend.
"""

from __future__ import annotations

import itertools
import logging
import math
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from miles_core.train.batch import TokenBatch
from miles_core.train.shared_prompt import Route, Rows, forward_logits
from miles_core.train.torch_trainer import TorchTrainer, WeightPublisher

if TYPE_CHECKING:
    from miles_core.config import LoraConfig, TrainConfig
    from miles_core.train.base import TrainBatch

log = logging.getLogger(__name__)

Routes = list[tuple[str | None, int, int]]
"""Rows [start, stop) of a forward pass and the adapter they go through (None: the base alone)."""


class BankLinear(nn.Module):
    """A frozen linear layer with any number of LoRA adapters, applied to the rows the bank routes to each."""

    def __init__(self, base: nn.Linear, bank: AdapterBank, path: str) -> None:
        super().__init__()
        self.base, self._bank, self.path = base, [bank], path  # a list: the bank is not a submodule
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()
        self.scaling: dict[str, float] = {}
        self.dropout: dict[str, float] = {}

    def add(self, name: str, lora: LoraConfig, generator: torch.Generator) -> None:
        w = self.base.weight
        # as PEFT does, an adapter of a half-precision base trains in fp32 (small updates survive rounding)
        dtype = torch.float32 if w.dtype in (torch.float16, torch.bfloat16) else w.dtype
        a = torch.empty(lora.rank, self.base.in_features, dtype=dtype)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)  # PEFT's default init of A
        self.lora_A[name] = nn.Parameter(a.to(w.device))
        self.lora_B[name] = nn.Parameter(torch.zeros(self.base.out_features, lora.rank, dtype=dtype, device=w.device))
        self.scaling[name] = lora.lora_alpha / lora.rank
        self.dropout[name] = lora.dropout

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        routes = [r for r in self._bank[0].routes if r[0] in self.lora_A]
        if not routes:
            return y
        rows = self._bank[0].routes[-1][2]
        if x.shape[0] != rows:
            raise NotImplementedError(
                f"adapter bank: {self.path} gets an input of {x.shape[0]} rows, not the pass's {rows} sequences "
                "(a module that flattens its tokens, such as a MoE expert); leave it out of target_modules or "
                "set multi_lora.shared_base = false")
        if self._batchable(routes):
            return y + self._batched_delta(x, routes).to(y.dtype)
        deltas, at = [], 0
        for name, start, stop in routes:
            if start > at:
                deltas.append(y.new_zeros((start - at, *y.shape[1:])))
            h = x[start:stop]
            if self.training and self.dropout[name] > 0:
                h = nn.functional.dropout(h, self.dropout[name])
            a, b = self.lora_A[name], self.lora_B[name]
            deltas.append(((h.to(a.dtype) @ a.t()) @ b.t() * self.scaling[name]).to(y.dtype))
            at = stop
        if at < y.shape[0]:
            deltas.append(y.new_zeros((y.shape[0] - at, *y.shape[1:])))
        return y + torch.cat(deltas)

    def _batchable(self, routes: Routes) -> bool:
        """Whether ``routes`` go through ``_batched_delta``: several adapters of one rank, no
        dropout, and their row ranges close enough in size that padding them to the widest at most
        doubles the rows computed."""
        if len(routes) < 2 or len({self.lora_A[name].shape for name, _, _ in routes}) > 1:
            return False
        if self.training and any(self.dropout[name] > 0 for name, _, _ in routes):
            return False
        sizes = [stop - start for _, start, stop in routes]
        return len(sizes) * max(sizes) <= 2 * sum(sizes)

    def _batched_delta(self, x: Tensor, routes: Routes) -> Tensor:
        """Every routed row's ``scaling * B(A(x))`` in two batched matrix products, one batch entry
        per adapter (its rows padded to the widest range), instead of a few small products per
        adapter: with many adapters in a pass (a Tinker service's clients) the per-adapter products
        and their autograd nodes, not the arithmetic, were most of a pass (16 adapters: ~250 ms
        a pass against ~17 ms for one, on the tiny model). Rows no route covers get zeros."""
        n, rows = len(routes), x.shape[0]
        # the rows as they are (each adapter the same number, side by side, all of them routed), or
        # gathered into padded slots and scattered back
        plain = routes[0][1] == 0 and routes[-1][2] == rows and rows % n == 0 and all(
            start == k * rows // n and stop == (k + 1) * rows // n for k, (_, start, stop) in enumerate(routes))
        a = torch.stack([self.lora_A[name] for name, _, _ in routes])  # [n, rank, in]
        b = torch.stack([self.lora_B[name] for name, _, _ in routes])  # [n, out, rank]
        if plain:
            h = x.to(a.dtype)
        else:
            take, back = self._bank[0].padded_rows(routes, rows, x.device)
            h = x.index_select(0, take).to(a.dtype)  # [n * width, ..., in]
        slots, inner = h.shape[0], h.shape[1:-1]
        scale = torch.tensor([self.scaling[name] for name, _, _ in routes], dtype=a.dtype, device=a.device)
        d = torch.bmm(torch.bmm(h.reshape(n, -1, h.shape[-1]), a.transpose(1, 2)), b.transpose(1, 2))
        d = (d * scale.view(n, 1, 1)).reshape(slots, *inner, d.shape[-1])
        if plain:
            return d
        return torch.cat([d, d.new_zeros((1, *d.shape[1:]))]).index_select(0, back)


class AdapterBank:
    """One base model and the adapters trained on it (``add``), their steps fused (module docstring)."""

    def __init__(self, model_dir: str, dtype: str = "float32", device: str = "cpu",
                 gather_timeout_s: float = 30.0) -> None:
        from transformers import AutoModelForCausalLM

        from miles_core.dtypes import torch_dtype

        self.model_dir = str(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch_dtype(dtype, "AdapterBank"))
        self.model.requires_grad_(False).to(device).train()
        self.routes: Routes = []
        self._padded: dict[tuple, tuple[Tensor, Tensor]] = {}
        """``padded_rows`` of the routes now in force."""
        self.layers: dict[str, BankLinear] = {}
        """Module path (the base model's name) -> its ``BankLinear``, created as adapters need them."""
        self.trainers: dict[str, BankedLoraTrainer] = {}
        self.gather_timeout_s = gather_timeout_s
        self._cond = threading.Condition()
        self._live: set[str] = set()
        self._pending: dict[str, tuple[object, TrainBatch]] = {}
        """Adapter -> (the ticket of its ``step`` call, its batch), until a step takes it."""
        self._results: dict[object, dict[str, float] | BaseException] = {}
        self._abandoned: set[object] = set()
        self._stepping = False
        self._last_step_end = 0.0
        self.adapters_per_step: list[int] = []
        """How many adapters each fused step the bank has taken had."""

    # -- adapters

    def add(self, name: str, lora: LoraConfig, train_cfg: TrainConfig, weight_store: WeightPublisher,
            storage_options: dict[str, Any] | None = None) -> BankedLoraTrainer:
        """Add adapter ``name`` (A drawn from ``train_cfg.seed``, B zero) and return its trainer."""
        self.attach(name, lora, train_cfg.seed)
        trainer = BankedLoraTrainer(self, name, lora, train_cfg, weight_store, storage_options)
        self.trainers[name] = trainer
        with self._cond:
            self._live.add(name)
        return trainer

    def attach(self, name: str, lora: LoraConfig, seed: int) -> dict[str, nn.Parameter]:
        """Put adapter ``name``'s layers into the model (A drawn from ``seed``, B zero: the base's
        output) without a trainer of its own; returns its parameters (``parameters_of``). For callers
        that run their own optimizer over them (the Tinker service)."""
        if name in self.trainers or any(name in layer.lora_A for layer in self.layers.values()):
            raise ValueError(f"adapter {name!r} is in the bank already")
        generator = torch.Generator().manual_seed(seed)
        matched = 0
        for path, module in list(self.model.named_modules()):
            for child, layer in list(module.named_children()):
                full = f"{path}.{child}" if path else child
                if not _targets(lora, full):
                    continue
                if isinstance(layer, nn.Linear):
                    layer = BankLinear(layer, self, full)
                    setattr(module, child, layer)
                    self.layers[full] = layer
                if not isinstance(layer, BankLinear):
                    raise ValueError(f"adapter {name!r}: target {full} is a {type(layer).__name__}; the adapter bank "
                                     "adapts linear layers only (set multi_lora.shared_base = false for PEFT's)")
                layer.add(name, lora, generator)
                matched += 1
        if matched == 0:
            raise ValueError(f"adapter {name!r}: no linear module of the model matches target_modules "
                             f"{list(lora.target_modules)}")
        return self.parameters_of(name)

    def detach(self, name: str) -> None:
        """Take adapter ``name``'s layers out of the model (an adapter without a trainer: ``attach``)."""
        for layer in self.layers.values():
            if name in layer.lora_A:
                del layer.lora_A[name], layer.lora_B[name]
                layer.scaling.pop(name, None)
                layer.dropout.pop(name, None)

    def save_peft(self, name: str, lora: LoraConfig, folder: str) -> None:
        """Write adapter ``name`` into ``folder`` in PEFT's format (``adapter_config.json`` +
        ``adapter_model.safetensors``), which engines load by name."""
        import peft
        from safetensors.torch import save_file

        config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.lora_alpha, lora_dropout=lora.dropout,
                                 target_modules=list(lora.target_modules), task_type="CAUSAL_LM",
                                 base_model_name_or_path=self.model_dir, inference_mode=True)
        config.save_pretrained(folder)
        weights = {k: p.detach().to("cpu", copy=True).contiguous() for k, p in self.parameters_of(name).items()}
        save_file(weights, str(Path(folder) / "adapter_model.safetensors"), metadata={"format": "pt"})

    def parameters_of(self, name: str) -> dict[str, nn.Parameter]:
        """Adapter ``name``'s parameters under PEFT's saved names (``base_model.model.<module>.lora_A.weight``)."""
        out = {}
        for path, layer in self.model.named_modules():  # the model's order (PEFT's): not the order adapters came in
            if isinstance(layer, BankLinear) and name in layer.lora_A:
                out[f"base_model.model.{path}.lora_A.weight"] = layer.lora_A[name]
                out[f"base_model.model.{path}.lora_B.weight"] = layer.lora_B[name]
        return out

    def padded_rows(self, routes: Routes, rows: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """For ``BankLinear``'s batched products: the pass's row of each padded slot (route k's
        rows, then copies of its last up to the widest range) and, for each of the ``rows`` rows
        of the pass, its slot (or the one past the end: zeros). Every layer of a pass asks for the
        same routes: the answer is kept until the routes change."""
        key = (tuple(routes), rows)
        cached = self._padded.get(key)
        if cached is None:
            width = max(stop - start for _, start, stop in routes)
            take = [start + min(j, stop - start - 1) for _, start, stop in routes for j in range(width)]
            back = [len(take)] * rows
            for k, (_, start, stop) in enumerate(routes):
                back[start:stop] = range(k * width, k * width + stop - start)
            cached = self._padded[key] = (torch.tensor(take, device=device), torch.tensor(back, device=device))
        return cached

    def router(self, owner: Tensor, names: list[str]) -> Callable[[Tensor], AbstractContextManager]:
        """For ``forward_logits``: rows ``pass_rows`` of a batch whose row i is adapter
        ``names[owner[i]]``'s, in adapter order, each routed through its adapter."""

        def route(pass_rows: Tensor) -> AbstractContextManager:
            counts = torch.bincount(owner[pass_rows], minlength=len(names)).tolist()
            bounds = [0, *itertools.accumulate(counts)]
            return self.route([(n, bounds[k], bounds[k + 1]) for k, n in enumerate(names) if counts[k]])

        return route

    @contextmanager
    def route(self, routes: Routes) -> Iterator[None]:
        """Forward passes in the block send each row range through its adapter. Only the thread
        that holds the bank's step (or one trainer stepping alone) routes."""
        saved, self.routes = self.routes, routes
        self._padded.clear()
        try:
            yield
        finally:
            self.routes = saved

    # -- fused steps

    def leave(self, name: str) -> None:
        """Adapter ``name`` trains no more (done or failed): the others stop waiting for it."""
        with self._cond:
            self._live.discard(name)
            self._cond.notify_all()

    def step(self, name: str, batch: TrainBatch) -> dict[str, float]:
        """Adapter ``name``'s step on ``batch``, taken together with the other adapters' (module docstring)."""
        ticket = object()
        with self._cond:
            self._pending[name] = (ticket, batch)  # one that left steps with the others, or alone, never holding them back
            self._cond.notify_all()
            arrived = time.monotonic()
            try:
                while ticket not in self._results:
                    # waiting behind another group's step does not count towards the gather timeout
                    since = max(arrived, self._last_step_end)
                    ready = self._live <= self._pending.keys()
                    late = time.monotonic() - since >= self.gather_timeout_s
                    if not self._stepping and self._pending and (ready or late):
                        self._step_pending(ready)
                        continue
                    left = self.gather_timeout_s - (time.monotonic() - since)
                    self._cond.wait(timeout=min(max(0.05, left), threading.TIMEOUT_MAX))
            except BaseException:  # interrupted while waiting: its batch is not stepped, or its result dropped
                if self._pending.get(name, (None,))[0] is ticket:
                    del self._pending[name]
                self._abandoned.add(ticket)
                raise
            result = self._results.pop(ticket)
        if isinstance(result, BaseException):
            raise result
        return result

    def _step_pending(self, ready: bool) -> None:
        """Step every pending batch (called holding the lock; steps without it)."""
        if not ready:
            log.info("adapter bank: stepping %s without %s (not ready after %.0f s)", ", ".join(sorted(self._pending)),
                     ", ".join(sorted(self._live - self._pending.keys())), self.gather_timeout_s)
        taken = dict(sorted(self._pending.items()))  # rows in name order: the same pass whoever came first
        self._pending, self._stepping = {}, True
        self._cond.release()
        try:
            results = self._step_together({n: b for n, (_, b) in taken.items()})
        except BaseException as e:  # Ctrl-C in the middle: every waiting adapter gets it, none hangs
            results = dict.fromkeys(taken, e)
        finally:
            self._cond.acquire()
            self._stepping, self._last_step_end = False, time.monotonic()
        for n, (ticket, _) in taken.items():
            if ticket in self._abandoned:
                self._abandoned.discard(ticket)
            else:
                self._results[ticket] = results[n]
        self._cond.notify_all()

    def _step_together(self, batches: dict[str, TrainBatch]) -> dict[str, dict[str, float] | BaseException]:
        """One step of every adapter in ``batches``; an adapter whose batch or step fails gets its
        exception (the others' steps still count)."""
        results: dict[str, dict[str, float] | BaseException] = {}
        plans = {}
        for name, batch in batches.items():
            try:
                plans[name] = self.trainers[name].plan(batch)
            except Exception as e:  # noqa: BLE001 (this adapter's step fails alone)
                results[name] = e
        try:
            outcomes = self._optimizer_steps({n: (batches[n], p[2]) for n, p in plans.items()})
        except Exception as e:  # noqa: BLE001 (the shared forward or backward failed: every adapter's step did)
            return {**results, **{n: e for n in plans}}
        for name, (tokens, correction, _) in plans.items():
            try:
                results[name] = self.trainers[name].summarize(batches[name], tokens, correction, outcomes[name])
            except Exception as e:  # noqa: BLE001
                results[name] = e
        self.adapters_per_step.append(len(plans))
        return results

    def _optimizer_steps(self, work: dict[str, tuple[TrainBatch, list[TokenBatch]]]) -> dict[str, list]:
        """Minibatch i of every adapter, stepped together: their micro-batches j in one forward
        and one backward pass, then each adapter's own clip and optimizer step."""
        outcomes: dict[str, list] = {name: [] for name in work}
        for i in range(max(len(mbs) for _, mbs in work.values())):
            active = {}
            for name, (_, minibatches) in work.items():
                if i >= len(minibatches):
                    continue
                trainer, mb = self.trainers[name], minibatches[i]
                denom = trainer.loss_denominator(mb)
                if denom == 0:
                    outcomes[name].append(None)
                else:
                    active[name] = (denom, trainer.trained_micro_batches(mb), defaultdict(list))
            for j in range(max((len(m) for _, m, _ in active.values()), default=0)):
                group = [(name, m[j]) for name, (_, m, _) in active.items() if j < len(m)]
                logits = self._joint_logits(group)
                total = None
                for (name, mb), lg in zip(group, logits):
                    trainer, (denom, _, parts) = self.trainers[name], active[name]
                    loss, metrics = trainer.loss_of(mb, lg, denom, work[name][0].temperature)
                    trainer.keep_metrics(parts, metrics)
                    total = loss if total is None else total + loss
                total.backward()
            for name, (_, _, parts) in active.items():
                outcomes[name].append(self.trainers[name].apply_gradients(parts))
        return outcomes

    def _joint_logits(self, group: list[tuple[str, TokenBatch]]) -> list[Tensor]:
        """One forward pass of every micro-batch in ``group`` (rows side by side, right-padded to the
        widest), each routed to its adapter; each micro-batch's raw logits (views), cut back to its own width.
        With ``share_prompt_forward``, each adapter's prompts run once (``shared_prompt``), never
        shared across adapters: their weights differ."""
        width = max(mb.input_ids.shape[1] for _, mb in group)
        names = [name for name, _ in group]
        owner = torch.cat([torch.full((mb.num_rows,), k, dtype=torch.long) for k, (_, mb) in enumerate(group)])
        prompts = 1 + max(int(mb.prompt_index.max()) for _, mb in group)
        parts: dict[str, list[Tensor]] = {f: [] for f in Rows._fields}
        for k, (name, mb) in enumerate(group):
            pad = width - mb.input_ids.shape[1]
            parts["input_ids"].append(nn.functional.pad(mb.input_ids, (0, pad), value=self.trainers[name].pad_id))
            parts["attention_mask"].append(nn.functional.pad(mb.attention_mask, (0, pad), value=0))
            parts["position_ids"].append(nn.functional.pad(mb.position_ids, (0, pad), value=0))
            parts["lengths"].append(mb.lengths)
            parts["prompt_lens"].append(mb.prompt_lens)
            parts["prompt_index"].append(mb.prompt_index + k * prompts)  # adapter k's prompts after adapter k - 1's
        rows = Rows(**{f: torch.cat(v) for f, v in parts.items()})
        owner = owner.to(rows.input_ids.device)

        # a pass's rows are in adapter order (the prompt pass's too: its keys sort by adapter first)
        share = all(self.trainers[name].cfg.share_prompt_forward for name in names)
        out = forward_logits(self.model, rows, share, self.router(owner, names))
        logits, at = [], 0
        for _, mb in group:
            logits.append(out[at : at + mb.num_rows, : mb.input_ids.shape[1]])
            at += mb.num_rows
        return logits


class BankedLoraTrainer(TorchTrainer):
    """One adapter of an ``AdapterBank``: ``TorchTrainer``'s step, state and export for that adapter
    alone, over the bank's base model; ``step`` is fused with the other adapters' (``AdapterBank.step``)."""

    def __init__(self, bank: AdapterBank, name: str, lora: LoraConfig, train_cfg: TrainConfig,
                 weight_store: WeightPublisher, storage_options: dict[str, Any] | None = None) -> None:
        from miles_core.train.torch_trainer import has_dropout

        self.bank, self.name = bank, name
        self._named = bank.parameters_of(name)
        self.setup(bank.model, list(self._named.values()), train_cfg, weight_store, lora=lora,
                   storage_options=storage_options, random_forward=lora.dropout > 0 or has_dropout(bank.model))

    def step(self, batch: TrainBatch) -> dict[str, float]:
        return self.bank.step(self.name, batch)

    def logits(self, model: nn.Module, mb: TokenBatch, route: Route | None = None) -> Tensor:
        if route is None and self.bank.routes is not _BASE:  # the reference pass keeps the base's routing
            route = self._route
        return super().logits(model, mb, route)

    def _route(self, rows: Tensor) -> AbstractContextManager:
        """Every row of a pass through this adapter."""
        return self.bank.route([(self.name, 0, len(rows))])

    @contextmanager
    def reference(self) -> Iterator[nn.Module]:
        """The reference policy: the base, every adapter off."""
        with self.bank.route(_BASE):
            yield self.model

    # -- weights and state

    def weights(self) -> dict[str, Tensor]:
        """The adapter's state dict under PEFT's names (as in its ``adapter_model.safetensors``)."""
        return {k: p.detach().to("cpu", copy=True).contiguous() for k, p in self._named.items()}

    def merge(self) -> dict[str, Tensor]:
        """The full policy state dict with this adapter merged into the base's weights."""
        merged = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        for path, layer in self.bank.layers.items():
            base_key = f"{path}.base.weight"
            w = merged.pop(base_key)
            if self.name in layer.lora_A:
                delta = layer.lora_B[self.name].detach().cpu() @ layer.lora_A[self.name].detach().cpu()
                w = (w.float() + layer.scaling[self.name] * delta.float()).to(w.dtype)
            merged[f"{path}.weight"] = w
            if f"{path}.base.bias" in merged:
                merged[f"{path}.bias"] = merged.pop(f"{path}.base.bias")
        return {k: v for k, v in merged.items() if ".lora_" not in k}

    def export(self, version: int) -> str:
        """Publish the adapter as ``version`` in PEFT's folder format (``adapter_config.json`` +
        ``adapter_model.safetensors``), as ``TorchTrainer`` with LoRA does."""
        with tempfile.TemporaryDirectory() as tmp:
            self.bank.save_peft(self.name, self.lora, tmp)
            return self.weight_store.publish_folder(version, tmp)

    def model_state(self) -> dict[str, Tensor]:
        return {k: p.detach() for k, p in self._named.items()}

    def load_model_state(self, weights: dict[str, Tensor]) -> None:
        from miles_core.train.policy import few

        # a checkpoint of a trainer of its own (PEFT's parameter names carry the adapter's name)
        weights = {k.replace(f".lora_A.{self.name}.", ".lora_A.").replace(f".lora_B.{self.name}.", ".lora_B."): v
                   for k, v in weights.items()}
        missing, unexpected = sorted(self._named.keys() - weights.keys()), sorted(weights.keys() - self._named.keys())
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match adapter {self.name!r} of the bank: missing {few(missing)}, "
                             f"unexpected {few(unexpected)} (was it written with other target modules, or "
                             "by a trainer without a shared base?)")
        with torch.no_grad():
            for k, p in self._named.items():
                p.copy_(weights[k])


_BASE: Routes = []
"""The reference pass's routing: every row through the base alone (compared by identity)."""


def _targets(lora: LoraConfig, module_path: str) -> bool:
    """Whether ``lora.target_modules`` names this module (PEFT's rule for a list: the path ends in one of them)."""
    return any(module_path == t or module_path.endswith(f".{t}") for t in lora.target_modules)
