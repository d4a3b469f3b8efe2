"""The Python API: start a run, follow it, wait for it, cancel it.

```python
from deployments.api import start_run

run = start_run("configs/toy.toml")          # a RunConfig, a dict or a TOML path (as the CLI)
run.status()                                 # "RUNNING" (from the Prefect API)
summary = run.wait()                         # the flow's summary; RunFailed if the run failed
run.metrics()                                # rows of metrics.jsonl so far, one per step
```

- ``start_run(cfg, deployment=None, wait=False, timeout=None) -> RunHandle``:
  - without ``deployment`` the run's flow (``train``, or ``train-multi-lora`` when
    ``cfg.multi_lora`` is set) runs in this process, on a background thread: the flow run is
    created through the API first (so its id is known at once), then the engine runs it. The
    script that ends while such a run goes on waits for it to end.
    Prefect cannot cancel such a run (nothing supervises it);
  - with ``deployment="train/<name>"`` the run is created on that deployment
    (``run_deployment``) and runs wherever the deployment is served (``flow.serve`` or a worker);
    such a run can be cancelled.
  A fresh ``cfg.run_id`` is assigned before the run starts (unless the config names one, e.g. to
  resume), so the run folder ``<storage.root>/<name>/<run_id>`` is known in advance.
- ``get_run(flow_run_id) -> RunHandle``: a handle of an existing run, rebuilt from the flow run's
  ``cfg`` parameter (so runs started from the CLI, the UI or another process work too; one started
  without a ``run_id`` is found by the ``miles.run_id`` label its flow puts on its flow run).
- ``RunHandle``: ``id`` (the flow run id), ``run_id``, ``run_dir``, ``state()``/``status()``,
  ``wait()``, ``metrics()``, ``evals()``, ``evaluate(version=None, datasets=None)`` (the standalone evaluation
  flow, in this process), ``cancel()``.
- ``RunFailed``: what ``wait`` raises when a run ends in any state but COMPLETED.

Everything talks to whichever Prefect API is configured: the ephemeral default, a temporary test
server, or a real server through ``PREFECT_API_URL``. ``metrics()``/``evals()``/``wait()`` read
the run folder through fsspec *from this process*: for a deployment run, use a storage root that
both sides see the same way (object storage, or an absolute path on a shared filesystem).
"""

from __future__ import annotations

import contextvars
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from uuid import UUID

from miles_core.config import RunConfig

if TYPE_CHECKING:
    from prefect.client.schemas.objects import State
    from prefect.flows import Flow

__all__ = ["RunFailed", "RunHandle", "evaluate", "get_run", "start_run"]

_POLL_S = 1.0
_TRAIN_FLOWS = ("train", "train-multi-lora")
"""The flows a run config drives; a deployment of one of them must match the config."""


class RunFailed(RuntimeError):
    """A run ended in a state other than COMPLETED (failed, crashed or cancelled); ``state`` is
    its final Prefect state."""

    def __init__(self, message: str, state: State | None = None) -> None:
        super().__init__(message)
        self.state = state


# ------------------------------------------------------------------------------------- entry points


def start_run(
    cfg: RunConfig | dict[str, Any] | str | Path,
    deployment: str | None = None,
    wait: bool = False,
    timeout: float | None = None,
) -> RunHandle:
    """Start one run of ``cfg`` and return its handle at once (or, with ``wait=True``, once it has
    completed; RunFailed if it did not, TimeoutError after ``timeout`` seconds).

    ``cfg`` is a ``RunConfig``, a dict of its fields or the path of a TOML config file (the same
    object the CLI builds and the UI's form edits). ``deployment`` ("flow/deployment", e.g.
    ``"train/nightly"``) runs it where that deployment is served; None runs it in this process."""
    cfg = _as_config(cfg)
    if cfg.run_id is None:
        from miles_core.storage.layout import new_run_id

        cfg = cfg.model_copy(update={"run_id": new_run_id()})
    handle = _start_deployment(cfg, deployment) if deployment else _start_in_process(cfg)
    if wait:
        handle.wait(timeout)
    return handle


def get_run(flow_run_id: UUID | str) -> RunHandle:
    """A handle of an existing run, from its flow run id (as the UI shows it)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    flow_run_id = UUID(str(flow_run_id))
    local = _LOCAL_RUNS.get(flow_run_id)
    if local is not None:  # started by this process: the handle that owns the thread
        return local
    from flows.begin import run_config

    with get_client(sync_client=True) as client:
        try:
            flow_run = client.read_flow_run(flow_run_id)
        except ObjectNotFound:
            raise LookupError(f"no flow run {flow_run_id} on the Prefect API at {_api_url()}") from None
        cfg = run_config(flow_run, client)  # a deployment's run: its cfg on top of the deployment's
    return RunHandle(flow_run.id, cfg, in_process=flow_run.deployment_id is None)


def evaluate(run: RunHandle | UUID | str, version: int | None = None, datasets: list[Any] | None = None,
             storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Evaluate a run's newest (or ``version``) weights now, with the ``evaluate-run`` flow in this
    process, on its own eval datasets or on ``datasets``. ``run``: a handle, a flow run id (as the
    UI shows it), or a run folder (or a folder of runs of one name: its newest run), with
    ``storage_options`` for its filesystem. The rows are also appended to the run's
    ``eval_history.parquet``."""
    if isinstance(run, RunHandle):
        return run.evaluate(version, datasets)
    try:
        flow_run_id = UUID(str(run))
    except ValueError:
        return _evaluate_folder(str(run), version, datasets, storage_options or {}, str(run))
    return get_run(flow_run_id).evaluate(version, datasets)


def _evaluate_folder(run_dir: str, version: int | None, datasets: list[Any] | None, storage_options: dict[str, Any],
                     label: str) -> list[dict[str, Any]]:
    from flows.evaluate import evaluate_run

    state = evaluate_run(run_dir, version, storage_options, datasets, return_state=True)
    if not state.is_completed():
        error = state.result(raise_on_failure=False)  # a state of this process: it holds the exception
        raise RunFailed(f"evaluating {label} failed: {state.message}", state) from (
            error if isinstance(error, BaseException) else None)
    return state.result()


def _as_config(cfg: Any) -> RunConfig:
    if isinstance(cfg, RunConfig):
        return cfg
    if isinstance(cfg, dict):
        return RunConfig.model_validate_file_dict(cfg, source="start_run(cfg=<dict>)")
    if isinstance(cfg, (str, Path)):
        return RunConfig.from_toml(cfg)
    raise TypeError(f"cfg must be a RunConfig, a dict of its fields or a TOML file path, not {type(cfg).__name__}")


def _flow_for(cfg: RunConfig) -> Flow:
    """The flow a config drives (imported here: flows import prefect and the task modules)."""
    if cfg.multi_lora is not None:
        from flows.multi_lora import train_multi_lora

        return train_multi_lora
    from flows.train import train

    return train


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or "(ephemeral, this process)"


# ------------------------------------------------------------------------------------------ starting


def _start_in_process(cfg: RunConfig) -> RunHandle:
    """Create the flow run through the API, then run it with Prefect's engine on a thread. The
    thread runs in a copy of this context, so it sees the same Prefect settings (API URL)."""
    from prefect.client.orchestration import get_client
    from prefect.context import TagsContext
    from prefect.flow_engine import run_flow
    from prefect.states import Pending

    flow = _flow_for(cfg)
    parameters = {"cfg": cfg}
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(
            flow, parameters=flow.serialize_parameters(parameters), state=Pending(),
            tags=TagsContext.get().current_tags,
        )
    handle = RunHandle(flow_run.id, cfg, in_process=True)
    context = contextvars.copy_context()

    def body() -> None:
        try:
            handle._final = run_flow(flow, flow_run=flow_run, parameters=parameters, return_type="state")
        except BaseException as e:  # the engine itself broke; its flow run may not be final
            handle._error = e

    handle._thread = threading.Thread(target=context.run, args=(body,), name=f"miles-run-{cfg.run_id}")
    _LOCAL_RUNS[flow_run.id] = handle
    _wait_at_exit()
    handle._thread.start()
    return handle


def _wait_at_exit() -> None:
    """Make a script that ends while in-process runs go on wait for them. Joining their threads
    as Python does for any non-daemon thread is too late: the thread pools the flow uses refuse
    work from the moment the main thread ends (``concurrent.futures`` registers the same hook
    and the run would fail with "cannot schedule new futures after interpreter shutdown"). Hooks
    run in reverse order: this one is registered after those of concurrent.futures and of Prefect's
    services, so they still work while it waits."""
    global _EXIT_HOOK
    if _EXIT_HOOK:
        return
    import concurrent.futures.thread  # noqa: F401 (registers its hook first, so ours runs before it)

    # Prefect's log and event workers start on first use and register their own hook then, which
    # fails once the main thread has ended: start them now, so they run (and drain) after our wait.
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    EventsWorker.instance()
    APILogWorker.instance()

    def wait_for_runs() -> None:
        for handle in list(_LOCAL_RUNS.values()):
            if handle._thread is not None and handle._thread.is_alive():
                print(f"miles: waiting for in-process run {handle._label()} to end before exiting (runs started "
                      "with start_run(cfg) live in this process; start them on a deployment to exit at once)",
                      file=sys.stderr, flush=True)
                handle._thread.join()

    threading._register_atexit(wait_for_runs)  # CPython's hook "before joining threads" (as concurrent.futures)
    _EXIT_HOOK = True


def _start_deployment(cfg: RunConfig, deployment: str) -> RunHandle:
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    if deployment.count("/") != 1:
        raise ValueError(f"deployment {deployment!r}: name it 'flow/deployment', e.g. 'train/my-deployment'")
    flow_name = deployment.split("/")[0]
    expected = "train-multi-lora" if cfg.multi_lora is not None else "train"
    if flow_name in _TRAIN_FLOWS and flow_name != expected:
        raise ValueError(
            f"deployment {deployment!r} runs the {flow_name!r} flow, but this config is for {expected!r} "
            f"(multi_lora is {'set' if cfg.multi_lora is not None else 'not set'}); use a deployment of {expected!r}"
        )
    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            raise LookupError(
                f"no deployment {deployment!r} on the Prefect API at {_api_url()}: list them with "
                f"`prefect deployment ls`, or serve one, e.g. `train.serve(name=...)` from flows.train "
                f"(runs on a worker need `prefect deploy`)"
            ) from None
    # _sync: the blocking call even where an event loop is running (a notebook), where Prefect
    # would otherwise hand back a coroutine
    flow_run = run_deployment(deployment, parameters={"cfg": cfg.model_dump(mode="json")}, flow_run_name=cfg.name,
                              timeout=0, _sync=True)
    return RunHandle(flow_run.id, cfg, in_process=False)


# ------------------------------------------------------------------------------------------- handle

_NO_RUN_ID = ("run {label} has no run id yet, so its run folder is not known here: it was started without "
              "cfg.run_id and has not started (its flow labels the flow run with miles.run_id when it does)")
_EXIT_HOOK = False
_LOCAL_RUNS: dict[UUID, RunHandle] = {}
"""Runs this process started in process, by flow run id (``get_run`` returns their own handle)."""


class RunHandle:
    """One run: its Prefect flow run (``id``) and its run folder (``run_dir``)."""

    def __init__(self, flow_run_id: UUID, cfg: RunConfig, in_process: bool) -> None:
        self.id = flow_run_id
        """The Prefect flow run id (the UI's run page is ``<ui>/runs/flow-run/<id>``)."""
        self.cfg = cfg
        """The run's config (with its ``run_id``)."""
        self.in_process = in_process
        """Whether the run is (or was) executed by a plain process rather than a deployment's
        runner or worker; Prefect cannot cancel those."""
        self._thread: threading.Thread | None = None
        self._final: State | None = None
        self._error: BaseException | None = None
        self._summary: dict[str, Any] | None = None
        self._last: str | None = None

    @property
    def run_id(self) -> str | None:
        """The run id (the run folder's name). A deployment run started without one (from the UI's
        form, say) gets it when it starts, labelled on its flow run, where this reads it; None
        until then."""
        if self.cfg.run_id is None:
            from prefect.client.orchestration import get_client

            from flows.begin import RUN_ID_LABEL

            with get_client(sync_client=True) as client:
                run_id = client.read_flow_run(self.id).labels.get(RUN_ID_LABEL)
            if run_id:
                self.cfg = self.cfg.model_copy(update={"run_id": run_id})
        return self.cfg.run_id

    @property
    def run_dir(self) -> str | None:
        """The run folder's URL as this process sees the storage root; None without a run id."""
        return self._layout().run_dir if self.run_id else None

    # -- state

    def state(self) -> State:
        """The flow run's current Prefect state, from the API."""
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            state = client.read_flow_run(self.id).state
        self._last = state.type.value if state else None
        return state

    def status(self) -> str:
        """The flow run's state type from the API: ``SCHEDULED``, ``PENDING``, ``RUNNING``,
        ``COMPLETED``, ``FAILED``, ``CANCELLING``, ``CANCELLED``, ``CRASHED`` or ``PAUSED``."""
        state = self.state()
        return state.type.value if state else "SCHEDULED"

    def done(self) -> bool:
        """Whether the run has reached a final state."""
        state = self.state()
        return state is not None and state.is_final()

    # -- results

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the run to end; return its summary (what the flow returns, also in
        ``summary.json``). RunFailed if it failed, crashed or was cancelled (with the flow's error
        as the cause where this process has it); TimeoutError after ``timeout`` seconds."""
        if self._summary is not None:
            return self._summary
        state = self._wait_local(timeout) if self._thread is not None else self._wait_api(timeout)
        if not state.is_completed():
            raise RunFailed(f"run {self._label()} ended {state.name}: {state.message or 'no message'}", state) \
                from self._cause(state)
        self._summary = self._result(state)
        return self._summary

    def _wait_local(self, timeout: float | None) -> State:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"run {self._label()} still {self.status()} after {timeout} s")
        if self._error is not None:
            raise RunFailed(f"run {self._label()}: Prefect's engine failed: {self._error!r}") from self._error
        return self._final

    def _wait_api(self, timeout: float | None) -> State:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.state()
            if state is not None and state.is_final():
                return state
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {self._label()} still {self._last} after {timeout} s")
            time.sleep(_POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic())))

    def _cause(self, state: State) -> BaseException | None:
        if self._final is None:  # a state read from the API carries the message, not the exception
            return None
        error = state.result(raise_on_failure=False)
        return error if isinstance(error, BaseException) else None

    def _result(self, state: State) -> dict[str, Any]:
        """The flow's return value: in memory for a run of this process; otherwise the run's
        ``summary.json`` (deployment results are not persisted by default)."""
        if self._final is not None:
            return state.result()
        summary = self._layout().read_json("summary.json") if self.run_id else None
        if summary is None:
            raise RunFailed(f"run {self._label()} completed but {self.run_dir or 'its run folder'} has no "
                            f"summary.json readable from this process (storage root {self.cfg.storage.root!r})",
                            state)
        return summary

    def metrics(self, adapter: str | None = None) -> list[dict[str, Any]]:
        """Rows of the run's ``metrics.jsonl`` so far, one per training step. A multi-LoRA run
        keeps one file per adapter: ``adapter`` picks one; without it, every adapter's rows,
        each with an ``adapter`` key."""
        return self._rows("metrics.jsonl", adapter)

    def evals(self, adapter: str | None = None) -> list[dict[str, Any]]:
        """Rows of the run's ``eval.jsonl`` so far (held-out evaluations), as ``metrics``."""
        return self._rows("eval.jsonl", adapter)

    def _rows(self, file: str, adapter: str | None) -> list[dict[str, Any]]:
        if self.run_id is None:
            raise ValueError(_NO_RUN_ID.format(label=self._label()))
        layout = self._layout()
        if self.cfg.multi_lora is None:
            if adapter is not None:
                raise ValueError(f"run {self._label()} is not a multi-LoRA run: it has no adapter {adapter!r}")
            return layout.read_jsonl(file)
        names = self.cfg.multi_lora.names
        if adapter is not None:
            if adapter not in names:
                raise ValueError(f"run {self._label()} has no adapter {adapter!r}; its adapters are {names}")
            return layout.read_jsonl(f"adapters/{adapter}/{file}")
        return [{"adapter": n, **row} for n in names for row in layout.read_jsonl(f"adapters/{n}/{file}")]

    def evaluate(self, version: int | None = None, datasets: list[Any] | None = None) -> list[dict[str, Any]]:
        """Evaluate this run's newest (or ``version``) weights now, with the ``evaluate-run`` flow in
        this process (for a multi-LoRA run: every adapter's newest version), on the run's own eval
        datasets or on ``datasets`` (``EvalDatasetConfig`` or dicts); the rows are also appended to
        the run's ``eval_history.parquet``. Works while the run goes on."""
        if self.run_id is None:
            raise ValueError(_NO_RUN_ID.format(label=self._label()))
        return _evaluate_folder(self._layout().run_dir, version, datasets, self._storage().storage_options,
                                f"run {self._label()}")

    def _storage(self):
        from flows.credentials import with_block_credentials

        return with_block_credentials(self.cfg).storage if self.cfg.storage.credentials_block else self.cfg.storage

    def _layout(self):
        from miles_core.storage.layout import RunLayout

        storage = self._storage()
        return RunLayout(storage.root, self.cfg.name, self.run_id, storage.storage_options)

    # -- cancelling

    def cancel(self, timeout: float = 60.0) -> State:
        """Cancel the run through the API (as the UI's Cancel button) and wait until it ends;
        returns its final state. A run not yet started is cancelled at once; a running one is
        stopped by the runner or worker that executes it. Only deployment runs can be cancelled."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.objects import StateType
        from prefect.client.schemas.responses import SetStateStatus
        from prefect.states import Cancelled, Cancelling

        if self.in_process:
            raise RuntimeError(
                f"run {self._label()} runs in a plain process (start_run without deployment=), and Prefect cannot "
                "cancel such runs; start it on a served deployment to be able to cancel it: "
                "start_run(cfg, deployment='train/<name>')"
            )
        state = self.state()
        if state.is_final():
            return state
        waiting = state.type in (StateType.SCHEDULED, StateType.PAUSED)  # no process to stop yet
        with get_client(sync_client=True) as client:
            result = client.set_flow_run_state(self.id, Cancelled() if waiting else Cancelling())
        if result.status not in (SetStateStatus.ACCEPT, SetStateStatus.WAIT):
            state = self.state()
            if state.is_final():  # it ended meanwhile
                return state
            raise RuntimeError(f"run {self._label()}: the API refused to cancel it ({result.details})")
        return self._wait_api(timeout)

    def _label(self) -> str:
        return f"{self.cfg.name}/{self.run_id} (flow run {self.id})"

    def __repr__(self) -> str:
        where = "in process" if self.in_process else "deployment"
        last = f", last status {self._last}" if self._last else ""
        return f"RunHandle(id={str(self.id)!r}, name={self.cfg.name!r}, run_id={self.run_id!r}, {where}{last})"
