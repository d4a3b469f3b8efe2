"""Weights of the in-process engine: snapshots in, LoRA adapters in, tensors shared.

Parts:
- ``Snapshot``: a weight snapshot (file, folder, or sharded folder) at any fsspec URL, read one
  tensor at a time as it is loaded.
- ``open_matching(base, uri)`` / ``load_state(base, snapshot)``: open a snapshot and check its keys
  and shapes against the base model before anything is touched, then copy it in tensor by tensor.
- ``share_tensors(base, model)``: make the base model generate with another model's weight tensors.
- ``install_adapter(model, base, name, uri)``: load a PEFT adapter folder under a name (or replace
  the adapter of that name); returns the model that generates (a PEFT wrapper of the base).

Names: a LoRA layer keeps the weight it wraps as ``base_layer`` (PEFT) or ``base``
(``AdapterBank``); snapshots and lenders are matched by the plain names.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def share_tensors(base: torch.nn.Module, model: torch.nn.Module) -> None:
    """Point every base weight of ``base`` at ``model``'s tensor of the same name (a PEFT model or
    an adapter bank lends its base weights). All are checked first: a refused model leaves ``base``
    as it was."""
    lender = model.get_base_model() if hasattr(model, "get_base_model") else model
    theirs = _plain_params(lender)
    pairs = []
    for name, param in _plain_params(base).items():
        other = theirs.get(name)
        if other is None or other.shape != param.shape or other.dtype != param.dtype \
                or other.device != param.device:
            found = "missing" if other is None else f"{tuple(other.shape)} {other.dtype} on {other.device}"
            raise ValueError(f"cannot share weight {name} ({tuple(param.shape)} {param.dtype} on "
                             f"{param.device}) with the model: {found}")
        pairs.append((param, other))
    for param, other in pairs:
        param.data = other.data


def open_matching(base: torch.nn.Module, uri: str, storage_options: dict[str, Any] | None = None) -> Snapshot:
    """Open the snapshot and check it against the model's keys and shapes (from the files' headers).
    Tied weights (one tensor under several names, such as ``lm_head.weight`` and
    ``model.embed_tokens.weight``) may come under any of their names."""
    snapshot = Snapshot(uri, storage_options)
    try:
        own = {name: base.state_dict()[actual] for name, actual in _base_names(base).items()}
        for names in _alias_groups(own):
            present = [n for n in names if n in snapshot.names]
            if present:
                for n in names:
                    snapshot.names.setdefault(n, snapshot.names[present[0]])
        missing, unexpected = sorted(own.keys() - snapshot.names.keys()), sorted(snapshot.names.keys() - own.keys())
        if missing or unexpected:
            raise ValueError(
                f"weights at {uri} do not fit the model: "
                f"missing keys {_few(missing)}, unexpected keys {_few(unexpected)}"
            )
        bad = [f"{k}: {snapshot.shape(k)} vs model {tuple(t.shape)}" for k, t in own.items()
               if snapshot.shape(k) != tuple(t.shape)]
        if bad:
            raise ValueError(f"weights at {uri} have wrong shapes: {_few(bad)}")
    except BaseException:
        snapshot.close()
        raise
    return snapshot


@torch.no_grad()
def load_state(base: torch.nn.Module, snapshot: Snapshot) -> None:
    """Copy the snapshot's weights into the base model, one tensor at a time (cast to the model's
    dtype), then close it; loaded adapters stay as they are."""
    try:
        own = base.state_dict()
        for name, actual in _base_names(base).items():
            snapshot.load_into(name, own[actual])
    finally:
        snapshot.close()


def _base_names(base: torch.nn.Module) -> dict[str, str]:
    """Snapshot name -> the base model's own name of each weight. A LoRA layer renames the
    weight it wraps to ``<module>.base_layer.weight`` and adds adapter weights, which base
    snapshots do not carry."""
    return {_plain_name(k): k for k in base.state_dict() if ".lora_" not in k}


def install_adapter(model: Any, base: torch.nn.Module, name: str, uri: str,
                    storage_options: dict[str, Any] | None = None) -> Any:
    """Read the adapter folder at ``uri`` and load it as ``name`` into ``model`` (the base, or a PEFT
    wrapper of it); returns the model that generates from now on."""
    from peft import PeftModel

    with _local_folder(uri, storage_options) as folder:
        if not isinstance(model, PeftModel):
            return PeftModel.from_pretrained(base, folder, adapter_name=name).eval()
        if name in model.peft_config:  # a new version of a loaded adapter
            delete_adapter(model, name)
        model.load_adapter(folder, adapter_name=name)
        return model.eval()


def delete_adapter(model: Any, name: str) -> None:
    """Take adapter ``name`` out of a PEFT model (its memory with it)."""
    with warnings.catch_warnings():  # PEFT warns when the deleted adapter was "active": batches name theirs per row
        warnings.simplefilter("ignore")
        model.delete_adapter(name)


@contextmanager
def _local_folder(uri: str, storage_options: dict[str, Any] | None = None) -> Iterator[str]:
    """A local folder with the files at ``uri``: the folder itself, or a temporary copy of a remote
    one (removed afterwards)."""
    from miles_core.storage.fs import copy_to_disk, is_local, open_fs

    fs, path = open_fs(uri, storage_options)
    if not fs.isdir(path):
        raise FileNotFoundError(f"adapter folder not found: {uri}")
    if is_local(fs):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="miles-adapter-") as tmp:
        yield copy_to_disk(uri, tmp, storage_options)


class Snapshot:
    """A weight snapshot opened for loading (a ``.safetensors`` file, or a folder holding
    ``model.safetensors`` or the shards listed by ``model.safetensors.index.json``, at any fsspec
    URL): ``names`` maps each tensor's name to the one it is stored under (tied names added by the
    engine), ``shape`` reads a header, ``load_into`` reads one tensor into a parameter. Loading
    holds no second copy of the weights: a tensor of the parameter's dtype is read straight into it,
    another one (a bf16 snapshot of a float32 model) through one temporary tensor. A remote
    snapshot is copied to a local temporary folder first (removed by ``close``)."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None) -> None:
        from miles_core.storage.fs import is_local, open_fs
        from miles_core.storage.weights import SafetensorsFile

        fs, path = open_fs(uri, storage_options)
        if fs.isdir(path):
            files = _snapshot_files(fs, path.rstrip("/"), uri)
        elif fs.exists(path):
            files = [path]
        else:
            raise FileNotFoundError(f"no weights at {uri}")
        self._tmp = None
        if not is_local(fs):
            self._tmp = tempfile.TemporaryDirectory(prefix="miles-weights-")
            local = [os.path.join(self._tmp.name, f"{i}.safetensors") for i in range(len(files))]
            for remote, here in zip(files, local):
                fs.get_file(remote, here)
            files = local
        self._files: dict[str, SafetensorsFile] = {}
        self.names: dict[str, str] = {}
        for f in files:
            try:
                opened = SafetensorsFile(f)
            except (ValueError, OSError) as e:
                self.close()
                raise ValueError(f"{uri}: {f} is not a readable safetensors file: {e}") from e
            for name in opened.entries:
                self._files[name] = opened
                self.names[name] = name

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files[self.names[name]].shape(self.names[name])

    def load_into(self, name: str, param: torch.Tensor) -> None:
        stored = self.names[name]
        file = self._files[stored]
        if file.dtype(stored) == param.dtype and param.is_contiguous():
            file.read_into(stored, param)
        else:
            param.copy_(file.tensor(stored))

    def close(self) -> None:
        self._files = {}
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _snapshot_files(fs: Any, folder: str, uri: str) -> list[str]:
    single = f"{folder}/model.safetensors"
    if fs.exists(single):
        return [single]
    index = f"{single}.index.json"
    if fs.exists(index):
        weight_map = json.loads(fs.cat_file(index))["weight_map"]
        return [f"{folder}/{name}" for name in sorted(set(weight_map.values()))]
    raise FileNotFoundError(f"{uri} is a folder without model.safetensors or model.safetensors.index.json")


_WRAPPED_RE = re.compile(r"\.(?:base_layer|base)\.(weight|bias)$")


def _plain_name(name: str) -> str:
    """A weight's name in the plain model: a LoRA layer keeps the layer it wraps as ``base_layer``
    (PEFT) or ``base`` (``AdapterBank``)."""
    return _WRAPPED_RE.sub(r".\1", name)


def _plain_params(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``module``'s base weights by their plain names (LoRA weights left out; tied ones under each name)."""
    return {_plain_name(k): v for k, v in module.named_parameters(remove_duplicate=False) if ".lora_" not in k}


def _alias_groups(state: dict[str, torch.Tensor]) -> list[list[str]]:
    """Names that share one tensor (tied weights)."""
    by_ptr: dict[tuple[int, tuple[int, ...]], list[str]] = defaultdict(list)
    for name, t in state.items():
        if t.numel():
            by_ptr[(t.data_ptr(), tuple(t.shape))].append(name)
    return [names for names in by_ptr.values() if len(names) > 1]


def _few(items: list[str], n: int = 5) -> str:
    shown = ", ".join(items[:n]) or "none"
    return shown + (f" (+{len(items) - n} more)" if len(items) > n else "")

