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
   being trained, so they are fixed before any update (``step.correct_for_rollout``);
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

Loss = policy loss + kl_loss_coef * KL(pi || pi_ref) - entropy_coef * H, all reduced the same way
(``step.micro_batch_loss``).
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

The class holds the model, the optimizer and the order of a step; what it is made of lives beside
it: ``step`` (the step's arithmetic on a ``TokenBatch``: rollout correction, KL-penalised
advantages, a micro-batch's loss, the metrics summary), ``policy`` (loading the policy, its
weights out for export and in and out for checkpoints) and ``checkpoint`` (the state file on
storage, retried through the outage window).
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from miles_core.config import TrainConfig
from miles_core.dtypes import torch_dtype
from miles_core.memory import release_freed_memory
from miles_core.train import step as step_math
from miles_core.train.base import TrainBatch
from miles_core.train.batch import TokenBatch, collate, micro_batch_rows
from miles_core.train.checkpoint import checkpoint_storage, load_torch, save_torch
from miles_core.train.losses import (
    reducer_denominator,
    setup_policy_loss,
    token_logprobs,
)
from miles_core.train.policy import (
    load_policy,
    load_trained_state,
    merged_weights,
    policy_weights,
    publish_policy,
    trained_state,
)
from miles_core.train.shared_prompt import Route, forward_logits
from miles_core.types import Sample

if TYPE_CHECKING:
    from miles_core.config import LoraConfig


class WeightPublisher(Protocol):
    """The part of ``storage.WeightStore`` the trainer uses."""

    def publish(self, version: int, state_dict: dict[str, Tensor], metadata: dict | None = None) -> str: ...

    def publish_folder(self, version: int, local_dir: str | Path) -> str:
        """Publish a local folder's files (a LoRA adapter); only used with LoRA."""


class TorchTrainer:
    """``step(batch)`` in parts that are public, so that ``AdapterBank`` can fuse several trainers'
    steps into one pass over a shared base: ``plan`` (tensors and minibatches), per minibatch
    ``loss_denominator``, ``trained_micro_batches``, ``loss_of`` a micro-batch's logits,
    ``keep_metrics``, then ``apply_gradients``; ``summarize`` the step. A trainer of a model built
    elsewhere calls ``setup`` instead of the constructor, and a subclass may replace ``logits`` (a
    micro-batch's pass), ``reference`` (the reference policy) and ``model_state`` /
    ``load_model_state`` (what a checkpoint holds of the model): ``BankedLoraTrainer`` does all
    four, ``DeepSpeedTrainer`` the first."""

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
        self.dtype = torch_dtype(dtype, "TorchTrainer")
        """The run's model dtype: the policy is loaded in it."""
        model = load_policy(model_dir, train_cfg, self.dtype, lora).to(self._select_device(train_cfg))
        self.setup(model, [p for p in model.parameters() if p.requires_grad], train_cfg, weight_store,
                   lora=lora, version=initial_version, storage_options=storage_options)
        # The reference policy is the starting weights; a frozen copy is kept only when the KL term
        # is on and there is no adapter to switch off (with LoRA the base itself is the reference).
        if _uses_reference(train_cfg) and lora is None:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)

    def setup(self, model: torch.nn.Module, params: list[torch.nn.Parameter], train_cfg: TrainConfig,
              weight_store: WeightPublisher, *, lora: LoraConfig | None = None, version: int = 0,
              storage_options: dict[str, Any] | None = None, random_forward: bool | None = None) -> None:
        """Train ``params`` of ``model`` (on its device) with AdamW, from weights ``version``,
        shuffling from ``train_cfg.seed``. The constructor calls it with the policy it loads; a
        trainer of a model built elsewhere (an ``AdapterBank``'s adapter) calls it instead of the
        constructor. ``random_forward``: whether a training-mode pass is random (default: the model
        has dropout, ``has_dropout``)."""
        self.cfg, self.lora = train_cfg, lora
        self.policy_loss = setup_policy_loss(train_cfg.loss)
        self.weight_store, self.storage_options = weight_store, storage_options or {}
        self.model, self.device = model, next(model.parameters()).device
        self.ref_model: torch.nn.Module | None = None
        """The frozen reference policy when one is kept (``reference``)."""
        self._random_forward = has_dropout(model) if random_forward is None else random_forward
        """A training-mode forward pass is random (dropout, jitter): two passes differ (``_one_pass``)."""
        self._mismatch_denom: float | None = None
        """One pass: the tokens the mismatch metrics average over (None: no metrics)."""
        cfg = self.cfg
        self.params = params
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                           weight_decay=cfg.weight_decay)
        self.pad_id = self.model.config.pad_token_id or 0
        self._generator = torch.Generator().manual_seed(cfg.seed)
        self._version = version

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
        return step_math.summarize(batch, tokens, correction_metrics, results, bool(self._mismatch_denom), self._version)

    def _prepare(self, batch: TrainBatch) -> tuple[TokenBatch, dict[str, float]]:
        """The batch's tensors, and the rollout-correction metrics (``step.correct_for_rollout``)."""
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
            metrics = step_math.correct_for_rollout(self.cfg, tokens)
        else:
            _require_rollout_logprobs(
                batch.samples, "train.old_logprobs='rollout'", "use old_logprobs='recompute' or an engine that reports them"
            )
            tokens.old_logprobs = tokens.rollout_logprobs
        if _uses_reference(self.cfg):
            with self.reference() as ref:
                tokens.ref_logprobs = self._forward_logprobs(ref, tokens, batch.temperature)
        if self.cfg.kl_coef > 0:
            metrics.update(step_math.kl_penalised_advantages(self.cfg, batch, tokens))
        return tokens, metrics

    @contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """The reference policy: the frozen copy, or with LoRA the model with its adapter off."""
        if self.ref_model is not None:
            yield self.ref_model
            return
        with self.model.disable_adapter():
            yield self.model

    def _one_pass(self, num_rows: int) -> bool:
        """Whether the loss pass's own detached logprobs stand for a separate old-logprob pass (see
        the module docstring): recomputed, one optimizer step, nothing needing them before the loss
        pass, and no dropout to make two passes differ."""
        cfg = self.cfg
        return (cfg.old_logprobs == "recompute" and len(cfg.minibatch_sizes(num_rows)) == 1
                and cfg.kl_coef == 0 and (not cfg.use_tis or cfg.tis_mode == "truncate") and not self._random_forward)

    def _micro_batches(self, tokens: TokenBatch) -> Iterator[tuple[Tensor, TokenBatch]]:
        """``tokens`` in micro-batches (``micro_batch_size`` rows, or with ``use_dynamic_batch_size``
        as many as fit ``max_tokens_per_gpu``): (row indices into ``tokens``, rows)."""
        max_tokens = self.cfg.max_tokens_per_gpu if self.cfg.use_dynamic_batch_size else None
        for rows in micro_batch_rows(tokens.lengths.cpu(), self.cfg.micro_batch_size, max_tokens):
            rows = rows.to(self.device)
            yield rows, tokens.select(rows)

    def logits(self, model: torch.nn.Module, mb: TokenBatch, route: Route | None = None) -> Tensor:
        """The raw logits of ``model`` (its dtype), aligned like ``mb.labels`` (the shared-prompt pass
        when ``share_prompt_forward`` is on: ``shared_prompt``). The temperature is applied chunk by
        chunk where they are used (``token_logprobs_and_entropy``), never to a copy of the whole."""
        # a checkpointed layer is run again in the backward pass, and would write the shared prompt's cache twice
        share = self.cfg.share_prompt_forward and not (self.cfg.gradient_checkpointing and torch.is_grad_enabled())
        return forward_logits(model, mb, share, route)

    @torch.no_grad()
    def _forward_logprobs(self, model: torch.nn.Module, tokens: TokenBatch, temperature: float) -> Tensor:
        out = torch.zeros_like(tokens.loss_mask)
        with _eval_mode(model):
            for rows, mb in self._micro_batches(tokens):
                lp = token_logprobs(self.logits(model, mb), mb.labels, temperature)
                out[rows, : lp.shape[1]] = lp  # (a DeepSpeed rank's stand-in has no rows)
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
        return [mb for _, mb in self._micro_batches(minibatch) if mb.loss_mask.any()]

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
        return self.loss_of(mb, self.logits(self.model, mb), denom, temperature)

    def loss_of(self, mb: TokenBatch, logits: Tensor, denom: float,
                 temperature: float) -> tuple[Tensor, dict[str, Tensor]]:
        """``_micro_loss`` from the micro-batch's raw logits (the policy's) and the batch's temperature
        (``step.micro_batch_loss``)."""
        return step_math.micro_batch_loss(self.cfg, self.policy_loss, mb, logits, denom, temperature,
                                          self._mismatch_denom)

    # ------------------------------------------------------------------------- weights and state

    def weights(self) -> dict[str, Tensor]:
        """What ``export`` publishes, as CPU copies (``policy.policy_weights``): the policy's state dict,
        or with LoRA the adapter's (``merge()`` gives the full weights)."""
        return policy_weights(self.model, self.lora)

    def merge(self) -> dict[str, Tensor]:
        """The full policy state dict (the base model's names), with LoRA the adapter merged into a copy."""
        return merged_weights(self.model, self.lora)

    def export(self, version: int) -> str:
        """Publish the policy as ``version`` (``policy.publish_policy``: the full weights, or with LoRA
        the adapter in PEFT's folder format); returns the version's URI."""
        return publish_policy(self.model, self.lora, self.weight_store, version)

    def state_dict(self) -> dict[str, Any]:
        state = {
            "model": self.model_state(),
            "optimizer": self.optimizer.state_dict(),
            "version": self._version,
            "shuffle_rng": self._generator.get_state(),
            "torch_rng": torch.get_rng_state(),
        }
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def model_state(self) -> dict[str, Tensor]:
        """The trained weights (``policy.trained_state``; with LoRA the adapter's only)."""
        return trained_state(self.model, self.lora)

    def load_model_state(self, weights: dict[str, Tensor]) -> None:
        load_trained_state(self.model, self.lora, weights)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_model_state(state["model"])
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
        self.load_state_dict(load_torch(uri, self.storage_options, self.weight_store, self.device))


def _uses_reference(cfg: TrainConfig) -> bool:
    """Whether either KL term (loss or reward penalty) needs the reference policy's logprobs."""
    return cfg.kl_loss_coef > 0 or cfg.kl_coef > 0


def _has_rollout_logprobs(s: Sample) -> bool:
    return len(s.rollout_logprobs) == len(s.response_ids)


def has_dropout(model: torch.nn.Module) -> bool:
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
