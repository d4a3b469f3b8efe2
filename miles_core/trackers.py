"""Experiment trackers: a run's metrics, as the run records them, also go to Weights & Biases,
TensorBoard or MLflow (``tracking`` in the config; Miles' ``--use-wandb``, ``--use-tensorboard``,
``--use-mlflow``).

- ``open_trackers(cfg, run_id, run_dir)`` -> ``Trackers``: the run's trackers, each started now (a
  missing package fails the run before any work, with the command that installs it).
- ``Trackers.log(row, step, prefix)``: one ``metrics.jsonl`` or ``eval.jsonl`` row, its numbers only,
  under the same names (``RunHistory`` calls it; evaluations with the prefix ``eval/``).
- ``Trackers.close(ok)``: ends every tracker's run, finished or failed.

Names: the files' own, but for MLflow, whose names may not hold ``@``: ``pass@1`` is ``pass_at_1``
there. Steps: the training step (1-based); an evaluation arrives when it finishes, which may be
after later steps (W&B plots against the ``step`` metric, not its own counter, for that reason).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from miles_core.config import RunConfig, TrackingConfig

INSTALL = "pip install 'miles-prefect[trackers]'"


class TrackerMissing(ImportError):
    """A tracker is on but its package is not installed."""


def _import(module: str, package: str, flag: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise TrackerMissing(f"{flag} is on, but {package!r} is not installed ({e}): {INSTALL} (or pip install "
                             f"{package}), or turn {flag} off") from None


def numbers(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The row's finite numbers under ``prefix + name`` (``step`` itself left out)."""
    out = {}
    for key, value in row.items():
        if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
            out[prefix + key] = float(value)
    return out


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self, ok: bool) -> None: ...


class Trackers:
    """The run's trackers (maybe none); thread-safe (evaluations finish on their own threads)."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers
        self._lock = threading.Lock()
        self.closed = False

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def log(self, row: dict[str, Any], step: int, prefix: str = "") -> None:
        metrics = numbers(row, prefix)
        if not self.trackers or not metrics:
            return
        with self._lock:
            if not self.closed:
                for tracker in self.trackers:
                    tracker.log(metrics, step)

    def close(self, ok: bool) -> None:
        """End every tracker's run (``ok``: finished, else failed); the first error is raised after all closed."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        errors = []
        for tracker in self.trackers:
            try:
                tracker.close(ok)
            except Exception as e:  # noqa: BLE001 (the others still close)
                errors.append(e)
        if errors:
            raise errors[0]


def open_trackers(cfg: RunConfig, run_id: str, run_dir: str) -> Trackers:
    """Start the trackers ``cfg.tracking`` turns on for run ``run_id`` (its folder ``run_dir``)."""
    t = cfg.tracking
    opened: list[Tracker] = []
    try:
        if t.wandb:
            opened.append(WandbTracker(cfg, t, run_id, run_dir))
        if t.tensorboard:
            opened.append(TensorBoardTracker(cfg, t, run_id, run_dir))
        if t.mlflow:
            opened.append(MlflowTracker(cfg, t, run_id))
    except BaseException:
        Trackers(opened).close(ok=False)
        raise
    return Trackers(opened)


def _local_dir(run_dir: str, sub: str, fallback: Path) -> Path:
    """``run_dir/sub`` when the run folder is local, else ``fallback`` (trackers write local files)."""
    from miles_core.storage.fs import is_local, open_fs

    fs, path = open_fs(run_dir)
    return Path(path) / sub if is_local(fs) else fallback


class WandbTracker:
    """A W&B run whose id is the run id (a resumed run goes on in it); ``step`` is its x-axis."""

    def __init__(self, cfg: RunConfig, t: TrackingConfig, run_id: str, run_dir: str) -> None:
        wandb = _import("wandb", "wandb", "tracking.wandb")
        folder = Path(t.wandb_dir) if t.wandb_dir else _local_dir(run_dir, "", Path("."))  # W&B adds wandb/
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=t.wandb_project or cfg.name, entity=t.wandb_entity, group=t.wandb_group,
            name=t.wandb_run_name or f"{cfg.name}-{run_id}", id=run_id, resume="allow", dir=str(folder),
            mode=t.wandb_mode or os.environ.get("WANDB_MODE") or "online", config=cfg.public_dict(),
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({"step": step, **metrics})

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class TensorBoardTracker:
    """Event files (``torch.utils.tensorboard``), a scalar per metric, flushed after every row."""

    def __init__(self, cfg: RunConfig, t: TrackingConfig, run_id: str, run_dir: str) -> None:
        _import("tensorboard", "tensorboard", "tracking.tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(t.tensorboard_dir) if t.tensorboard_dir else _local_dir(
            run_dir, "tensorboard", Path("tensorboard") / cfg.name / run_id)
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self, ok: bool) -> None:
        self.writer.close()


def mlflow_name(key: str) -> str:
    """A metric name MLflow takes (no ``@``: ``pass@4`` -> ``pass_at_4``)."""
    return key.replace("@", "_at_")


class MlflowTracker:
    """An MLflow run tagged ``miles.run_id`` in ``mlflow_experiment`` (found again on resume)."""

    def __init__(self, cfg: RunConfig, t: TrackingConfig, run_id: str) -> None:
        _import("mlflow", "mlflow-skinny", "tracking.mlflow")
        from mlflow.tracking import MlflowClient

        for name in ("mlflow", "alembic"):  # table creation and migrations log at INFO
            logging.getLogger(name).setLevel(logging.WARNING)
        uri = (t.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
               or f"sqlite:///{Path('mlflow.db').resolve()}")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(t.mlflow_experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(t.mlflow_experiment)
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`miles.run_id` = '{run_id}'",
                                        max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(experiment_id, run_name=t.mlflow_run_name or f"{cfg.name}-{run_id}",
                                         tags={"miles.run_id": run_id, "miles.name": cfg.name, "miles.mode": cfg.mode.type})
            self.run_id = run.info.run_id
            self._log_params(cfg)

    def _log_params(self, cfg: RunConfig) -> None:
        from mlflow.entities import Param

        flat: dict[str, str] = {}

        def walk(node: Any, path: str) -> None:
            if isinstance(node, dict):
                for key, value in node.items():
                    walk(value, f"{path}.{key}" if path else key)
            else:
                flat[path] = str(node)[:500]

        walk(cfg.public_dict(), "")
        params = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a call
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_name(k), v, now, step) for k, v in metrics.items()])

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")
