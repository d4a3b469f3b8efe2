"""Prompt data: datasets (JSONL / Parquet over fsspec), prompt rendering, and the DataSource cursor.

The toy addition task lives in ``miles_core.data.toy``; its rows go through ``rows_from_dicts``
into the same ``DataSource`` as file rows.
"""

from miles_core.data.datasets import PromptRow, load_prompt_rows, render_prompt, rows_from_dicts
from miles_core.data.source import DataSource

__all__ = ["DataSource", "PromptRow", "load_prompt_rows", "render_prompt", "rows_from_dicts"]
