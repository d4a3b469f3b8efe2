"""The config reference, generated from ``RunConfig``'s fields and their docstrings."""

from __future__ import annotations

import re
import typing

from pydantic import BaseModel

from miles_core.cli import union_members
from miles_core.config import RunConfig


def _type_name(tp) -> str:
    text = repr(tp) if not isinstance(tp, type) else tp.__name__
    text = re.sub(r"Annotated\[(\w+), [^\]]*\]", r"\1", text)  # a bounded list item reads as its type
    return re.sub(r"miles_core\.config\.\w+\.", "", text.replace("typing.", ""))


def _list_item_model(tp) -> type[BaseModel] | None:
    """``X`` of a ``list[X]`` field whose items are config sections."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0]
    return None


def _flags_by_path() -> dict[str, list[str]]:
    from miles_core.miles_flags import FLAGS, SWITCHES

    out: dict[str, list[str]] = {}
    for flag, path in FLAGS.items():
        out.setdefault(path, []).append(f"`{flag}`")
    for flag, (path, value) in SWITCHES.items():
        out.setdefault(path, []).append(f"`{flag}` (= {value!r})")
    return out


def _section(model: type[BaseModel], prefix: str, flags: dict[str, list[str]], lines: list[str]) -> list[tuple]:
    nested = []
    title = prefix.rstrip(".") or "run"
    lines += ["", f"### `{title}` ({model.__name__})", "", " ".join((model.__doc__ or "").strip().split("\n\n")[0].split()), "",
              "| field | type | default | flag | description |", "|---|---|---|---|---|"]
    for name, info in model.model_fields.items():
        path = prefix + name
        members = [a for a in union_members(info.annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if members:
            nested += [(m, path + (f"[type={m.model_fields['type'].default}]" if len(members) > 1 or 'type' in m.model_fields else "") + ".") for m in members]
            default = "(section)"
        else:
            default = "required" if info.is_required() else f"`{info.get_default(call_default_factory=True)!r}`"
            item = _list_item_model(info.annotation)
            if item is not None:  # [[eval.datasets]]-style tables: their fields get a section too
                nested.append((item, path + "[]."))
        desc = " ".join((info.description or "").split()).replace("|", "\\|")
        flag_path = re.sub(r"\[type=[^]]*\]", "", path)  # flags name union fields without the tag
        lines.append(f"| `{path}` | `{_type_name(info.annotation)}` | {default} | {', '.join(flags.get(flag_path, []))} | {desc} |")
    return nested


def config_markdown() -> str:
    """Markdown tables of every field, by section, with its flag and docstring."""
    flags = _flags_by_path()
    lines = ["## Config reference", "", "Generated from `RunConfig` by `miles config-doc`. A TOML file uses the same",
             "sections (`[rollout]`, `[train]`, ...); tagged unions pick their member with `type = \"...\"`."]
    queue = [(RunConfig, "")]
    seen = set()
    while queue:
        model, prefix = queue.pop(0)
        if (model, prefix) in seen:
            continue
        seen.add((model, prefix))
        queue += _section(model, prefix, flags, lines)
    return "\n".join(lines) + "\n"
