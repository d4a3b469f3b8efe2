"""Storage credentials from a Prefect block, resolved when a run starts.

``with_block_credentials(cfg)`` returns a copy of ``cfg`` whose ``storage.storage_options`` include
the JSON object held by the ``Secret`` block named in ``storage.credentials_block``. The flow's own
parameter (what the Prefect API stores) keeps only the block's name; the copy lives in the flow
process and is handed to tasks, and ``RunConfig.public_dict`` never writes storage options out.
"""

from __future__ import annotations

from miles_core.config import RunConfig


def with_block_credentials(cfg: RunConfig) -> RunConfig:
    name = cfg.storage.credentials_block
    if not name:
        return cfg
    from prefect.blocks.system import Secret

    try:
        value = Secret.load(name).get()
    except ValueError as e:
        raise ValueError(
            f"storage.credentials_block={name!r}: no such Secret block ({e}); create it with "
            f"Secret(value={{...}}).save({name!r}) or in the Prefect UI"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(
            f"storage.credentials_block={name!r}: the Secret must hold a JSON object of storage "
            f"options (e.g. {{\"key\": ..., \"secret\": ...}}), not a {type(value).__name__}"
        )
    storage = cfg.storage.model_copy(update={"storage_options": {**cfg.storage.storage_options, **value}})
    return cfg.model_copy(update={"storage": storage})
