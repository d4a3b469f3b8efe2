"""Prompt datasets: rows from JSONL or Parquet files, and how a row becomes prompt text.

- ``PromptRow``: one prompt of a dataset (its 0-based index, text, label, metadata).
- ``rows_from_dicts``: checks and converts raw records (from a file or the toy task) into rows;
  every error names the source, the row (or JSONL line) and the fix.
- ``load_prompt_rows(cfg)``: reads a ``FileDataConfig``'s file through fsspec (a local path,
  ``file://``, ``s3://`` with ``cfg.storage_options``, ``memory://`` ...).
- ``render_prompt(row, cfg, tokenizer)``: applies ``cfg.prompt_template`` and, when asked, the
  tokenizer's chat template.

fsspec and pyarrow are imported on use, so ``miles_core.data`` imports without them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_core.config import FileDataConfig

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


@dataclass
class PromptRow:
    """One prompt of a dataset."""

    index: int
    """0-based position of the row in its dataset (blank JSONL lines are not rows)."""
    prompt: str
    """The prompt text, before ``prompt_template`` and the chat template."""
    label: str | None = None
    """Reference answer handed to the reward (None when the dataset has no label)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Fields named by ``metadata_keys``, copied into each sample's metadata."""


# ------------------------------------------------------------------------------------ records


def rows_from_dicts(
    records: Sequence[Any],
    input_key: str,
    label_key: str | None,
    source_name: str,
    metadata_keys: Sequence[str] = (),
    line_numbers: Sequence[int] | None = None,
) -> list[PromptRow]:
    """Check raw records and turn them into ``PromptRow``s (index = position in ``records``).

    ``line_numbers`` (1-based, one per record) makes errors point at file lines instead of rows.
    Labels that are numbers become strings (``72`` -> ``"72"``); other non-string labels are
    JSON-encoded so a custom reward can decode them."""
    if not records:
        raise ValueError(f"{source_name}: the dataset has no rows; point data.path at a non-empty file")
    rows = []
    for i, record in enumerate(records):
        where = f"{source_name}: line {line_numbers[i]}" if line_numbers is not None else f"{source_name}: row {i + 1}"
        rows.append(_row_from_dict(i, record, input_key, label_key, metadata_keys, where))
    return rows


def _row_from_dict(
    index: int, record: Any, input_key: str, label_key: str | None, metadata_keys: Sequence[str], where: str
) -> PromptRow:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object per row, got {type(record).__name__}")
    prompt = _require(record, input_key, where, "data.input_key")
    if not isinstance(prompt, str):
        raise ValueError(
            f"{where}: prompt field {input_key!r} must be a string, got {type(prompt).__name__}; "
            "set data.input_key to the field that holds the prompt text"
        )
    label = None
    if label_key is not None:
        label = _label_text(_require(record, label_key, where, "data.label_key (or null for no label)"))
    metadata = {key: _require(record, key, where, "data.metadata_keys") for key in metadata_keys}
    return PromptRow(index=index, prompt=prompt, label=label, metadata=metadata)


def _require(record: dict[str, Any], key: str, where: str, setting: str) -> Any:
    if key not in record:
        raise ValueError(
            f"{where}: missing key {key!r}; the row has keys {sorted(record)}; set {setting} to one of them"
        )
    value = record[key]
    if value is None:
        raise ValueError(f"{where}: key {key!r} is null; fix the row or drop it from the file")
    return value


def _label_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return str(value)
    return json.dumps(value, sort_keys=True)


# --------------------------------------------------------------------------------------- files


def load_prompt_rows(cfg: FileDataConfig) -> list[PromptRow]:
    """Read the prompt rows of ``cfg.path`` (JSONL, JSON lines or a JSON array, or Parquet)."""
    from fsspec.core import url_to_fs

    fs, fs_path = url_to_fs(cfg.path, **cfg.storage_options)
    suffix = PurePosixPath(fs_path).suffix.lower()
    if suffix not in JSONL_SUFFIXES + PARQUET_SUFFIXES:
        raise ValueError(
            f"{cfg.path}: unsupported dataset file type {suffix or '(no extension)'!r}; "
            f"use one of {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}"
        )
    if not fs.exists(fs_path):
        raise FileNotFoundError(
            f"dataset file not found: {cfg.path} (data.path; a relative path is resolved from the working "
            "directory; check the path, or data.storage_options for remote storage)"
        )
    if suffix in PARQUET_SUFFIXES:
        return _load_parquet(fs, fs_path, cfg)
    with fs.open(fs_path, "r", encoding="utf-8") as f:
        records, lines = _read_json_records(f, cfg.path, allow_array=suffix == ".json")
    return rows_from_dicts(records, cfg.input_key, cfg.label_key, cfg.path, cfg.metadata_keys, lines)


def _read_json_records(
    lines: Iterable[str], name: str, allow_array: bool
) -> tuple[list[Any], list[int] | None]:
    """Records of a JSON-lines file (blank lines skipped) with their 1-based line numbers. With
    ``allow_array`` (``.json`` files), a file whose first non-blank character is ``[`` is read as
    one JSON array of objects instead (errors then name rows, not lines)."""
    records: list[Any] = []
    numbers: list[int] = []
    it = iter(lines)
    for number, line in enumerate(it, start=1):
        text = line.strip()
        if not text:
            continue
        if allow_array and not records and text.startswith("["):
            whole = line + "".join(it)
            try:
                array = json.loads(whole)
            except json.JSONDecodeError as e:
                raise ValueError(f"{name}: not valid JSON ({e.msg} at line {number + e.lineno - 1})") from None
            if not isinstance(array, list):
                raise ValueError(f"{name}: expected a JSON array of objects or one JSON object per line")
            return array, None
        try:
            records.append(json.loads(text))
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{name}: line {number}: malformed JSON ({e.msg} at column {e.colno}); "
                "each line must be one JSON object; fix or remove the line"
            ) from None
        numbers.append(number)
    return records, numbers


def _load_parquet(fs: Any, fs_path: str, cfg: FileDataConfig) -> list[PromptRow]:
    import pyarrow.parquet as pq

    keys = [cfg.input_key, *([cfg.label_key] if cfg.label_key is not None else []), *cfg.metadata_keys]
    with fs.open(fs_path, "rb") as f:
        try:
            parquet = pq.ParquetFile(f)
        except Exception as e:  # pyarrow raises ArrowInvalid for a file that is not Parquet
            raise ValueError(f"{cfg.path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        names = parquet.schema_arrow.names
        for key in dict.fromkeys(keys):
            if key not in names:
                raise ValueError(
                    f"{cfg.path}: missing column {key!r}; the file has columns {names}; "
                    "set data.input_key / data.label_key / data.metadata_keys to existing columns"
                )
        records = parquet.read(columns=list(dict.fromkeys(keys))).to_pylist()
    return rows_from_dicts(records, cfg.input_key, cfg.label_key, cfg.path, cfg.metadata_keys)


# -------------------------------------------------------------------------------------- render


def render_prompt(row: PromptRow, cfg: FileDataConfig, tokenizer: Any = None) -> str:
    """The text the engine is given for ``row``.

    ``cfg.prompt_template`` is formatted with ``prompt`` (the row's text) and the row's metadata
    fields; then, with ``cfg.apply_chat_template``, the text becomes one user message rendered by
    the tokenizer's chat template with the generation prompt appended."""
    try:
        text = cfg.prompt_template.format_map({**row.metadata, "prompt": row.prompt})
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"data.prompt_template {cfg.prompt_template!r} cannot be formatted ({type(e).__name__}: {e}); "
            "use {prompt} for the prompt text, names from data.metadata_keys for other fields, "
            "and double literal braces ({{ }})"
        ) from None
    if not cfg.apply_chat_template:
        return text
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
        raise ValueError(
            f"data.apply_chat_template is true but the tokenizer ({name}) has no chat template; "
            "set data.apply_chat_template = false, or use a model whose tokenizer defines one"
        )
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
