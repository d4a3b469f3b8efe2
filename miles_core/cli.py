"""Command-line flags of the ``miles`` command (the command itself is ``deployments/cli.py``).

``miles train --config configs/toy.toml --rollout-batch-size 16 ...`` builds a ``RunConfig`` from a
TOML file (or the defaults), applies Miles-named flags on top, and runs the train flow.
``miles show-config`` prints the resolved config; ``miles build-model`` builds or finds the
built-in tiny model; ``miles config-doc`` prints the config reference and ``miles flags-doc``
every Miles flag with what it does here (markdown). Every Miles flag is taken or refused with a hint
(``miles_flags``), and no flag is read as an abbreviation of another.

Flags map to config fields through ``miles_flags.FLAGS`` (flag -> dotted path); their help text is the field's
docstring. ``--set a.b=value`` reaches any field without a flag. This module imports only the config
(no torch, no prefect) until a command runs, so ``miles --help`` answers at once.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from miles_core.config import (
    EVAL_INHERITS,
    MODE_TABLES,
    RunConfig,
    merge_overrides,
    mode_table,
    upgrade_mode,
)
from miles_core.miles_flags import FLAGS, KL_ALIASES, SWITCHES


def _field(path: str):
    """The pydantic FieldInfo at a dotted path; through a union, the member that has the next part."""
    models: list[type[BaseModel]] = [RunConfig]
    info = None
    for part in path.split("."):
        model = next(m for m in models if part in m.model_fields)
        info = model.model_fields[part]
        models = [m for m in union_members(info.annotation) if isinstance(m, type) and issubclass(m, BaseModel)]
    return info


def union_members(tp) -> list:
    """The members of a (possibly Annotated, possibly nested) union; ``[tp]`` for a plain type."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return union_members(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(tp) for m in union_members(a)]
    return [tp]


def _unwrap(tp):
    """Strip Optional / Annotated / single-member unions down to the base type."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else tp
    return tp


def _add_flag(parser: argparse.ArgumentParser, flag: str, path: str) -> None:
    info = _field(path)
    tp = _unwrap(info.annotation)
    help_text = (info.description or "").replace("%", "%%") + f" [{path}]"
    optional = type(None) in typing.get_args(info.annotation)
    if tp is bool:
        parser.add_argument(flag, dest=path, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
    elif typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        parser.add_argument(flag, dest=path, nargs="*", type=item, default=argparse.SUPPRESS, help=help_text)
    else:
        conv = tp if tp in (int, float, str) else str
        if optional and conv is not str:
            conv = _optional(conv)
        choices = None
        if path.endswith(".type"):  # a tagged union's member, by its tag: every member's
            members = union_members(_field(path.rsplit(".", 1)[0]).annotation)
            choices = [m.model_fields["type"].default for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
        parser.add_argument(flag, dest=path, type=conv, default=argparse.SUPPRESS, help=help_text, choices=choices,
                            metavar=path.split(".")[-1].upper() if choices is None else None)


def _optional(conv):
    def parse(text: str):
        return None if text.lower() in ("none", "null") else conv(text)

    parse.__name__ = conv.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    # no abbreviations: Miles' --save must never be taken as --save-interval
    parser = _Parser(prog="miles", description="RL post-training of language models on Prefect.", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    helps = {
        "train": "run a training flow",
        "train-multi-lora": "train several LoRA adapters over one rollout stream (--lora-count N or [multi_lora])",
        "serve": "register the training and evaluation deployments and run them here (the config: their defaults)",
        "show-config": "print the resolved run config as JSON (nothing runs)",
        "build-model": "build (or find in the cache) the starting model and print its folder",
        "config-doc": "print the config reference as markdown",
        "flags-doc": "print every Miles flag and what it does here, as markdown",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text, description=text, allow_abbrev=False)
        if name in ("config-doc", "flags-doc"):
            continue
        if name == "build-model":
            p.add_argument("--no-shipped", action="store_true",
                           help="build the tiny model from its recipe (~2 min) instead of copying the build that ships "
                                "with the package")
        p.add_argument("--config", help="TOML run config to start from (default: built-in defaults)")
        p.add_argument("--verbose", action="store_true",
                       help="show the libraries' progress bars, deprecation warnings and banners (hidden by default)")
        p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                       help="set any config field by dotted path, e.g. --set train.lr=3e-4 (value parsed as JSON when it can be)")
        for flag, path in FLAGS.items():
            if flag in ("--custom-rm-path", "--eval-prompt-data"):
                continue
            _add_flag(p, flag, path)
        p.add_argument("--custom-rm-path", dest="rollout.reward", default=argparse.SUPPRESS, help="custom reward as module:function [rollout.reward]")
        # Miles' form: NAME PATH pairs; one PATH alone is the single held-out dataset (kept from before)
        p.add_argument("--eval-prompt-data", dest="eval_prompt_data", nargs="+", default=argparse.SUPPRESS,
                       metavar="[NAME] PATH", help="held-out prompts: one PATH [eval.data.path], or pairs of dataset "
                       "name and path NAME PATH [NAME PATH ...] [eval.datasets]; files are read with the training data's keys")
        for flag, (path, value) in SWITCHES.items():
            p.add_argument(flag, dest=f"switch:{path}", action="store_const", const=value, default=argparse.SUPPRESS, help=f"set {path}={value!r}")
        _add_miles_flags(p)
    return parser


def _add_miles_flags(p: argparse.ArgumentParser) -> None:
    """Miles' flags that ``FLAGS`` and ``SWITCHES`` do not cover: the few taken here with a meaning of
    their own (``miles_flags.NOTES``), and every other one refused with what to use instead."""
    from miles_core.miles_flags import NOTES, miles_flags, unsupported

    p.add_argument("--load", dest="miles:load", metavar="RUN_FOLDER", default=argparse.SUPPRESS,
                   help=f"resume this run: {NOTES['--load']}")
    p.add_argument("--use-kl-loss", dest="miles:use_kl_loss", action="store_true", default=argparse.SUPPRESS,
                   help=NOTES["--use-kl-loss"])
    p.add_argument("--num-epoch", dest="miles:num_epoch", type=int, metavar="EPOCHS", default=argparse.SUPPRESS,
                   help=NOTES["--num-epoch"])
    for flag, key in (("--eval-input-key", "input_key"), ("--eval-label-key", "label_key")):
        p.add_argument(flag, dest=f"miles:eval_{key}", metavar=key.upper(), default=argparse.SUPPRESS,
                       help=NOTES[flag])
    for flag in miles_flags():
        hint = unsupported(flag)
        if hint is not None and flag not in p._option_string_actions:
            p.add_argument(flag, action=_Refuse, hint=hint)


class _Parser(argparse.ArgumentParser):
    """Unknown flags that are Miles' (``--sglang-<any SGLang flag>`` and the like) get their hint."""

    def parse_args(self, args=None, namespace=None):  # noqa: ANN001 (argparse's signature)
        from miles_core.miles_flags import hint_for

        parsed, extra = self.parse_known_args(args, namespace)
        for arg in extra:
            flag = arg.split("=", 1)[0]
            hint = hint_for(flag) if flag.startswith("--") else None
            if hint is not None:
                self.error(f"{flag} is a Miles flag not supported here; {hint}")
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


class _Refuse(argparse.Action):
    """A Miles flag not supported here: using it stops the command with what to use instead."""

    def __init__(self, option_strings: list[str], dest: str, hint: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="*", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.hint = hint

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is a Miles flag not supported here; {self.hint}")


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """Defaults <- TOML file <- flags <- --set, validated once at the end. Each layer is a flat dict
    of dotted paths put on top with ``merge_overrides``, as a deployment's parameters are."""
    given = vars(args)
    data: dict[str, Any] = RunConfig.read_toml(args.config) if args.config else {}  # as written: nothing derived yet
    flags = _flag_overrides(given)
    try:  # the run's mode first: an older [async_rollout] table moves into the mode the run has
        data = upgrade_mode(merge_overrides(data, _switch_mode(data, given, flags)))
    except ValueError as e:
        raise ValueError(f"{args.config}: {e}") from None
    tables = _kind_tables(data, flags)  # takes the flags that pick a kind out of flags
    data = merge_overrides(data, tables | flags)
    if "eval_prompt_data" in given:  # after the training data's flags, whatever their order
        data = merge_overrides(data, _eval_prompt_data(data, given["eval_prompt_data"]))
    data = merge_overrides(data, _miles_overrides(data, {k.removeprefix("miles:"): v for k, v in given.items()
                                                         if k.startswith("miles:")}))
    data = merge_overrides(data, _set_overrides(args.set))
    _check_file_flags(data)
    _check_backend_flags(data)
    _check_mode_flags(data, flags)
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as e:
        raise ValueError(f"{_blame(e, args)}: invalid run config:\n{e}") from None
    if "miles:num_epoch" in given:
        if "rollout.num_rollout" in flags:
            raise SystemExit("--num-epoch and --num-rollout both set the run's length: give one of them")
        cfg = cfg.updated({"rollout.num_rollout": _epochs_to_rollouts(cfg, given["miles:num_epoch"])})
    return cfg


def _flag_overrides(given: dict[str, Any]) -> dict[str, Any]:
    """The fields the flags set, by dotted path (``FLAGS``), then the switches' (``SWITCHES``); the
    mode's kind is ``_switch_mode``'s."""
    flags = {k: v for k, v in given.items() if k in FLAGS.values()}
    flags |= {k.removeprefix("switch:"): v for k, v in given.items() if k.startswith("switch:")}
    flags.pop("mode.type", None)
    if "train.kl_type" in flags:
        flags["train.kl_type"] = KL_ALIASES.get(flags["train.kl_type"], flags["train.kl_type"])
    return flags


def _set_overrides(items: list[str]) -> dict[str, Any]:
    """``--set PATH=VALUE``, each value parsed as JSON when it can be."""
    overrides: dict[str, Any] = {}
    for item in items:
        path, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects PATH=VALUE, got {item!r}")
        try:
            overrides[path.strip()] = json.loads(text)
        except json.JSONDecodeError:
            overrides[path.strip()] = text
    return overrides


def _blame(error: ValidationError, args: argparse.Namespace) -> str:
    """Where the fields a validation error is about were set: the flags that set them (with their
    values), else the config file (or the defaults)."""
    flags_of: dict[str, list[str]] = {}
    for flag, path in FLAGS.items():  # several flags may set one field (Miles' names and ours)
        flags_of.setdefault(path, []).append(flag)
    given: dict[str, str] = {}
    for key, value in vars(args).items():
        path = key.removeprefix("switch:")
        if path in flags_of and key != "set":
            flag = "/".join(flags_of[path])
            given[path] = flag if key.startswith("switch:") else f"{flag} {_shown(value)}"
    for item in args.set:
        given[item.partition("=")[0].strip()] = f"--set {item}"
    blamed = []
    for e in error.errors():
        loc = [str(part) for part in e["loc"]]
        hits = [shown for path, shown in given.items() if _names(path, loc) or path in e["msg"]]
        blamed += hits or [args.config or "the defaults"]
    return ", ".join(dict.fromkeys(blamed))


def _names(path: str, loc: list[str]) -> bool:
    """Whether a validation error at ``loc`` is about the field ``path`` (a tagged union puts its
    tag in ``loc``: ``mode.fully_async.no_progress_s`` is ``mode.no_progress_s``)."""
    parts = path.split(".")
    if not loc or loc[0] != parts[0]:
        return False
    rest = iter(loc[1:])
    return all(part in rest for part in parts[1:])


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def _eval_prompt_data(data: dict[str, Any], values: list[str]) -> dict[str, Any]:
    """``--eval-prompt-data PATH``: the path of ``eval.data`` (a file dataset read like the training
    data, unless the config file's ``eval.data`` says how); ``NAME PATH [NAME PATH ...]``: these
    named file datasets, read like the training data, replace the file's ``eval.data`` and ``eval.datasets``."""
    inherited = {k: v for k, v in (data.get("data") or {}).items() if k in EVAL_INHERITS}
    if len(values) == 1:
        if ((data.get("eval") or {}).get("data") or {}).get("type") == "file":
            return {"eval.data.path": values[0]}
        return {"eval.data": {**inherited, "type": "file", "path": values[0]}}
    if len(values) % 2:
        raise SystemExit(f"--eval-prompt-data takes one PATH or NAME PATH pairs; got {len(values)} values: "
                         f"{' '.join(values)}")
    pairs = zip(values[::2], values[1::2])
    return {"eval.data": None,
            "eval.datasets": [{"name": name, "data": {**inherited, "type": "file", "path": path}} for name, path in pairs]}


def _miles_overrides(data: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The Miles flags with a meaning of their own here (``miles_flags.NOTES``)."""
    overrides = _run_folder(given["load"]) if "load" in given else {}
    if given.get("use_kl_loss") and not (data.get("train") or {}).get("kl_loss_coef"):
        raise SystemExit("--use-kl-loss needs --kl-loss-coef > 0: here the KL term is in the loss exactly when its "
                         "coefficient is above 0 (Miles only logs the KL with a coefficient of 0)")
    keys = {key: given[f"eval_{key}"] for key in ("input_key", "label_key") if f"eval_{key}" in given}
    if keys:
        overrides |= _eval_keys(data, keys)
    return overrides


def _epochs_to_rollouts(cfg: RunConfig, epochs: int) -> int:
    """``--num-epoch N``: ``rollout.num_rollout`` = N x the training prompts // ``rollout_batch_size``
    (Miles' rule; the prompt source crosses epochs by itself, each in its own shuffled order)."""
    import sys

    if epochs < 1:
        raise SystemExit(f"--num-epoch {epochs}: give 1 or more")
    if cfg.data.type == "toy":
        prompts = cfg.data.num_prompts
    else:
        from miles_core.data.datasets import load_prompt_rows

        prompts = len(load_prompt_rows(cfg.data))
    batch = cfg.rollout.rollout_batch_size
    steps = epochs * prompts // batch
    if steps < 1:
        raise SystemExit(f"--num-epoch {epochs}: {epochs} x {prompts} prompts is less than one rollout batch of "
                         f"{batch} (--rollout-batch-size)")
    print(f"--num-epoch {epochs}: {prompts} prompts x {epochs} // {batch} per rollout = {steps} rollouts "
          "(rollout.num_rollout)", file=sys.stderr)
    return steps


def _run_folder(folder: str) -> dict[str, Any]:
    """``--load <root>/<name>/<run id>``: run there (resuming from its latest checkpoint)."""
    import os
    import posixpath

    path = folder.rstrip("/")
    local = "://" not in path
    if local and not os.path.isdir(path):
        raise SystemExit(f"--load {folder}: no such run folder (a run's folder is <storage root>/<name>/<run id>; "
                         "the run's first lines print it)")
    root, name, run_id = posixpath.dirname(posixpath.dirname(path)), posixpath.basename(posixpath.dirname(path)), \
        posixpath.basename(path)
    if not (root and name and run_id):
        raise SystemExit(f"--load {folder}: expected a run folder, <storage root>/<name>/<run id>")
    if local and not os.path.isdir(os.path.join(path, "checkpoints")):
        raise SystemExit(f"--load {folder}: that run has no checkpoints to resume from (runs save them with "
                         "--save-interval N)")
    return {"name": name, "run_id": run_id, "storage.root": root}


def _eval_keys(data: dict[str, Any], keys: dict[str, str]) -> dict[str, Any]:
    """``--eval-input-key`` / ``--eval-label-key``: these keys in every held-out file dataset."""
    ev = data.get("eval") or {}
    datasets = ev.get("datasets") or []
    if not _is_file(ev.get("data")) and not any(_is_file(d.get("data")) for d in datasets):
        raise SystemExit(f"--eval-{next(iter(keys)).replace('_', '-')} sets a key of held-out files: add "
                         "--eval-prompt-data [NAME] PATH ...")
    overrides = {f"eval.data.{key}": value for key, value in keys.items()} if _is_file(ev.get("data")) else {}
    if datasets:
        overrides["eval.datasets"] = [{**d, "data": {**d["data"], **keys}} if _is_file(d.get("data")) else d
                                      for d in datasets]
    return overrides


def _is_file(table: Any) -> bool:
    return isinstance(table, dict) and table.get("type") == "file"


def _check_file_flags(data: dict[str, Any]) -> None:
    d = data.get("data") or {}
    if d.get("type", "toy") != "file" and any(k in d for k in ("input_key", "label_key", "apply_chat_template")):
        raise SystemExit("--input-key / --label-key / --apply-chat-template need a file dataset: add --prompt-data PATH")


# backend fields that only the DeepSpeed trainer has, and their flags
_DEEPSPEED_FLAGS = {path.rsplit(".", 1)[1]: flag for flag, path in FLAGS.items()
                    if path.startswith("train.backend.") and path != "train.backend.type"}


def _kind_tables(data: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """The tables that flags picking a kind start from (taken out of ``flags``), so that the flags of
    that kind's settings land in them whatever their order. ``--train-backend`` over a file naming
    another backend starts afresh but for ``device`` (the old backend's own settings would not fit);
    ``--advantage-estimator`` sets the loss's ``type`` and keeps the file's loss settings;
    ``--prompt-data`` over data that is not a file dataset makes one."""
    train = data.get("train") or {}
    tables: dict[str, Any] = {}
    if "train.backend.type" in flags:
        kind, backend = flags.pop("train.backend.type"), train.get("backend") or {}
        if backend.get("type", "torch") != kind:
            backend = {k: v for k, v in backend.items() if k == "device"}
        tables["train.backend"] = {**backend, "type": kind}
    if "train.loss.type" in flags:
        tables["train.loss"] = {**(train.get("loss") or {}), "type": flags.pop("train.loss.type")}
    if "data.path" in flags and not _is_file(data.get("data")):
        tables["data"] = {"type": "file", "path": flags.pop("data.path")}
    return tables


def _check_backend_flags(data: dict[str, Any]) -> None:
    backend = (data.get("train") or {}).get("backend") or {}
    if backend.get("type", "torch") == "deepspeed":
        return
    used = [_DEEPSPEED_FLAGS[k] for k in backend if k in _DEEPSPEED_FLAGS]
    if used:
        raise SystemExit(
            f"{' / '.join(used)} configure the DeepSpeed trainer, but train.backend.type is "
            f"{backend.get('type', 'torch')!r}: add --train-backend deepspeed"
        )


def _switch_mode(data: dict[str, Any], given: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """``--mode`` / ``--fully-async``: over a config of another mode, that mode's table starts afresh
    (the other mode's settings do not apply to it); over the same mode, the file's settings stay."""
    wanted = {given[k] for k in ("mode.type", "switch:mode.type") if k in given}
    if len(wanted) > 1:
        raise SystemExit(f"--mode {given['mode.type']} and --fully-async disagree: give one of them")
    if not wanted:
        return {}
    kind = wanted.pop()
    multi = data.get("multi_lora") is not None or any(k.startswith("multi_lora.") for k in flags)
    if multi and kind != "fully_async":
        raise SystemExit(f"--mode {kind}: a multi-LoRA run is always fully async (leave --mode out)")
    return {} if (mode_table(data.get("mode")) or {}).get("type", "sync") == kind else {"mode": {"type": kind}}


def _check_mode_flags(data: dict[str, Any], overrides: dict[str, Any]) -> None:
    """A flag of another mode's settings (``--update-weights-interval`` in fully-async mode, ...) is
    an error naming the flag and the mode it belongs to, not pydantic's "extra input"."""
    kind = (mode_table(data.get("mode")) or {}).get("type", "sync")
    own = MODE_TABLES[kind].model_fields if kind in MODE_TABLES else {}
    flag_of = {path: flag for flag, path in FLAGS.items()}
    for key in overrides:
        field = key.removeprefix("mode.")
        if key.startswith("mode.") and field not in own:
            owner = next((k for k, m in MODE_TABLES.items() if field in m.model_fields), "?")
            switch = "--fully-async" if owner == "fully_async" else f"--mode {owner}"
            raise SystemExit(f"{flag_of.get(key, key)} is a setting of {owner} mode, but this run's mode is "
                             f"{kind!r}: add {switch}")

