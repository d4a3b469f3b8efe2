"""Parameter dtypes by config name (``ModelConfig.dtype``), shared by engines and trainers."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str, who: str) -> torch.dtype:
    """The torch dtype called ``name``; ``who`` names the caller in the error."""
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"{who}: dtype {name!r} is not one of {list(DTYPE_NAMES)}")
    return getattr(torch, name)
