"""What every training flow does first: ``begin_run(cfg)`` puts a deployment run's config on top of
its deployment's (``deployment_config``), resolves the storage credentials, checks
the device pool, prepares the run folder (``prepare-run``) and labels the flow run with its run id
(``miles.run_id``). A run started without a run id (from the UI's form, say) gets one here; the
label lets ``deployments.api.get_run`` find its folder from the flow run alone."""

from __future__ import annotations

from typing import Any

from flows.credentials import with_block_credentials
from miles_core.config import RunConfig, mode_table
from miles_core.run import RunRefs
from tasks.slots import check_device_pool
from tasks.train import prepare_run

RUN_ID_LABEL = "miles.run_id"


def begin_run(cfg: RunConfig) -> tuple[RunConfig, RunRefs]:
    """The run's config (a deployment run's on top of its deployment's, with its credentials) and
    references; fails before any work when the device pool cannot hold the run."""
    cfg = with_block_credentials(deployment_config(cfg))
    check_device_pool(cfg)
    refs = prepare_run(cfg)
    _label_run_id(refs.run_id)
    return cfg, refs


def flow_run_name() -> str:
    """A training flow run's name: a run of a deployment keeps the name it was started with (the
    UI form's Run Name, ``prefect deployment run --name``, ``start_run``'s config name); a run
    started in this process (``miles train``, ``train(cfg)``) is named after its config."""
    from prefect.runtime import deployment, flow_run

    if deployment.id is not None and flow_run.name:
        return flow_run.name
    cfg = flow_run.parameters.get("cfg")
    return getattr(cfg, "name", None) or (cfg or {}).get("name") or "miles-run"


def deployment_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` as this flow run trains with it (``run_config``): for a run of a deployment, the cfg it
    was given on top of the deployment's; outside a flow run, ``cfg`` as it is. A deployment whose
    config names a mode runs that mode only (its runs carry the mode's tag): a run asking for
    another fails here, before any work, naming the deployment to use."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if flow_run.id is None:
        return cfg
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run.id)
        if run.deployment_id is None:
            return cfg
        deployment = client.read_deployment(run.deployment_id)
    cfg = _merged(run, deployment.parameters.get("cfg"))
    mode = (mode_table((deployment.parameters.get("cfg") or {}).get("mode")) or {}).get("type")
    if mode is not None and mode != cfg.mode.type and cfg.multi_lora is None:
        wanted = cfg.mode.type.replace("_", "-")
        raise ValueError(f"deployment {deployment.name!r} trains in mode {mode!r} (its runs are tagged so); this "
                         f"run asks for mode {cfg.mode.type!r}: start it on the {wanted!r} deployment instead, or "
                         f"leave mode as it is")
    return cfg


def run_config(run: Any, client: Any) -> RunConfig:
    """The config flow run ``run`` trains with: its ``cfg`` parameter (as stored with the flow run,
    before pydantic filled in defaults), for a run of a deployment applied as overrides on the
    deployment's own ``cfg`` (``config.merge_overrides``: tables merge key by key, dotted keys reach
    into them), so ``--param cfg='{"rollout.num_rollout": 6}'`` changes one field of the served
    config instead of replacing the rest with built-in defaults. ``client``: a sync Prefect client."""
    served = None if run.deployment_id is None else client.read_deployment(run.deployment_id).parameters.get("cfg")
    return _merged(run, served)


def _merged(run: Any, served: Any) -> RunConfig:
    """Flow run ``run``'s cfg on top of ``served`` (its deployment's cfg, or None)."""
    from miles_core.config import merge_overrides

    given = run.parameters.get("cfg")
    if not isinstance(given, dict):
        raise ValueError(f"flow run {run.id} ({run.name!r}) has no 'cfg' parameter: not a miles run")
    source = f"flow run {run.id}'s cfg parameter"
    if isinstance(served, dict):
        given, source = merge_overrides(served, given), f"{source} on top of its deployment's"
    return RunConfig.model_validate_file_dict(given, source=source)


def _label_run_id(run_id: str) -> None:
    """Label the current flow run with ``run_id`` (nothing outside a flow run)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if flow_run.id is None:
        return
    with get_client(sync_client=True) as client:
        client.update_flow_run_labels(flow_run.id, {RUN_ID_LABEL: run_id})
