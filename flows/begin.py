"""What every training flow does first: ``begin_run(cfg)`` resolves the storage credentials, checks
the device pool, prepares the run folder (``prepare-run``) and labels the flow run with its run id
(``miles.run_id``). A run started without a run id (from the UI's form, say) gets one here; the
label lets ``deployments.api.get_run`` find its folder from the flow run alone."""

from __future__ import annotations

from flows.credentials import with_block_credentials
from miles_core.config import RunConfig
from miles_core.run import RunRefs
from tasks.slots import check_device_pool
from tasks.train import prepare_run

RUN_ID_LABEL = "miles.run_id"


def begin_run(cfg: RunConfig) -> tuple[RunConfig, RunRefs]:
    """The run's config (with its credentials) and references; fails before any work when the
    device pool cannot hold the run."""
    cfg = with_block_credentials(cfg)
    check_device_pool(cfg)
    refs = prepare_run(cfg)
    _label_run_id(refs.run_id)
    return cfg, refs


def _label_run_id(run_id: str) -> None:
    """Label the current flow run with ``run_id`` (nothing outside a flow run)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if flow_run.id is None:
        return
    with get_client(sync_client=True) as client:
        client.update_flow_run_labels(flow_run.id, {RUN_ID_LABEL: run_id})
