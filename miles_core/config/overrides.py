"""Overrides on a raw config: the one way a config is changed by parts (flags, deployment
parameters, ``RunConfig.updated``).

- ``expand_dotted``: ``{"rollout.num_rollout": 6}`` as the nested table ``{"rollout": {"num_rollout": 6}}``.
- ``merge_overrides``: overrides on top of a raw config, table by table; a table whose ``type``
  changes is replaced whole.
"""

from __future__ import annotations

from typing import Any


def merge_overrides(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` (a raw config) with ``overrides`` on top: tables merge key by key, dotted keys
    (``{"rollout.num_rollout": 6}``) reach into tables, and a table whose ``type`` changes (another
    loss, engine or dataset kind) is replaced whole, since the old kind's settings may not fit."""
    out = dict(base)
    for key, value in expand_dotted(overrides).items():
        current = out.get(key)
        if isinstance(value, dict) and isinstance(current, dict) and value.get("type", current.get("type")) == current.get("type"):
            out[key] = merge_overrides(current, value)
        else:
            out[key] = value
    return out


def expand_dotted(raw: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1, "a": {"c": 2}}`` -> ``{"a": {"b": 1, "c": 2}}`` (a dotted key wins over the same
    field given nested)."""
    out: dict[str, Any] = {}
    for key, value in sorted(raw.items(), key=lambda kv: "." in kv[0]):  # nested first, then dotted on top
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = merge_overrides(node[leaf], value) if isinstance(node.get(leaf), dict) and isinstance(value, dict) \
            else value
    return out
