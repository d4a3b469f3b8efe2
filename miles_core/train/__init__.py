"""Training: advantage and loss math, the Trainer protocol, and its implementations.

- ``advantages``: GRPO / Dr.GRPO group advantages, REINFORCE++ batch-whitened advantages, picked by
  the loss config's ``type`` (pure functions; failed samples get 0).
- ``losses``: the policy losses (PPO clip with optional dual clip, Dr.GRPO, GSPO) and their registry
  ``setup_policy_loss``, KL estimators, token logprobs, entropy, reducers, rollout correction
  (truncated / masked importance weights, trainer-vs-rollout mismatch metrics); pure functions.
- ``base``: ``TrainBatch`` and the ``Trainer`` protocol.
- ``batch``: samples -> right-padded tensors aligned for next-token prediction.
- ``torch_trainer``: ``TorchTrainer`` (one process, AdamW, gradient accumulation).
- ``deepspeed_trainer``: ``DeepSpeedTrainer`` (TorchTrainer's loss on a DeepSpeed engine: ZeRO 0-3,
  bf16, data parallel); ``launch``: ``LaunchedTrainer``, its ranks in other processes
  (``worker``), when ``num_processes > 1``.
- ``setup_trainer(train_cfg, model_dir, weight_store, dtype, lora)``: the trainer ``train_cfg.backend``
  names (``lora``: a ``LoraConfig`` to train an adapter instead of the full policy).

Importing this package does not import torch; the backends are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_core.config import LoraConfig, TrainConfig
    from miles_core.train.base import Trainer

# backend ``type`` -> "module:factory" (a class or a function), imported on first use
_BACKENDS = {
    "torch": "miles_core.train.torch_trainer:TorchTrainer",
    "deepspeed": "miles_core.train.launch:setup_deepspeed",
}


def setup_trainer(
    train_cfg: TrainConfig,
    model_dir: str,
    weight_store: Any,
    dtype: str = "float32",
    lora: LoraConfig | None = None,
    **kwargs: Any,
) -> Trainer:
    """Build the trainer named by ``train_cfg.backend.type``; ``lora`` (None: full fine-tuning) and
    ``kwargs`` go to its constructor."""
    module_name, class_name = _BACKENDS[train_cfg.backend.type].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(model_dir, train_cfg, weight_store, dtype=dtype, lora=lora, **kwargs)
