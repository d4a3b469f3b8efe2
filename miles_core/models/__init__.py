"""Policy models: what ``model.path`` names, and the folder a run starts from.

``model.path`` is one of
- a built-in model by name, with or without ``builtin:`` in front: ``tiny-addition`` (the tiny
  character-level model of ``tiny``, shipped and rebuilt from its recipe) or a pretrained model
  that a package ships (``packaged``: ``smollm2-135m-instruct``);
- a local Hugging Face model folder (``config.json``, weights, tokenizer). A folder whose name is
  also a built-in model's is written with a slash: ``./smollm2-135m-instruct``.

``ensure_model(model_cfg, log)`` returns the folder, building or importing a built-in model into
``model_cfg.cache_dir`` once. Errors name the value and what to do (``ModelUnavailable``, a
``ValueError``, for an unknown name or a package that cannot be had; ``FileNotFoundError`` for a
folder that is not there).
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

from miles_core.models.packaged import PACKAGED, ModelUnavailable, ensure_packaged
from miles_core.models.tiny import BUILTIN_TINY, ensure_tiny

if TYPE_CHECKING:
    from miles_core.config import ModelConfig

TINY = BUILTIN_TINY.removeprefix("builtin:")
BUILTIN_MODELS: dict[str, str] = {TINY: "the tiny character-level addition model (1M parameters; tests and demo)",
                                  **{name: m.description for name, m in PACKAGED.items()}}

__all__ = ["BUILTIN_MODELS", "BUILTIN_TINY", "ModelUnavailable", "builtin_name", "ensure_model", "tiny_model_threads"]


def builtin_name(path: str) -> str | None:
    """The built-in model ``path`` names (``tiny-addition``, ``smollm2-135m-instruct``), or None when it
    names a folder. Raises ``ModelUnavailable`` for ``builtin:`` or a bare word that no model has."""
    name = path.removeprefix("builtin:")
    if name in BUILTIN_MODELS:
        return name
    if path.startswith("builtin:") or ("/" not in path and not Path(path).expanduser().exists()):
        known = ", ".join(BUILTIN_MODELS)
        raise ModelUnavailable(f"model.path={path!r} is neither a built-in model ({known}) nor a local folder: use "
                               f"one of those names, or the path of a Hugging Face model folder")
    return None


def tiny_model_threads(model_path: str, env: MutableMapping[str, str] = os.environ) -> None:
    """``OMP_NUM_THREADS=1`` in ``env`` for a run of the built-in tiny model, unless set already
    (why: ``miles_core.threads``)."""
    try:
        tiny = builtin_name(model_path) == TINY
    except ModelUnavailable:  # said later, where the run looks for its model
        tiny = False
    if tiny:
        env.setdefault("OMP_NUM_THREADS", "1")


def ensure_model(model_cfg: ModelConfig, log: Callable[[str], None] = print, shipped: bool = True) -> Path:
    """The folder of the starting policy ``model_cfg.path`` names (see the module docstring)."""
    name = builtin_name(model_cfg.path)
    cache = Path(model_cfg.cache_dir)
    if name == TINY:
        return ensure_tiny(model_cfg.recipe, cache, log, shipped)
    if name is not None:
        return ensure_packaged(PACKAGED[name], cache, log)
    path = Path(model_cfg.path).expanduser()
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise FileNotFoundError(
            f"model.path={model_cfg.path!r} {what}: point it at a local Hugging Face model folder "
            f"(config.json, weights and tokenizer, e.g. from `hf download` or save_pretrained), "
            f"or name a built-in model ({', '.join(BUILTIN_MODELS)})")
    return path
