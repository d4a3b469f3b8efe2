"""The standalone evaluation flow: ``evaluate_run(run_dir, version=None, datasets=None)`` evaluates a
training run's newest (or a given) published weights on its held-out datasets (or on ``datasets``:
named ``EvalDatasetConfig`` entries, e.g. a new benchmark), or, for a multi-LoRA run, every
adapter's newest version, on an evaluation engine of its own (the training run, if still going, is
not touched). The results are appended to the run's ``eval_history.parquet`` and shown as a table
artifact with the whole history (with a column per dataset's accuracy when there are named
datasets), so a scheduled deployment of this flow (``miles serve``) shows the trend of a run as it
trains."""

from typing import Any, Optional

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_image_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from flows.credentials import with_block_credentials
from miles_core.config import EvalDatasetConfig
from miles_core.eval.standalone import append_history, open_run, read_history, resolve_run_dir
from miles_core.eval.standalone import evaluate_run as _evaluate_run
from miles_core.report import data_url, panels_png

_TABLE_KEYS = ("evaluated_at", "adapter", "version", "step", "accuracy", "reward_mean", "response_len_mean",
               "truncated_ratio")


@task(name="evaluate-snapshot", cache_policy=NO_CACHE, task_run_name="evaluate-{run_name}")
def evaluate_snapshot(run_dir: str, run_name: str, version: Optional[int], storage_options: dict,
                      datasets: Optional[list[EvalDatasetConfig]] = None, only_new: bool = False) -> list[dict]:
    cfg, _ = open_run(run_dir, storage_options)
    cfg = with_block_credentials(cfg)
    return _evaluate_run(run_dir, version, cfg.storage.storage_options, cfg=cfg, datasets=datasets, only_new=only_new)


def run_label(run_dir: str) -> str:
    """``<root>/<name>/<run id>`` -> ``<name>/<run id>`` (a folder of runs: ``<root>/<name>`` -> its last two
    parts too): what the flow run is called, instead of the whole path."""
    parts = [p for p in run_dir.rstrip("/").split("/") if p]
    return "/".join(parts[-2:]) or run_dir


def _flow_run_name() -> str:
    """``evaluate <name>/<run id>``: a folder of runs is named after its newest run (as it was when
    the flow run started), a folder with none yet after itself."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    path = str(params.get("run_dir", ""))
    try:
        path = resolve_run_dir(path, params.get("storage_options") or {})
    except Exception:  # noqa: BLE001 (no run yet, or unreadable: the flow says why; the name is the path's)
        pass
    return f"evaluate {run_label(path)}"


@flow(name="evaluate-run", flow_run_name=_flow_run_name)
def evaluate_run(run_dir: str, version: Optional[int] = None, storage_options: Optional[dict] = None,
                 datasets: Optional[list[EvalDatasetConfig]] = None, only_new: bool = False) -> list[dict[str, Any]]:
    """Evaluate the run in ``run_dir`` (its newest version, or ``version``); ``run_dir`` may also be
    the folder of a run name (``<storage.root>/<name>``): its newest run. ``datasets``: named
    held-out datasets to evaluate on instead of the run's own (dicts are validated as
    ``EvalDatasetConfig``). ``only_new`` (scheduled evaluations): no run yet, or a newest version
    evaluated before, is one log line and no evaluation. Returns the new rows."""
    log = get_run_logger()
    options = storage_options or {}
    try:
        run_dir = resolve_run_dir(run_dir, options)
    except FileNotFoundError as e:
        if not only_new:
            raise
        log.info("nothing to evaluate yet: %s", e)
        return []
    rows = evaluate_snapshot(run_dir, run_label(run_dir), version, options, datasets, only_new)
    if not rows:
        log.info("nothing new to evaluate in %s: its newest version was evaluated already", run_dir)
        return []
    for row in rows:
        who = f"adapter {row['adapter']} " if row["adapter"] else ""
        named = "".join(f", {k.removesuffix('/accuracy')} {v:.3f}" for k, v in row.items() if k.endswith("/accuracy"))
        log.info("%sversion %d: held-out accuracy %.3f%s", who, row["version"], row["accuracy"], named)
    record_evaluations(run_dir, rows, options)
    return rows


@task(name="record-evaluations", cache_policy=NO_CACHE)
def record_evaluations(run_dir: str, rows: list[dict[str, Any]], storage_options: dict) -> None:
    """Append ``rows`` to the run's evaluation history (``eval_history.parquet``) and show the whole
    history as a table artifact and a trend image."""
    append_history(run_dir, rows, storage_options)
    history = read_history(run_dir, storage_options)
    # parquet gives every row every column; a dataset a row was not evaluated on is None there
    per_dataset = sorted({k for r in history for k in r if k.endswith("/accuracy")})
    table = [{k: r.get(k) for k in (*_TABLE_KEYS, *per_dataset)} for r in history]
    create_table_artifact(table, key=None, description=f"held-out evaluations of {run_dir} (oldest first)")
    create_image_artifact(data_url(_trend_png(history, run_dir)), key=None,
                          description=f"held-out accuracy of {run_dir} per evaluated version")


def _trend_png(history: list[dict[str, Any]], run_dir: str) -> bytes:
    """Accuracy per evaluated version: a line per adapter (and per named dataset)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for row in history:
        # parquet gives every row every column: a row's own datasets are the ones it has values for
        keys = [k for k in row if k.endswith("/accuracy") and row[k] is not None] or ["accuracy"]
        for key in keys:
            parts = [row.get("adapter"), key.removesuffix("/accuracy") if "/" in key else None]
            name = " ".join(p for p in parts if p) or "accuracy"
            series.setdefault(name, []).append((row["version"], row[key]))
    return panels_png([("held-out accuracy", {k: sorted(v) for k, v in series.items()})], run_dir, "weight version")
