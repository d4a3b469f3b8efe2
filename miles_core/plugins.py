"""User extension points named by a ``"package.module:attribute"`` path in the config.

``load_object(path, what)`` imports the module and returns the attribute; errors say which
extension point (``what``) could not be loaded, and how to write the path. Modules are found on
``sys.path`` and in the current directory (as ``python -m`` would), so a run started from a
project folder can name its own files, e.g. ``examples.multi_turn:generate``.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def load_object(path: str, what: str) -> Any:
    """The object at ``"package.module:attribute"`` (``what`` names the extension point in errors)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {path!r}: write it as 'package.module:attribute'")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"{what} {path!r}: cannot import module {module_name!r} ({type(e).__name__}: {e}); "
            "check the spelling and that the module is installed or on PYTHONPATH"
        ) from e
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(obj):
        raise ValueError(f"{what} {path!r}: {attr!r} is a {type(obj).__name__}, not a function or class")
    return obj
