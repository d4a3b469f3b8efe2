"""Config files of older shapes, read in today's shape.

- ``mode_table``: ``mode = "async"`` (a mode by name) as the table ``{"type": "async"}``.
- ``upgrade_mode``: an ``[async_rollout]`` table (every mode's settings in one table, before the
  modes held their own) moved into the run's ``[mode]``; a multi-LoRA config made fully async.

Settings that moved elsewhere are refused where they used to be, naming the new place
(``TrainConfig``'s loss settings, which moved into ``[train.loss]``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from miles_core.config.schema import MODE_TABLES


def mode_table(raw: Any) -> Any:
    """``mode = "sync"`` (the short spelling: that mode with its defaults) as a table; anything else as given."""
    return {"type": raw} if isinstance(raw, str) else raw


def upgrade_mode(raw: dict[str, Any], *, strict: bool = True) -> dict[str, Any]:
    """A raw config in today's shape: ``mode`` a table, and an ``[async_rollout]`` table (the older
    spelling, every mode's settings in one table) moved into it. A multi-LoRA config is fully async.
    A setting of ``[async_rollout]`` that the run's mode does not have is an error (``strict``; it
    had no effect) unless it is at its default, or ``strict`` is off (a stored run's config, where
    it did nothing in that run)."""
    if not isinstance(raw, dict):
        return raw
    out = dict(raw)
    if "mode" in out:
        out["mode"] = mode_table(out["mode"])
    legacy = out.pop("async_rollout", None)
    mode = out.get("mode", {"type": "sync"})
    if isinstance(mode, BaseModel) and legacy is None:
        return out  # a table already (a config built in Python: RunConfig(mode=AsyncMode()))
    if isinstance(mode, BaseModel):
        mode = mode.model_dump()
    if not isinstance(mode, dict):
        return out  # pydantic says what is wrong with it
    mode = dict(mode)
    if out.get("multi_lora") is not None and mode.get("type") != "fully_async":
        others = sorted(set(mode) - {"type"})
        if others:
            raise ValueError(f"a multi-LoRA run is fully async: mode.{others[0]} (of mode {mode.get('type')!r}) does "
                             "not apply; set mode = 'fully_async' or leave mode out")
        mode["type"] = "fully_async"
    if isinstance(legacy, dict):
        kind = mode.get("type", "sync")
        for key, value in legacy.items():
            owner = next((k for k, m in MODE_TABLES.items() if key in m.model_fields and key != "type"), None)
            if owner is None:
                raise ValueError(f"async_rollout.{key}: no such setting in any mode (async has "
                                 f"{', '.join(_settings('async'))}; fully_async: {', '.join(_settings('fully_async'))})")
            if owner == kind:
                mode.setdefault(key, value)
            elif strict and value != MODE_TABLES[owner].model_fields[key].get_default(call_default_factory=True):
                raise ValueError(
                    f"async_rollout.{key} = {value!r} is a setting of mode {owner!r}, but this run's mode is {kind!r}, "
                    f"where it does nothing: remove it, or set mode = {owner!r} ([async_rollout] is the older "
                    f"spelling of the [mode] table: [mode] type = {owner!r}, {key} = ...)")
    elif legacy is not None:
        raise ValueError(f"async_rollout: expected a table, got {legacy!r}")
    out["mode"] = mode
    return out


def _settings(kind: str) -> list[str]:
    return [k for k in MODE_TABLES[kind].model_fields if k != "type"]

