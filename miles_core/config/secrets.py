"""Secrets in a config: which storage options are secret, and how they are kept out of its JSON.

- ``SECRET_OPTION``: the option names taken for secrets; ``without_secrets`` drops them at any depth.
- ``StorageOptions``: the field type of fsspec options; their JSON form (Prefect parameters,
  deployment defaults, artifacts) leaves the secrets out unless ``WITH_SECRETS`` is the context.
- ``dataset_tables`` and ``REDACTED``: where in a raw config dataset storage options live, and what
  ``RunConfig.public_dict`` shows instead of them.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import PlainSerializer, SerializationInfo

SECRET_OPTION = re.compile(r"key|secret|token|passw|credential|auth|signature|session", re.IGNORECASE)
"""Storage option names whose values are secrets (s3fs ``key``, ``secret``, ``token``;
``aws_secret_access_key``, ``password``, ...): left out wherever a config is serialised as JSON."""
WITH_SECRETS = {"with_secrets": True}
"""``cfg.model_dump_json(context=WITH_SECRETS)``: the whole config, secrets too (for a child
process's stdin, never for storage, Prefect parameters or logs)."""
REDACTED = "<redacted>"
"""What ``RunConfig.public_dict`` shows in place of a dataset's storage options."""


def without_secrets(options: Any) -> Any:
    """``options`` without the entries whose names look secret (at any depth)."""
    if isinstance(options, dict):
        return {k: without_secrets(v) for k, v in options.items() if not SECRET_OPTION.search(str(k))}
    if isinstance(options, list):
        return [without_secrets(v) for v in options]
    return options


def _serialise_options(options: dict[str, Any], info: SerializationInfo) -> dict[str, Any]:
    if info.mode_is_json() and not (info.context or {}).get("with_secrets"):
        return without_secrets(options)
    return options


StorageOptions = Annotated[dict[str, Any], PlainSerializer(_serialise_options, when_used="always")]
"""fsspec storage options: as JSON (Prefect flow-run parameters, deployment defaults, artifacts)
their secret entries are left out; the run resolves them where it starts (the environment, or
``storage.credentials_block``). In Python they are whole."""


def dataset_tables(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The dataset tables of a raw config (training data, ``eval.data``, each ``eval.datasets``
    entry's data): where storage options, which may hold secrets, live."""
    ev = raw.get("eval") or {}
    tables = [raw.get("data"), ev.get("data"), *((d or {}).get("data") for d in ev.get("datasets") or [])]
    return [t for t in tables if isinstance(t, dict)]
