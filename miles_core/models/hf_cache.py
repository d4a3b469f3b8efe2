"""The forward argument that takes a Hugging Face attention cache: ``cache`` in transformers >= 5.24,
``past_key_values`` before. The trainer's shared-prompt pass and the engine's decode loop both pass
one (``cache_kwarg(model)``, read once per model class from its signature)."""

from __future__ import annotations

import inspect

from torch import nn

_KWARGS: dict[type, str] = {}


def cache_kwarg(model: nn.Module) -> str:
    """For ``model`` or whatever wraps it (PEFT, DeepSpeed): the name its Hugging Face model's
    ``forward`` takes the cache under."""
    from transformers import PreTrainedModel

    hf = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if hf is None:
        raise TypeError(f"{type(model).__name__} is not a Hugging Face causal LM: it takes no attention cache "
                        "(for the trainer, set train.share_prompt_forward = false)")
    cls = type(hf)
    if cls not in _KWARGS:
        _KWARGS[cls] = "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
    return _KWARGS[cls]
