"""TorchTrainer: the plain-torch ``Trainer`` (one process, AdamW, gradient accumulation).

One ``step(batch)``:
1. collate the samples (``batch.collate``) and attach advantages, the PPO ratio denominator
   (recomputed by a no-grad forward pass, or the rollout engine's logprobs) and, when
   ``kl_coef > 0``, the frozen reference policy's logprobs;
2. shuffle the samples (seeded generator, saved in checkpoints) and cut them into optimizer
   minibatches of ``global_batch_size`` samples (None: the whole batch, one optimizer step; the
   last minibatch is smaller when the batch does not divide, and a minibatch with no trained token
   is skipped: no optimizer step, no new version);
3. per minibatch, accumulate gradients over micro-batches of ``micro_batch_size`` samples. Each
   micro-batch's loss is divided by the *minibatch's* denominator (its masked-token count for
   ``token_mean``, its number of trained sequences for ``seq_mean``), so the accumulated gradient is
   the gradient of the minibatch loss, whatever the micro-batch size;
4. clip the gradient norm, take an AdamW step, and count one more version.

Loss = PPO clip loss + kl_coef * KL(pi || pi_ref), both reduced the same way. Logprobs are those of
``logits / temperature`` (raw logits when the temperature is 0), as the rollout engines report them.
"""

from __future__ import annotations

import copy
import io
import math
import posixpath
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import fsspec
import torch
from torch import Tensor

from miles_core.config import TrainConfig
from miles_core.dtypes import torch_dtype
from miles_core.train.base import TrainBatch
from miles_core.train.batch import TokenBatch, collate
from miles_core.train.losses import (
    entropy_from_logits,
    kl_penalty,
    ppo_clip_loss,
    reduce_tokens,
    reducer_denominator,
    token_logprobs,
)

_AVERAGED = ("loss", "pg_loss", "kl", "entropy", "clipfrac", "ratio_mean", "approx_kl", "grad_norm")


class WeightPublisher(Protocol):
    """The part of ``storage.WeightStore`` the trainer uses."""

    def publish(self, version: int, state_dict: dict[str, Tensor], metadata: dict | None = None) -> str: ...


class TorchTrainer:
    def __init__(
        self,
        model_dir: str,
        train_cfg: TrainConfig,
        weight_store: WeightPublisher,
        dtype: str = "float32",
        initial_version: int = 0,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        torch_dt = torch_dtype(dtype, "TorchTrainer")
        self.cfg = train_cfg
        self.weight_store = weight_store
        self.storage_options = storage_options or {}
        self.device = torch.device(train_cfg.backend.device)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dt).to(self.device)
        self.model.train()
        # The reference policy is the starting weights; kept only when the KL term is on.
        self.ref_model = None
        if train_cfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
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

    @property
    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------------------------------ step

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """Train on ``batch``. Metrics are averaged over its optimizer steps (NaN if none was taken):
        ``loss``, ``pg_loss``, ``kl`` (0 when ``kl_coef`` is 0), ``entropy``, ``clipfrac``,
        ``ratio_mean``, ``approx_kl``, ``grad_norm`` (before clipping); plus counts:
        ``num_optimizer_steps``, ``train_tokens``, ``num_samples``, ``num_excluded_samples`` (reward
        None) and ``version`` after the step."""
        if not batch.samples:
            raise ValueError("TrainBatch has no samples")
        tokens = self._prepare(batch)
        n = tokens.num_rows
        size = self.cfg.global_batch_size or n
        order = torch.randperm(n, generator=self._generator).to(self.device)
        per_step = []
        for start in range(0, n, size):
            metrics = self._optimizer_step(tokens.select(order[start : start + size]), batch.temperature)
            if metrics is not None:
                per_step.append(metrics)
        summary = {k: sum(m[k] for m in per_step) / len(per_step) if per_step else math.nan for k in _AVERAGED}
        excluded = sum(1 for s in batch.samples if s.reward is None)
        summary.update(
            num_optimizer_steps=float(len(per_step)),
            train_tokens=float(tokens.loss_mask.sum()),
            num_samples=float(n),
            num_excluded_samples=float(excluded),
            version=float(self._version),
        )
        return summary

    def _prepare(self, batch: TrainBatch) -> TokenBatch:
        tokens = collate(batch.samples, self.pad_id).to(self.device)
        tokens.advantages = torch.tensor(batch.advantages, dtype=torch.float32, device=self.device)
        if self.cfg.old_logprobs == "recompute":
            tokens.old_logprobs = self._forward_logprobs(self.model, tokens, batch.temperature)
        else:
            missing = [
                i
                for i, s in enumerate(batch.samples)
                if s.reward is not None and len(s.rollout_logprobs) != len(s.response_ids)
            ]
            if missing:
                raise ValueError(
                    f"train.old_logprobs='rollout' needs rollout_logprobs on every sample; samples "
                    f"{missing[:8]} lack them (use old_logprobs='recompute' or an engine that reports them)"
                )
            tokens.old_logprobs = tokens.rollout_logprobs
        if self.ref_model is not None:
            tokens.ref_logprobs = self._forward_logprobs(self.ref_model, tokens, batch.temperature)
        return tokens

    def _micro_batches(self, tokens: TokenBatch) -> Iterator[TokenBatch]:
        rows = torch.arange(tokens.num_rows, device=self.device)
        for start in range(0, tokens.num_rows, self.cfg.micro_batch_size):
            yield tokens.select(rows[start : start + self.cfg.micro_batch_size])

    def _logits(self, model: torch.nn.Module, mb: TokenBatch, temperature: float) -> Tensor:
        out = model(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, use_cache=False
        )
        return out.logits.float() / (temperature if temperature > 0 else 1.0)

    @torch.no_grad()
    def _forward_logprobs(self, model: torch.nn.Module, tokens: TokenBatch, temperature: float) -> Tensor:
        out = torch.zeros_like(tokens.loss_mask)
        start = 0
        with _eval_mode(model):
            for mb in self._micro_batches(tokens):
                lp = token_logprobs(self._logits(model, mb, temperature), mb.labels)
                out[start : start + mb.num_rows, : lp.shape[1]] = lp
                start += mb.num_rows
        return out

    def _optimizer_step(self, minibatch: TokenBatch, temperature: float) -> dict[str, float] | None:
        denom = reducer_denominator(minibatch.loss_mask, self.cfg.loss_reducer)
        if denom == 0:  # every sample in it is failed or fully masked: nothing to learn from
            return None
        sums: dict[str, float] = defaultdict(float)
        for mb in self._micro_batches(minibatch):
            if not mb.loss_mask.any():
                continue
            loss, metrics = self._micro_loss(mb, denom, temperature)
            loss.backward()
            for k, v in metrics.items():
                sums[k] += float(v)
        max_norm = self.cfg.clip_grad if self.cfg.clip_grad > 0 else math.inf
        sums["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._version += 1
        return dict(sums)

    def _micro_loss(self, mb: TokenBatch, denom: float, temperature: float) -> tuple[Tensor, dict[str, Tensor]]:
        """This micro-batch's share of the minibatch loss (divided by the minibatch's ``denom``)."""
        cfg, reducer = self.cfg, self.cfg.loss_reducer
        logits = self._logits(self.model, mb, temperature)
        logprobs = token_logprobs(logits, mb.labels)
        pg_loss, metrics = ppo_clip_loss(
            logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, cfg.eps_clip, cfg.clip_high, reducer, denom
        )
        loss = pg_loss
        kl = torch.zeros(())
        if self.ref_model is not None:
            kl = reduce_tokens(kl_penalty(logprobs, mb.ref_logprobs, cfg.kl_type), mb.loss_mask, reducer, denom)
            loss = loss + cfg.kl_coef * kl
        with torch.no_grad():
            metrics["entropy"] = reduce_tokens(entropy_from_logits(logits), mb.loss_mask, reducer, denom)
        metrics.update(loss=loss.detach(), pg_loss=pg_loss.detach(), kl=kl.detach())
        return loss, metrics

    # ------------------------------------------------------------------------- weights and state

    def weights(self) -> dict[str, Tensor]:
        """The policy's state dict on CPU, every tensor its own contiguous copy.

        Tied parameters (``lm_head.weight`` is ``embed_tokens.weight``) become separate copies, which
        safetensors accepts and ``load_state_dict`` loads back into the tied model."""
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in self.model.state_dict().items()}

    def export(self, version: int) -> str:
        return self.weight_store.publish(version, self.weights())

    def state_dict(self) -> dict[str, Any]:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "version": self._version,
            "shuffle_rng": self._generator.get_state(),
            "torch_rng": torch.get_rng_state(),
        }
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._version = int(state["version"])
        self._generator.set_state(state["shuffle_rng"].cpu())
        torch.set_rng_state(state["torch_rng"].cpu())
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), self.device)

    def save(self, uri: str) -> None:
        """torch.save of ``state_dict()`` to ``uri``, written to ``<uri>.tmp`` then moved into place."""
        buffer = io.BytesIO()
        torch.save(self.state_dict(), buffer)
        fs, path = fsspec.core.url_to_fs(uri, **self.storage_options)
        parent = posixpath.dirname(path)
        if parent:
            fs.makedirs(parent, exist_ok=True)
        with fs.open(path + ".tmp", "wb") as f:
            f.write(buffer.getvalue())
        fs.mv(path + ".tmp", path)

    def load(self, uri: str) -> None:
        fs, path = fsspec.core.url_to_fs(uri, **self.storage_options)
        if not fs.exists(path):
            raise FileNotFoundError(f"trainer checkpoint not found: {uri}")
        with fs.open(path, "rb") as f:
            data = f.read()
        self.load_state_dict(torch.load(io.BytesIO(data), map_location=self.device, weights_only=True))


@contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """No dropout while computing old / reference logprobs."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
