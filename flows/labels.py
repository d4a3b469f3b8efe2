"""The flow run's label naming its run folder: ``miles.run_id``. A run started without a run id (from
the UI's form, say) gets one when it starts; the label lets ``deployments.api.get_run`` find its
folder from the flow run alone."""

from __future__ import annotations

RUN_ID_LABEL = "miles.run_id"


def label_run_id(run_id: str) -> None:
    """Label the current flow run with ``run_id`` (nothing outside a flow run)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if flow_run.id is None:
        return
    with get_client(sync_client=True) as client:
        client.update_flow_run_labels(flow_run.id, {RUN_ID_LABEL: run_id})
