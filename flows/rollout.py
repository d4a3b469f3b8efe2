"""The rollout flow: ``rollout(cfg, refs, producer_id)`` runs one producer of a fully-async run's
fleet until the run folder says stop. Everything else (prompts, weights, back-pressure, pause,
stop) it reads from the run folder (``miles_core/rollout/fleet.py``), so it runs wherever its
deployment's work pool is: ``rollout/fleet`` on an inference machine, launched by the training
run (``--rollout-deployment rollout/fleet``), or started by hand to join a run that is going.

Cancelling its flow run (or the training run's) stops the producer cleanly: whole segments only,
its claimed but unstarted prompts given back, its heartbeat ``stopped``.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from flows.credentials import with_block_credentials
from miles_core.config import RunConfig
from miles_core.run import RunRefs


@flow(name="rollout", flow_run_name="{cfg.name}-{producer_id}", validate_parameters=True)
def rollout(cfg: RunConfig, refs: dict[str, Any], producer_id: str) -> dict[str, Any]:
    """Produce into run ``refs`` (``run_id``, ``run_dir``, ``model_dir``) as producer ``producer_id``;
    returns its counters."""
    from prefect.runtime import flow_run

    from miles_core.session.fleet_member import run_fleet_producer

    log = get_run_logger()
    cfg = with_block_credentials(cfg)
    return run_fleet_producer(cfg, RunRefs(**refs), producer_id, flow_run_id=str(flow_run.id or "") or None,
                              log=log.info)
