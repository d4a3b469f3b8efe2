"""The Prefect settings a run gets unless the user set them: one place for the CLI, the Python API
and the servers ``miles`` starts. ``apply()`` only fills what the environment leaves unset, and
importing ``flows`` or ``deployments`` applies them. Prefect reads its client settings when it is
first imported, and a server reads its settings from its environment when it starts (the ephemeral
server is a child of the run's process), so the server settings work even after Prefect is
imported; the client one (the ephemeral start timeout) only when applied first.

Measured with ``bench/orchestration.py`` (docs/benchmarks.md, 2026-12-03): with Prefect's own
settings its server spent 168 ms of CPU per sync step of the toy run, most of it recording
task-run events one at a time (py-spy: SQLAlchemy compiling one insert per event); with the
batches below, 65 ms. The run's whole CPU per step fell from 644 to 491 ms. Prefect's share of the
run's CPU is 18.9% with these settings (30.4% with its own), against a goal of 5% that no flow
with a task run per 0.4 s step reaches (the bench's replica rows: one task run a step is 11%).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

DEFAULTS = {
    # no telemetry, no internet
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # on a busy two-core machine the ephemeral server's start has taken longer than Prefect's 20 s,
    # and the run then failed at once
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    # the server records task-run events in batches (Prefect: one event per database write). The UI
    # shows a state at most a second late; and at the end of a run the last batch is written as the
    # ephemeral server stops (with batches of one, the last task runs of a run were left RUNNING)
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "1",
}


def apply(env: MutableMapping[str, str] = os.environ) -> None:
    for name, value in DEFAULTS.items():
        env.setdefault(name, value)


class _HideCompleted(logging.Filter):
    """Prefect logs "Finished in state Completed()" for every task run (three per sync step): in the
    console and, through the API, in the server's database. The UI shows each task run's state
    anyway; a task that fails or crashes is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith("Finished in state Completed"))


def quiet_task_logs() -> None:
    logger = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, _HideCompleted) for f in logger.filters):
        logger.addFilter(_HideCompleted())
