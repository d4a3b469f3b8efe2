"""Each Tinker training client as a Prefect flow run: ``ClientRuns``.

A client's flow run (flow ``tinker-training-client``, named ``<base>-r<rank>-<model id>``, tagged
``tinker``) is Running while the client trains, with two keyed artifacts kept current (at most
every ``publish_every_s`` and when the run ends): its steps as a table (loss summed over the step's
``forward_backward`` calls, datums, gradient norm, learning rate) and its loss curve (an image), plus
its checkpoints as they are saved. It ends Completed when the client's session finishes or the
client is unloaded, Cancelled when the service stops, and Crashed, saying what was lost, when a
restarted service finds it was still running.

Every Prefect call happens on this class's own thread: a slow or absent Prefect API never slows a
step. Failed calls are logged (once per kind) and dropped; training goes on.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

FLOW_NAME = "tinker-training-client"


@dataclass
class _Run:
    flow_run_id: Any = None
    title: str = ""
    rows: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    pending: dict[str, float] = field(default_factory=lambda: {"loss": 0.0, "datums": 0})
    published: float = 0.0


def run_key(model_id: str, what: str) -> str:
    return "-".join(re.sub(r"[^a-z0-9]+", "-", p.lower()).strip("-") for p in ("tinker", model_id, what))


class ClientRuns:
    """Flow runs of training clients (module docstring). ``submit`` only queues."""

    def __init__(self, publish_every_s: float = 5.0) -> None:
        self.publish_every_s = publish_every_s
        self._queue: queue.Queue = queue.Queue()
        self._runs: dict[str, _Run] = {}
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._work, name="tinker-prefect-runs", daemon=True)
        self._thread.start()

    # -- what the service reports (any thread)

    def started(self, model_id: str, info: dict[str, Any], on_created: Any = None) -> None:
        self._queue.put(("started", model_id, (info, on_created)))

    def forward_backward(self, model_id: str, loss: float, datums: int) -> None:
        self._queue.put(("fwdbwd", model_id, (loss, datums)))

    def optim_step(self, model_id: str, metrics: dict[str, float]) -> None:
        self._queue.put(("step", model_id, metrics))

    def checkpoint(self, model_id: str, path: str) -> None:
        self._queue.put(("checkpoint", model_id, path))

    def finished(self, model_id: str, state: str, message: str, flow_run_id: Any = None) -> None:
        """``state``: ``COMPLETED`` | ``CANCELLED`` | ``CRASHED``; ``flow_run_id`` for a run of an
        earlier life of the service."""
        self._queue.put(("finished", model_id, (state, message, flow_run_id)))

    def close(self, timeout: float = 30.0) -> None:
        """Flush what is queued (up to ``timeout``), then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    # -- the thread

    def _work(self) -> None:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            while (item := self._queue.get()) is not None:
                kind, model_id, payload = item
                try:
                    getattr(self, f"_on_{kind}")(client, model_id, payload)
                except Exception as e:  # noqa: BLE001 - Prefect's view must never stop training
                    if kind not in self._warned:
                        self._warned.add(kind)
                        log.warning("tinker: could not report %s of %s to Prefect (%s: %s); training goes on",
                                    kind, model_id, type(e).__name__, e)

    def _on_started(self, client: Any, model_id: str, payload: Any) -> None:
        from prefect.states import Running

        info, on_created = payload
        title = f"{info['base_model'].rstrip('/').rsplit('/', 1)[-1]}-r{info['rank']}-{model_id}"
        params = {k: info.get(k) for k in ("model_id", "base_model", "rank", "session_id", "seed")}
        flow_run = client.create_flow_run(_flow(), name=title, parameters=params, tags=["tinker"],
                                          state=Running(message=f"training client {model_id}"))
        self._runs[model_id] = _Run(flow_run.id, title)
        if on_created is not None:
            on_created(str(flow_run.id))

    def _on_fwdbwd(self, client: Any, model_id: str, payload: Any) -> None:
        run = self._runs.get(model_id)
        if run is not None:
            run.pending["loss"] += payload[0]
            run.pending["datums"] += payload[1]

    def _on_step(self, client: Any, model_id: str, metrics: dict[str, float]) -> None:
        run = self._runs.get(model_id)
        if run is None:
            return
        run.rows.append({"step": int(metrics.get("optimizer_steps", len(run.rows) + 1)), "loss": run.pending["loss"],
                         "datums": int(run.pending["datums"]), "grad_norm": metrics.get("grad_norm"),
                         "learning_rate": metrics.get("learning_rate")})
        run.pending = {"loss": 0.0, "datums": 0}
        if time.monotonic() - run.published >= self.publish_every_s:
            self._publish(client, model_id, run)

    def _on_checkpoint(self, client: Any, model_id: str, path: str) -> None:
        run = self._runs.get(model_id)
        if run is not None:
            run.checkpoints.append(path)
            self._publish(client, model_id, run)

    def _on_finished(self, client: Any, model_id: str, payload: Any) -> None:
        from prefect.states import Cancelled, Completed, Crashed

        state, message, flow_run_id = payload
        run = self._runs.pop(model_id, None)
        if run is not None:
            self._publish(client, model_id, run)
            flow_run_id = run.flow_run_id
        if flow_run_id is not None:
            made = {"COMPLETED": Completed, "CANCELLED": Cancelled, "CRASHED": Crashed}[state]
            client.set_flow_run_state(flow_run_id, made(message=message), force=True)

    def _publish(self, client: Any, model_id: str, run: _Run) -> None:
        from prefect.client.schemas.actions import ArtifactCreate

        from miles_core.report import data_url, panels_png

        run.published = time.monotonic()
        table = [{k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()} for row in run.rows]
        client.create_artifact(ArtifactCreate(key=run_key(model_id, "steps"), type="table", data=table,
                                              description=f"{run.title}: optimizer steps", flow_run_id=run.flow_run_id))
        points = [(row["step"], row["loss"]) for row in run.rows]
        png = panels_png([("loss (sum over the step's forward_backward calls)", {"loss": points})], run.title,
                         "optimizer step")
        client.create_artifact(ArtifactCreate(key=run_key(model_id, "loss"), type="image", data=data_url(png),
                                              description=f"{run.title}: loss curve", flow_run_id=run.flow_run_id))
        if run.checkpoints:
            lines = "\n".join(f"- `{p}`" for p in run.checkpoints)
            client.create_artifact(ArtifactCreate(key=run_key(model_id, "checkpoints"), type="markdown",
                                                  data=f"### Checkpoints of {run.title}\n\n{lines}\n",
                                                  flow_run_id=run.flow_run_id))


_FLOW = None


def _flow() -> Any:
    """The flow the runs belong to (made once; it never runs in this process: the runs are the
    service's record of its clients)."""
    global _FLOW
    if _FLOW is None:
        from prefect import flow

        @flow(name=FLOW_NAME)
        def tinker_training_client(model_id: str, base_model: str, rank: int, session_id: str,
                                   seed: int | None = None) -> None:
            """A training client of ``miles tinker-serve`` (its steps are made by the client's calls)."""

        _FLOW = tinker_training_client
    return _FLOW
