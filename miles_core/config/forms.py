"""How the config reads as a Prefect UI form (the JSON schema of the ``cfg`` flow parameter).

- ``form_order``: every table's fields numbered in the order they are declared.
- ``run_form``: the run's own table besides: dotted keys (``"rollout.num_rollout"``) pass the schema.
"""

from __future__ import annotations

from typing import Any


def form_order(schema: dict[str, Any], cls: type | None = None) -> None:
    """Number a table's fields in the order they are declared (``position``): Prefect's form sorts
    a table's fields by it, and a server on PostgreSQL keeps JSON objects' keys in its own order
    (shortest first), not the schema's."""
    for position, field in enumerate(schema.get("properties", {}).values()):
        field["position"] = position


def run_form(schema: dict[str, Any], cls: type | None = None) -> None:
    """``form_order``, and dotted keys allowed: a Prefect server checks parameters with this schema,
    and deployment parameters may reach into tables (``{"rollout.num_rollout": 6}``)."""
    form_order(schema)
    schema["patternProperties"] = {r"^[A-Za-z_]\w*(\.\w+)+$": {}}
