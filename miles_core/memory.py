"""Process memory: ``release_freed_memory`` gives what the C allocator keeps after frees back to the system.

A training step frees its gradients and activations, and a rollout its KV caches (SmolLM2-135M: about
1 GB a step between them). glibc keeps freed memory for reuse, in one arena per thread that
allocated it, so without a trim a process's resident memory grows to the sum of what each phase
left behind. Calling it once per step costs milliseconds.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

_TRIM: Any = None


def release_freed_memory() -> None:
    """``malloc_trim(0)``: every arena's free pages go back to the system. Nothing where the C library
    is not glibc, or with ``MILES_MALLOC_TRIM=0``."""
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM and os.environ.get("MILES_MALLOC_TRIM", "1") != "0":
        _TRIM(0)
