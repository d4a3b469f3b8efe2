"""Prefect tasks of a fully-async run's rollout fleet, and the launcher that starts producers as
flow runs of a deployment.

- ``launch-producers``: start the run's producers: child processes of this one (the laptop
  default), or, with ``mode.rollout_deployment`` (e.g. ``rollout/fleet``), flow runs of
  that deployment on whatever work pool it is on: children of the training run in the UI, each with
  its own logs, engine and producer id.
- ``stop-producers``: ask them to stop through the run folder, wait, then make sure.

``DeploymentLauncher`` is the ``Launcher`` for deployments: ``ended`` reads the flow run's state
(a CRASHED, FAILED or CANCELLED producer is dead at once, without waiting out its heartbeat), and
``stop`` cancels a flow run that did not stop by itself.
"""

from __future__ import annotations

from dataclasses import asdict

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from miles_core import processes
from miles_core.config import RunConfig
from miles_core.run import RunRefs, get_session

_ENDED = {"CRASHED", "FAILED", "CANCELLED", "CANCELLING", "COMPLETED"}


class DeploymentLauncher:
    """Producers as flow runs of deployment ``name`` (``rollout/fleet``), children of this flow run."""

    def __init__(self, name: str, cfg: RunConfig, refs: RunRefs, log=print) -> None:
        self.name, self.cfg, self.refs, self.log = name, cfg, refs, log
        self.runs: dict[str, str] = {}

    def launch(self, producer: str) -> None:
        from prefect.deployments import run_deployment

        params = {"cfg": self.cfg.model_dump(mode="json"), "refs": asdict(self.refs), "producer_id": producer}
        run = run_deployment(self.name, parameters=params, timeout=0, flow_run_name=f"{self.cfg.name}-{producer}",
                             tags=["rollout", f"miles.run:{self.refs.run_id}"], _sync=True)
        self.runs[producer] = str(run.id)
        self.log(f"launched rollout producer {producer}: flow run {run.id} of {self.name}")

    def _state(self, producer: str):
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return client.read_flow_run(self.runs[producer]).state

    def ended(self, producer: str) -> str | None:
        if producer not in self.runs:
            return None
        state = self._state(producer)
        if state is None or state.type.value not in _ENDED:
            return None
        return f"its flow run {self.runs[producer]} is {state.type.value}" + (f": {state.message}" if state.message else "")

    def stop(self, producer: str, timeout: float = 10.0) -> bool:
        """Wait for its flow run to end; cancel it if it does not within ``timeout`` (then True)."""
        if producer not in self.runs:
            return False

        def ended() -> bool:  # a producer asked to stop completes by itself
            state = self._state(producer)
            return state is not None and state.is_final()

        if processes.wait_until(ended, timeout, poll_s=0.2):
            return False
        self.cancel(producer)
        return True

    def abandon(self, producer: str, reason: str) -> None:
        """It was declared dead: its flow run is marked CRASHED with the reason (its worker may be
        gone with its machine, leaving the run RUNNING forever otherwise)."""
        from prefect.client.orchestration import get_client
        from prefect.states import Crashed

        state = self._state(producer) if producer in self.runs else None
        if state is None or state.is_final():
            return
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(self.runs[producer], Crashed(message=f"declared dead by the training run: {reason}"),
                                      force=True)

    def cancel(self, producer: str) -> None:
        """Cancel its flow run (its worker or runner stops it: CANCELLED), unless it already ended."""
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelling

        if producer not in self.runs:
            return
        state = self._state(producer)
        if state is not None and (state.is_final() or state.type.value == "CANCELLING"):
            return
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(self.runs[producer], Cancelling(message="the training run cancelled it"),
                                      force=True)


def _warn(message: str) -> None:
    """A fleet warning, in the log of the task or flow run that noticed it (later train steps)."""
    import logging

    from prefect.exceptions import MissingContextError

    try:
        get_run_logger().warning(message)
    except MissingContextError:
        logging.getLogger("miles.fleet").warning(message)


@task(name="launch-producers", cache_policy=NO_CACHE, task_run_name="launch-producers")
def launch_producers(cfg: RunConfig, refs: RunRefs) -> list[str]:
    """Start the fully-async run's rollout producers; returns their ids."""
    from miles_core.session.fleet_member import SubprocessLauncher

    log = get_run_logger()
    a = cfg.mode
    if a.rollout_deployment is not None:
        launcher = DeploymentLauncher(a.rollout_deployment, cfg, refs, log=log.info)
    else:
        launcher = SubprocessLauncher(cfg, refs, log=log.info)
    fleet = get_session(cfg, refs).start_fleet(launcher, warn=_warn)
    return fleet.monitor.producers()


@task(name="stop-producers", cache_policy=NO_CACHE, task_run_name="stop-producers")
def stop_producers(cfg: RunConfig, refs: RunRefs) -> dict:
    """Stop every producer of the run; returns which producer wrote what."""
    session = get_session(cfg, refs)
    session.stop_fleet()
    return session.fleet.summary() if session.fleet is not None else {}
