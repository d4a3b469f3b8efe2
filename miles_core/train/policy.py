"""The policy a trainer trains, and its weights going out and coming back.

- ``load_policy``: the model from ``model_dir`` in the run's dtype, with gradient checkpointing
  when asked, and with ``lora`` wrapped by PEFT with one adapter (B = 0, so version 0 is the base;
  only the adapter's parameters require grad).
- Out, for the weight store: ``policy_weights`` (what ``export`` publishes, as CPU copies),
  ``merged_weights`` (with LoRA, base + adapter merged) and ``publish_policy`` (the full weights,
  or with LoRA the adapter in PEFT's folder format).
- In and out, for checkpoints: ``trained_state`` (the whole model, or with LoRA the adapter's
  parameters only: the frozen base comes from ``model_dir`` again) and ``load_trained_state``.

``TorchTrainer`` and ``DeepSpeedTrainer`` hold the model; these functions know what it is.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from miles_core.config import LoraConfig, TrainConfig


def load_policy(model_dir: str, train_cfg: TrainConfig, dtype: torch.dtype, lora: LoraConfig | None) -> torch.nn.Module:
    """The policy to train, in ``dtype``, in training mode, on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    if train_cfg.gradient_checkpointing:  # not reentrant: needs no gradient on the inputs (a LoRA base's are frozen)
        enable = getattr(model, "activation_checkpointing_enable", None)  # its name from transformers 5.2x on
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = model if lora is None else _wrap_lora(model, lora, train_cfg.seed)
    model.train()
    return model


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


# --------------------------------------------------------------------------------- weights out


def policy_weights(model: torch.nn.Module, lora: LoraConfig | None) -> dict[str, Tensor]:
    """What ``publish_policy`` publishes, on CPU, every tensor its own contiguous copy: the policy's
    state dict, or with LoRA the adapter's state dict (PEFT's names, as in
    ``adapter_model.safetensors``; ``merged_weights`` gives the full weights).

    Tied parameters (``lm_head.weight`` is ``embed_tokens.weight``) stay one tensor under both
    names (the weight store writes it once or twice, as its engines need)."""
    if lora is None:
        state = model.state_dict()
    else:
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(model, adapter_name=lora.adapter_name)
    return _cpu_copies(state)


def merged_weights(model: torch.nn.Module, lora: LoraConfig | None) -> dict[str, Tensor]:
    """The full policy state dict (the base model's names): with LoRA, base + adapter merged,
    computed on a copy so the trained model keeps its separate adapter; without, ``policy_weights``."""
    if lora is None:
        return policy_weights(model, lora)
    merged = copy.deepcopy(model).merge_and_unload()
    return _cpu_copies(merged.state_dict())


def publish_policy(model: torch.nn.Module, lora: LoraConfig | None, weight_store: Any, version: int) -> str:
    """Publish the policy as ``version`` to ``weight_store``: the full weights, or with LoRA the
    adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``, for
    ``PeftModel.from_pretrained`` and the engines' ``load_adapter``). Returns the version's URI."""
    if lora is None:  # the weights themselves: the store writes them one tensor at a time, no copy
        return weight_store.publish(version, {k: v.detach() for k, v in model.state_dict().items()})
    name = lora.adapter_name
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, selected_adapters=[name])
        # PEFT writes an adapter not named "default" into a subfolder of that name
        folder = Path(tmp) / name if name != "default" else Path(tmp)
        return weight_store.publish_folder(version, folder)


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


# ---------------------------------------------------------------------------------- checkpoints


def trained_state(model: torch.nn.Module, lora: LoraConfig | None) -> dict[str, Tensor]:
    """The trained weights: the whole model, or with LoRA the adapter's parameters only (the
    base is frozen and loads from ``model_dir``)."""
    if lora is None:
        return model.state_dict()
    return {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}


def load_trained_state(model: torch.nn.Module, lora: LoraConfig | None, weights: dict[str, Tensor]) -> None:
    """Put ``trained_state``'s weights back; with LoRA, ValueError naming the adapter when they are
    another adapter's (or a full model's)."""
    if lora is None:
        model.load_state_dict(weights)
        return
    expected = trained_state(model, lora).keys()
    missing, unexpected = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match this trainer's LoRA adapter {lora.adapter_name!r}: "
            f"missing {few(missing)}, unexpected {few(unexpected)} (was it written without LoRA, "
            "or with other target modules or adapter name?)"
        )
    model.load_state_dict(weights, strict=False)


def few(names: list[str], n: int = 3) -> str:
    """The first ``n`` of ``names`` for an error message, and how many more there are."""
    if not names:
        return "none"
    return ", ".join(names[:n]) + (f" (and {len(names) - n} more)" if len(names) > n else "")
