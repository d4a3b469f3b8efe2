"""Policy models: the built-in tiny model and the check of local Hugging Face folders (``tiny``)."""

from miles_core.models.tiny import BUILTIN_TINY, ensure_model

__all__ = ["BUILTIN_TINY", "ensure_model"]
