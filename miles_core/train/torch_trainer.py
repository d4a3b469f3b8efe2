"""TorchTrainer: the plain-torch ``Trainer`` (one process, AdamW, gradient accumulation).

One ``step(batch)``:
1. collate the samples (``batch.collate``) and attach advantages, the PPO ratio denominator
   (recomputed by a no-grad forward pass, or the rollout engine's logprobs; see "One pass" below) and, when a KL term
   is on (``kl_loss_coef`` or ``kl_coef``), the frozen reference policy's logprobs; with
   ``kl_coef``, the advantages again from KL-penalised rewards;
2. rollout correction: with recomputed old logprobs and samples that carry the engine's logprobs,
   measure the mismatch between the two (``mismatch_kl``, ...); with ``use_tis``, attach the
   per-token importance weights (``losses.rollout_correction``) and, in mask mode, drop the
   rejected tokens from the loss mask. The weights depend only on the batch, not on the weights
   being trained, so they are fixed before any update;
3. shuffle the samples (seeded generator, saved in checkpoints) and cut them into optimizer
   minibatches (``TrainConfig.minibatch_sizes``: ``global_batch_size`` samples each, or
   ``num_steps_per_rollout`` equal parts, or the whole batch in one step; a minibatch with no
   trained token is skipped: no optimizer step, no new version). With ``share_prompt_forward``
   (the default), a minibatch's rows are ordered by prompt, so a micro-batch runs each of its
   prompts once (``shared_prompt``);
4. per minibatch, accumulate gradients over micro-batches of ``micro_batch_size`` samples. Each
   micro-batch's loss is divided by the *minibatch's* denominator (its masked-token count for
   ``token_mean``, its number of trained sequences for ``seq_mean`` / ``seq_sum``; the policy loss
   says which), so the accumulated gradient is the gradient of the minibatch loss, whatever the
   micro-batch size;
5. clip the gradient norm, take an AdamW step, and count one more version.

One pass: with recomputed old logprobs and a batch trained in a single optimizer step (and no
``kl_coef``, no ``use_tis`` in ``mask`` mode, no dropout: nothing that needs the denominator
before the loss pass, or that makes two passes differ), the denominator is the loss pass's own
logprobs, detached, and the step saves one forward pass of the batch. ``use_tis`` in ``truncate``
mode keeps every token, and each token's weight depends only on its own detached logprob, so the
weights are computed in the loss pass too. A separate no-grad pass of the same weights computes
the same values up to rounding: on CPU in fp32 the update is the same bit for bit (a unit test);
where kernels round differently for other batch shapes (GPU, bf16) the separate pass gave a ratio of
1 plus rounding noise, and the one pass gives exactly 1 (``ratio_dev``, ``clipfrac`` and
``approx_kl`` of such a step are 0). The mismatch metrics are then summed over the loss pass's
micro-batches, as the loss is (``_one_pass``).

Every optimizer step after the first of a batch trains on samples its weights did not produce;
``offpolicy_ratio_dev`` and ``offpolicy_clipfrac`` (steps 2..k) show how far they have drifted.

Loss = policy loss + kl_loss_coef * KL(pi || pi_ref) - entropy_coef * H, all reduced the same way.
With ``kl_coef`` (KL penalty in the reward), each sample's reward first becomes
R - kl_coef * sum_t KL_t(pi_old || pi_ref) and the advantages are recomputed from it. The
policy loss is the one ``train.loss.type`` names (``losses.setup_policy_loss``: grpo, dr_grpo, gspo,
reinforce_plus_plus); the advantages it trains on come with the batch (``TrainBatch.from_groups``). Logprobs are those of
``logits / temperature`` (raw logits when the temperature is 0), as the rollout engines report them.

LoRA (``lora``: a ``LoraConfig``): the policy is the base wrapped by ``peft.get_peft_model`` with one
adapter (B initialised to zero, so version 0 is the base) and the optimizer holds only the adapter's
parameters. The reference policy for the KL term is the base itself, the adapter disabled for that
forward pass, rather than a second copy of the model. ``export`` publishes the adapter in PEFT's
folder format (``WeightStore.publish_folder``); ``weights()`` is the adapter's state dict and
``merge()`` the full merged state dict; checkpoints hold the adapter and the optimizer state (the
frozen base comes from ``model_dir`` again).
"""

from __future__ import annotations

import copy
import io
import math
import os
import posixpath
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from miles_core.config import TrainConfig
from miles_core.dtypes import torch_dtype
from miles_core.memory import release_freed_memory
from miles_core.train.base import TrainBatch
from miles_core.train.batch import TokenBatch, collate, micro_batch_rows
from miles_core.train.losses import (
    kl_penalty,
    mismatch_metrics,
    reduce_tokens,
    reducer_denominator,
    rollout_correction,
    setup_policy_loss,
    token_logprobs,
    token_logprobs_and_entropy,
)
from miles_core.train.shared_prompt import Route, forward_logits
from miles_core.types import Sample

if TYPE_CHECKING:
    from miles_core.config import LoraConfig

_AVERAGED = ("loss", "pg_loss", "kl", "entropy", "clipfrac", "ratio_mean", "ratio_dev", "approx_kl", "grad_norm",
             "lr")
# averaged over the optimizer steps after the first one of a batch (its off-policy steps)
_OFF_POLICY = {"offpolicy_ratio_dev": "ratio_dev", "offpolicy_clipfrac": "clipfrac"}
_MISMATCH = ("mismatch_kl", "train_rollout_logprob_abs_diff", "tis_weight_mean", "tis_clipfrac")  # the last two with TIS


class WeightPublisher(Protocol):
    """The part of ``storage.WeightStore`` the trainer uses."""

    def publish(self, version: int, state_dict: dict[str, Tensor], metadata: dict | None = None) -> str: ...

    def publish_folder(self, version: int, local_dir: str | Path) -> str:
        """Publish a local folder's files (a LoRA adapter); only used with LoRA."""


class TorchTrainer:
    """``step(batch)`` in parts that are public, so that ``AdapterBank`` can fuse several trainers'
    steps into one pass over a shared base: ``plan`` (tensors and minibatches), per minibatch
    ``loss_denominator``, ``trained_micro_batches``, ``loss_of`` a micro-batch's logits,
    ``keep_metrics``, then ``apply_gradients``; ``summarize`` the step."""

    def __init__(
        self,
        model_dir: str,
        train_cfg: TrainConfig,
        weight_store: WeightPublisher,
        dtype: str = "float32",
        initial_version: int = 0,
        storage_options: dict[str, Any] | None = None,
        lora: LoraConfig | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        torch_dt = torch_dtype(dtype, "TorchTrainer")
        self.cfg = train_cfg
        self.policy_loss = setup_policy_loss(train_cfg.loss)
        self.weight_store = weight_store
        self.storage_options = storage_options or {}
        self.device = self._select_device(train_cfg)
        self.lora = lora
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dt)
        if train_cfg.gradient_checkpointing:  # not reentrant: needs no gradient on the inputs (a LoRA base's are frozen)
            enable = getattr(model, "activation_checkpointing_enable", None)  # its name from transformers 5.2x on
            if enable is not None:
                enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = (model if lora is None else _wrap_lora(model, lora, train_cfg.seed)).to(self.device)
        self.model.train()
        # The reference policy is the starting weights; a frozen copy is kept only when the KL term
        # is on and there is no adapter to switch off (with LoRA the base itself is the reference).
        self.ref_model = None
        if _uses_reference(train_cfg) and lora is None:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self._random_forward = _has_dropout(self.model)
        """A training-mode forward pass is random (dropout, jitter): two passes differ (``_one_pass``)."""
        self._mismatch_denom: float | None = None
        """One pass: the tokens the mismatch metrics average over (None: no metrics)."""
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=train_cfg.lr,
            betas=(train_cfg.adam_beta1, train_cfg.adam_beta2),
            weight_decay=train_cfg.weight_decay,
        )
        self.pad_id = self.model.config.pad_token_id or 0
        self._generator = torch.Generator().manual_seed(train_cfg.seed)
        self._version = initial_version

    def _select_device(self, train_cfg: TrainConfig) -> torch.device:
        """Where the model trains (a launched rank picks its own GPU)."""
        return torch.device(train_cfg.backend.device)

    @property
    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------------------------------ step

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """Train on ``batch``. Metrics are averaged over its optimizer steps (NaN if none was taken):
        ``loss``, ``pg_loss``, ``kl`` (0 when no KL term is on), ``entropy``, ``clipfrac``,
        ``ratio_mean``, ``ratio_dev`` (mean |ratio - 1|), ``approx_kl``, ``grad_norm`` (before
        clipping); with two or more optimizer steps, ``offpolicy_ratio_dev`` and
        ``offpolicy_clipfrac``: the same averaged over steps 2..k only (step 1 is on-policy, its
        ratio is 1 with recomputed old logprobs); with recomputed old logprobs and samples that carry
        rollout logprobs, the mismatch metrics of ``losses.mismatch_metrics`` (``mismatch_kl``,
        ``train_rollout_logprob_abs_diff``, and with ``use_tis`` ``tis_weight_mean``,
        ``tis_clipfrac``); plus counts: ``num_optimizer_steps``, ``num_nonfinite_steps`` (optimizer
        steps not taken because the loss or the gradient norm was not finite: the weights stay as
        they were), ``train_tokens``, ``num_samples``,
        ``num_excluded_samples`` (reward None) and ``version`` after the step."""
        tokens, correction_metrics, minibatches = self.plan(batch)
        results = [self._optimizer_step(mb, batch.temperature) for mb in minibatches]
        release_freed_memory()  # the step's gradients and activations
        return self.summarize(batch, tokens, correction_metrics, results)

    def plan(self, batch: TrainBatch) -> tuple[TokenBatch, dict[str, float], list[TokenBatch]]:
        """Steps 1-3 of ``step``: the batch's tensors, its rollout-correction metrics, and its
        optimizer minibatches (shuffled)."""
        if not batch.samples:
            raise ValueError("TrainBatch has no samples")
        tokens, correction_metrics = self._prepare(batch)
        n = tokens.num_rows
        order = torch.randperm(n, generator=self._generator).to(self.device)
        chunks = order.split(self.cfg.minibatch_sizes(n))
        if self.cfg.share_prompt_forward:  # a prompt's samples side by side, so micro-batches share its pass
            chunks = [rows[torch.argsort(tokens.prompt_index[rows], stable=True)] for rows in chunks]
        return tokens, correction_metrics, [tokens.select(rows) for rows in chunks]

    def summarize(self, batch: TrainBatch, tokens: TokenBatch, correction_metrics: dict[str, float],
                 results: list[dict[str, float] | None]) -> dict[str, float]:
        """``step``'s metrics from its optimizer steps' results (``apply_gradients``; None: a minibatch with nothing to train)."""
        per_step = [m for m in results if m is not None and "nonfinite" not in m]
        nonfinite = sum(1 for m in results if m is not None and "nonfinite" in m)
        summary = {k: _mean(m[k] for m in per_step) for k in _AVERAGED}
        if len(per_step) > 1:
            summary.update({name: _mean(m[k] for m in per_step[1:]) for name, k in _OFF_POLICY.items()})
        summary.update(correction_metrics)
        if self._mismatch_denom and per_step:  # one pass: the micro-batches' shares, summed
            summary.update({k: per_step[0][k] for k in _MISMATCH if k in per_step[0]})
        excluded = sum(1 for s in batch.samples if s.reward is None)
        summary.update(
            num_optimizer_steps=float(len(per_step)),
            num_nonfinite_steps=float(nonfinite),
            train_tokens=float(tokens.loss_mask.sum()),
            num_samples=float(tokens.num_rows),
            num_excluded_samples=float(excluded),
            version=float(self._version),
        )
        return summary

    def _prepare(self, batch: TrainBatch) -> tuple[TokenBatch, dict[str, float]]:
        """The batch's tensors, and the rollout-correction metrics (see ``_correct_for_rollout``)."""
        tokens = collate(batch.samples, self.pad_id).to(self.device)
        tokens.advantages = torch.tensor(batch.advantages, dtype=torch.float32, device=self.device)
        metrics: dict[str, float] = {}
        self._mismatch_denom = None
        if self.cfg.use_tis:  # one pass or two, the weights need the engine's logprobs
            _require_rollout_logprobs(batch.samples, "train.use_tis", "set train.use_tis = false (on by default in the async modes) or use an engine that reports them")
        if self._one_pass(tokens.num_rows):  # the loss pass's own logprobs, detached (see "One pass")
            self._mismatch_denom = float((tokens.loss_mask * tokens.has_rollout_logprobs.unsqueeze(-1)).sum()) or None
        elif self.cfg.old_logprobs == "recompute":
            tokens.old_logprobs = self._forward_logprobs(self.model, tokens, batch.temperature)
            metrics = self._correct_for_rollout(batch.samples, tokens)
        else:
            _require_rollout_logprobs(
                batch.samples, "train.old_logprobs='rollout'", "use old_logprobs='recompute' or an engine that reports them"
            )
            tokens.old_logprobs = tokens.rollout_logprobs
        if _uses_reference(self.cfg):
            with self._reference() as ref:
                tokens.ref_logprobs = self._forward_logprobs(ref, tokens, batch.temperature)
        if self.cfg.kl_coef > 0:
            metrics.update(self._kl_penalised_advantages(batch, tokens))
        return tokens, metrics

    def _kl_penalised_advantages(self, batch: TrainBatch, tokens: TokenBatch) -> dict[str, float]:
        """KL penalty in the reward: R' = R - kl_coef * sum_t KL_t over each sample's trained tokens
        (KL_t: the ``kl_type`` estimate of log pi_old - log pi_ref), then the loss's advantages of R'.
        Reports ``kl_reward_penalty``: the mean of kl_coef * sum_t KL_t over the scored samples."""
        from miles_core.train.advantages import compute_advantages

        cfg = self.cfg
        seq_kl = (kl_penalty(tokens.old_logprobs, tokens.ref_logprobs, cfg.kl_type) * tokens.loss_mask).sum(-1)
        penalties = (cfg.kl_coef * seq_kl).tolist()
        rewards = [None if s.reward is None else s.reward - p for s, p in zip(batch.samples, penalties)]
        advantages = compute_advantages(cfg.loss, batch.regrouped(rewards))
        tokens.advantages = torch.tensor(advantages, dtype=torch.float32, device=self.device)
        scored = [p for s, p in zip(batch.samples, penalties) if s.reward is not None]
        return {"kl_reward_penalty": _mean(scored)}

    @contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        """The reference policy: the frozen copy, or with LoRA the model with its adapter off."""
        if self.ref_model is not None:
            yield self.ref_model
            return
        with self.model.disable_adapter():
            yield self.model

    def _correct_for_rollout(self, samples: list[Sample], tokens: TokenBatch) -> dict[str, float]:
        """Mismatch metrics between the recomputed and the rollout logprobs, over the trained tokens
        of the samples that carry rollout logprobs (none: no metrics). With ``use_tis``, attach the
        importance weights and drop rejected tokens from the loss mask, before any denominator."""
        cfg = self.cfg
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

    def _one_pass(self, num_rows: int) -> bool:
        """Whether the loss pass's own detached logprobs stand for a separate old-logprob pass (see
        the module docstring): recomputed, one optimizer step, nothing needing them before the loss
        pass, and no dropout to make two passes differ."""
        cfg = self.cfg
        return (cfg.old_logprobs == "recompute" and len(cfg.minibatch_sizes(num_rows)) == 1
                and cfg.kl_coef == 0 and (not cfg.use_tis or cfg.tis_mode == "truncate") and not self._random_forward)

    def _micro_batches(self, tokens: TokenBatch) -> Iterator[TokenBatch]:
        max_tokens = self.cfg.max_tokens_per_gpu if self.cfg.use_dynamic_batch_size else None
        for rows in micro_batch_rows(tokens.lengths.cpu(), self.cfg.micro_batch_size, max_tokens):
            yield tokens.select(rows.to(self.device))

    def _logits(self, model: torch.nn.Module, mb: TokenBatch, route: Route | None = None) -> Tensor:
        """The raw logits of ``model`` (its dtype), aligned like ``mb.labels`` (the shared-prompt pass
        when ``share_prompt_forward`` is on: ``shared_prompt``). The temperature is applied chunk by
        chunk where they are used (``token_logprobs_and_entropy``), never to a copy of the whole."""
        # a checkpointed layer is run again in the backward pass, and would write the shared prompt's cache twice
        share = self.cfg.share_prompt_forward and not (self.cfg.gradient_checkpointing and torch.is_grad_enabled())
        return forward_logits(model, mb, share, route)

    @torch.no_grad()
    def _forward_logprobs(self, model: torch.nn.Module, tokens: TokenBatch, temperature: float) -> Tensor:
        out = torch.zeros_like(tokens.loss_mask)
        start = 0
        with _eval_mode(model):
            for mb in self._micro_batches(tokens):
                lp = token_logprobs(self._logits(model, mb), mb.labels, temperature)
                out[start : start + mb.num_rows, : lp.shape[1]] = lp
                start += mb.num_rows
        return out

    def _optimizer_step(self, minibatch: TokenBatch, temperature: float) -> dict[str, float] | None:
        denom = self.loss_denominator(minibatch)
        if denom == 0:  # every sample in it is failed or fully masked: nothing to learn from
            return None
        parts: dict[str, list[Tensor]] = defaultdict(list)
        for mb in self.trained_micro_batches(minibatch):
            loss, metrics = self._micro_loss(mb, denom, temperature)
            loss.backward()
            self.keep_metrics(parts, metrics)
        return self.apply_gradients(parts)

    def loss_denominator(self, minibatch: TokenBatch) -> float:
        """What every micro-batch's loss of ``minibatch`` is divided by (0: nothing to train)."""
        return reducer_denominator(minibatch.loss_mask, self.policy_loss.reducer)

    def trained_micro_batches(self, minibatch: TokenBatch) -> list[TokenBatch]:
        """The micro-batches of ``minibatch`` with at least one trained token."""
        return [mb for mb in self._micro_batches(minibatch) if mb.loss_mask.any()]

    def keep_metrics(self, parts: dict[str, list[Tensor]], metrics: dict[str, Tensor]) -> None:
        """Add a micro-batch's metrics to its minibatch's (summed on the device, read back once by ``apply_gradients``)."""
        loss_device = self.params[0].device
        for k, v in metrics.items():
            parts[k].append(torch.as_tensor(v, dtype=torch.float64, device=loss_device).detach())

    def apply_gradients(self, parts: dict[str, list[Tensor]]) -> dict[str, float]:
        """After a minibatch's backward passes: clip, and take the optimizer step if the gradient
        is finite (``{"nonfinite": 1.0}`` if not: the gradient is dropped); the minibatch's metrics."""
        loss_device = self.params[0].device
        max_norm = self.cfg.clip_grad if self.cfg.clip_grad > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm).double()
        names = list(parts)
        values = torch.stack([torch.stack(parts[k]).sum() for k in names] + [grad_norm.to(loss_device)]).tolist()
        sums = dict(zip(names, values[:-1]))
        sums["grad_norm"] = values[-1]
        if not math.isfinite(sums["grad_norm"]):  # a NaN or infinite loss or gradient: never applied
            self.optimizer.zero_grad(set_to_none=True)
            return {"nonfinite": 1.0}
        sums["lr"] = self._set_lr(self.optimizer)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._version += 1
        return dict(sums)

    def _set_lr(self, optimizer) -> float:
        """The learning rate of the step about to make version ``version + 1`` (``TrainConfig.lr_at``),
        set on ``optimizer``; returned for the step's metrics."""
        lr = self.cfg.lr_at(self._version + 1)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _micro_loss(self, mb: TokenBatch, denom: float, temperature: float) -> tuple[Tensor, dict[str, Tensor]]:
        """This micro-batch's share of the minibatch loss (divided by the minibatch's ``denom``)."""
        return self.loss_of(mb, self._logits(self.model, mb), denom, temperature)

    def loss_of(self, mb: TokenBatch, logits: Tensor, denom: float,
                 temperature: float) -> tuple[Tensor, dict[str, Tensor]]:
        """``_micro_loss`` from the micro-batch's raw logits (the policy's) and the batch's temperature."""
        cfg, reducer = self.cfg, self.policy_loss.reducer
        logprobs, token_entropy = token_logprobs_and_entropy(logits, mb.labels, temperature)
        old_logprobs, weights, correction = mb.old_logprobs, mb.is_weights, None
        if old_logprobs is None:  # one pass: this pass's logprobs are the denominator
            old_logprobs = logprobs.detach()
            if cfg.use_tis:  # truncate: per-token weights of these logprobs, every token kept (no denominator change)
                correction = rollout_correction(old_logprobs, mb.rollout_logprobs, cfg.tis_mode, cfg.tis_clip,
                                                cfg.tis_clip_low)
                weights = correction.weights
        pg_loss, metrics = self.policy_loss.fn(
            logprobs, old_logprobs, mb.advantages, mb.loss_mask, denom=denom, weights=weights
        )
        if mb.old_logprobs is None and self._mismatch_denom:  # this micro-batch's share of the batch's
            mask = mb.loss_mask * mb.has_rollout_logprobs.unsqueeze(-1)
            metrics.update(mismatch_metrics(old_logprobs, mb.rollout_logprobs, mask, correction,
                                            denom=self._mismatch_denom))
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

    # ------------------------------------------------------------------------- weights and state

    def weights(self) -> dict[str, Tensor]:
        """What ``export`` publishes, on CPU, every tensor its own contiguous copy: the policy's state
        dict, or with LoRA the adapter's state dict (PEFT's names, as in ``adapter_model.safetensors``;
        ``merge()`` gives the full weights).

        Tied parameters (``lm_head.weight`` is ``embed_tokens.weight``) stay one tensor under both
        names (the weight store writes it once or twice, as its engines need)."""
        if self.lora is None:
            state = self.model.state_dict()
        else:
            from peft import get_peft_model_state_dict

            state = get_peft_model_state_dict(self.model, adapter_name=self.lora.adapter_name)
        return _cpu_copies(state)

    def merge(self) -> dict[str, Tensor]:
        """The full policy state dict (the base model's names): with LoRA, base + adapter merged,
        computed on a copy so the trained model keeps its separate adapter; without, ``weights()``."""
        if self.lora is None:
            return self.weights()
        merged = copy.deepcopy(self.model).merge_and_unload()
        return _cpu_copies(merged.state_dict())

    def export(self, version: int) -> str:
        """Publish the policy as ``version``: the full weights, or with LoRA the adapter folder
        (``adapter_config.json`` + ``adapter_model.safetensors``, for ``PeftModel.from_pretrained``
        and the engines' ``load_adapter``). Returns the version's URI."""
        if self.lora is None:  # the weights themselves: the store writes them one tensor at a time, no copy
            return self.weight_store.publish(version, {k: v.detach() for k, v in self.model.state_dict().items()})
        name = self.lora.adapter_name
        with tempfile.TemporaryDirectory() as tmp:
            self.model.save_pretrained(tmp, selected_adapters=[name])
            # PEFT writes an adapter not named "default" into a subfolder of that name
            folder = Path(tmp) / name if name != "default" else Path(tmp)
            return self.weight_store.publish_folder(version, folder)

    def state_dict(self) -> dict[str, Any]:
        state = {
            "model": self._model_state(),
            "optimizer": self.optimizer.state_dict(),
            "version": self._version,
            "shuffle_rng": self._generator.get_state(),
            "torch_rng": torch.get_rng_state(),
        }
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def _model_state(self) -> dict[str, Tensor]:
        """The trained weights: the whole model, or with LoRA the adapter's parameters only (the
        base is frozen and loads from ``model_dir``)."""
        if self.lora is None:
            return self.model.state_dict()
        return {k: p.detach() for k, p in self.model.named_parameters() if p.requires_grad}

    def _load_model_state(self, weights: dict[str, Tensor]) -> None:
        if self.lora is None:
            self.model.load_state_dict(weights)
            return
        expected = self._model_state().keys()
        missing, unexpected = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not match this trainer's LoRA adapter {self.lora.adapter_name!r}: "
                f"missing {_few(missing)}, unexpected {_few(unexpected)} (was it written without LoRA, "
                "or with other target modules or adapter name?)"
            )
        self.model.load_state_dict(weights, strict=False)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_model_state(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._version = int(state["version"])
        self._generator.set_state(state["shuffle_rng"].cpu())
        torch.set_rng_state(state["torch_rng"].cpu())
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), self.device)

    def save(self, uri: str) -> None:
        """torch.save of ``state_dict()`` to ``uri``, atomically (``save_torch``); transient storage
        errors are retried as the weight store's are (``storage.max_outage_s``)."""
        storage, path = checkpoint_storage(uri, self.storage_options, self.weight_store)
        state = self.state_dict()
        storage.call(lambda: save_torch(storage.fs, path, state), path)

    def load(self, uri: str) -> None:
        from miles_core.storage.fs import is_local

        storage, path = checkpoint_storage(uri, self.storage_options, self.weight_store)
        if is_local(storage.fs):  # read from the file itself, not from a copy of its bytes
            if not os.path.isfile(path):
                raise FileNotFoundError(f"trainer checkpoint not found: {uri}")
            state = torch.load(path, map_location=self.device, weights_only=True)
        else:
            data = storage.read(path)
            if data is None:
                raise FileNotFoundError(f"trainer checkpoint not found: {uri}")
            state = torch.load(io.BytesIO(data), map_location=self.device, weights_only=True)
        self.load_state_dict(state)


def checkpoint_storage(uri: str, storage_options: dict[str, Any], weight_store: WeightPublisher):
    """The filesystem of checkpoint ``uri`` behind the weight store's retry policy (a run's:
    ``storage.max_outage_s``), and the checkpoint's path in it."""
    from miles_core.storage.fs import DEFAULT_RETRY, RetryingFS

    return RetryingFS.open(uri, storage_options, getattr(weight_store, "retry", DEFAULT_RETRY))


def _wrap_lora(model: torch.nn.Module, lora: LoraConfig, seed: int) -> torch.nn.Module:
    """``model`` as a PEFT model with one LoRA adapter (B = 0: the same function as ``model``);
    only the adapter's parameters require grad. A's random init is drawn from ``seed`` (on CPU,
    leaving the global RNG as it was), so two trainers of one config start from the same adapter."""
    try:
        import peft
    except ImportError as e:
        raise ImportError("LoRA training needs peft: pip install peft") from e
    peft_cfg = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, peft_cfg, adapter_name=lora.adapter_name)


def _uses_reference(cfg: TrainConfig) -> bool:
    """Whether either KL term (loss or reward penalty) needs the reference policy's logprobs."""
    return cfg.kl_loss_coef > 0 or cfg.kl_coef > 0


def save_torch(fs: Any, path: str, state: dict[str, Any]) -> None:
    """``torch.save(state)`` to ``path`` on ``fs``, atomically (``storage.fs.atomic_write``: a reader
    never sees half a checkpoint; a failed write, such as a full disk, names the file). Written as
    torch.save makes it, straight to the file: never a copy in memory (a full fine-tune's state is
    weights plus two AdamW moments, 1.6 GB for SmolLM2-135M)."""
    from miles_core.storage.fs import atomic_write_stream

    def write(f) -> int:
        out = _WriteErrors(f)
        try:
            torch.save(state, out)
        except RuntimeError:
            if out.error is not None:  # torch.save reports a failed write as "unexpected pos": say what failed
                raise out.error from None
            raise
        return out.written

    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    atomic_write_stream(fs, path, write)


class _WriteErrors:
    """A file for ``torch.save`` that keeps the error of a failed write (a full disk) and counts bytes."""

    def __init__(self, f) -> None:
        self.f, self.error, self.written = f, None, 0

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.written += len(data)
        return n

    def flush(self) -> None:
        self.f.flush()


def _cpu_copies(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Contiguous CPU copies, one per tensor: names that share a tensor (tied weights) share its copy."""
    copies: dict[tuple[int, int], Tensor] = {}
    out = {}
    for k, v in state.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset()) if v.numel() else (id(v), 0)
        if key not in copies:
            copies[key] = v.detach().to("cpu", copy=True).contiguous()
        out[k] = copies[key]
    return out


def _few(names: list[str], n: int = 3) -> str:
    if not names:
        return "none"
    return ", ".join(names[:n]) + (f" (and {len(names) - n} more)" if len(names) > n else "")


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def _has_rollout_logprobs(s: Sample) -> bool:
    return len(s.rollout_logprobs) == len(s.response_ids)


def _has_dropout(model: torch.nn.Module) -> bool:
    """Whether a training-mode forward pass of ``model`` is random: a dropout module with p > 0, or
    a config value above 0 whose name says dropout or jitter (``attention_dropout``, a MoE router's
    ``router_jitter_noise``), nested configs (``text_config``) included."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    return config is not None and _random_setting(config.to_dict())


def _random_setting(values: dict) -> bool:
    for key, value in values.items():
        if isinstance(value, dict) and _random_setting(value):
            return True
        if isinstance(key, str) and any(w in key for w in ("dropout", "jitter")) and isinstance(value, (int, float)) \
                and value > 0:
            return True
    return False


def _require_rollout_logprobs(samples: list[Sample], setting: str, fix: str) -> None:
    """Every trained sample (reward not None) must carry one rollout logprob per response token."""
    missing = [i for i, s in enumerate(samples) if s.reward is not None and not _has_rollout_logprobs(s)]
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise ValueError(
            f"{setting} needs rollout_logprobs on every sample; samples {missing[:8]}{more} lack them ({fix})"
        )


@contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """No dropout while computing old / reference logprobs."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
