"""Standalone evaluation of a run's weights, outside its training flow (``flows/evaluate.py``).

- ``resolve_run_dir(path)``: a run folder, or the newest run in a folder of runs of one name.
- ``open_run(run_dir)``: the run's config (``config.json``) and references, from its folder URL.
- ``evaluate_run(run_dir, version=None, datasets=None)``: evaluates the run's newest (or a given)
  published version on its held-out datasets (or on ``datasets``, e.g. a new benchmark), on an
  evaluation engine that loads that snapshot (pinned in the weight store meanwhile); for a
  multi-LoRA run, the newest version of every adapter. Returns one row per evaluated policy (with
  named datasets, each dataset's metrics as ``<name>/<metric>``). The run's own ``eval.jsonl``
  (its in-run history) is left as it is.
- ``evaluated_versions(run_dir)``: the (adapter, version) pairs already in the history; with
  ``evaluate_run(..., only_new=True)`` (scheduled evaluations) a newest version found there is not
  evaluated again.
- ``append_history(run_dir, rows)``: adds rows to ``eval_history.parquet`` in the run folder (the
  record of standalone evaluations: when, which adapter and version, the metrics; its columns are
  the union of the rows' keys, so evaluations on other datasets add columns), written whole and
  atomically (object stores cannot append); ``read_history(run_dir)`` reads it back.
"""

from __future__ import annotations

import io
import posixpath
import time
from datetime import datetime, timezone
from typing import Any

from miles_core.config import EVAL_INHERITS, REDACTED, EvalDatasetConfig, RunConfig, dataset_tables, upgrade_mode
from miles_core.session.evals import Evaluator
from miles_core.session.history import RunHistory
from miles_core.session.parts import EngineLoop, RunFiles, setup_tokenizer
from miles_core.session.refs import RunRefs

HISTORY_FILE = "eval_history.parquet"


def _split(run_dir: str) -> tuple[str, str, str]:
    """``<root>/<name>/<run_id>`` -> (root, name, run_id)."""
    path = run_dir.rstrip("/")
    run_id = posixpath.basename(path)
    parent = posixpath.dirname(path)
    return posixpath.dirname(parent), posixpath.basename(parent), run_id


def resolve_run_dir(path: str, storage_options: dict[str, Any] | None = None) -> str:
    """``path`` itself when it is a run folder (it has ``config.json``); when it is a run name's
    folder (``<root>/<name>``), its newest run (run ids sort by start time): what a scheduled
    evaluation of "the latest run of this name" wants."""
    from miles_core.storage.fs import join, open_fs

    fs, folder = open_fs(path, storage_options)
    if fs.exists(join(folder, "config.json")):
        return path
    runs = sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(folder, detail=False)
                  if fs.exists(join(p, "config.json")))
    if not runs:
        raise FileNotFoundError(f"{path}: neither a run folder (no config.json) nor a folder of runs")
    return join(path.rstrip("/"), runs[-1])


def open_run(run_dir: str, storage_options: dict[str, Any] | None = None) -> tuple[RunConfig, RunRefs]:
    """The config and references of the run in ``run_dir`` (a folder a training run wrote)."""
    from miles_core.models import ensure_model
    from miles_core.storage.layout import RunLayout

    root, name, run_id = _split(run_dir)
    layout = RunLayout(root, name, run_id, storage_options)
    raw = _config_json(run_dir, storage_options)
    for table in dataset_tables(raw):  # redacted when the run saved it: give them again if needed
        if table.get("storage_options") == REDACTED:
            table["storage_options"] = {}
    raw["storage"] = {**raw["storage"], "root": root, "storage_options": storage_options or {}}
    raw["run_id"] = run_id
    cfg = RunConfig.model_validate_file_dict(raw, source=f"{run_dir}/config.json")
    model_dir = ensure_model(cfg.model, log=lambda *_: None)
    return cfg, RunRefs(run_id=run_id, run_dir=layout.run_dir, model_dir=str(model_dir))


def _step_of(files: RunFiles, version: int) -> int | None:
    """The training step that published ``version`` (None: not in this run's metrics)."""
    steps = [int(r["step"]) for r in files.layout.read_jsonl("metrics.jsonl") if int(r.get("version", -1)) == version]
    return steps[-1] if steps else None


def evaluated_versions(run_dir: str, storage_options: dict[str, Any] | None = None) -> set[tuple[str | None, int]]:
    """(adapter, version) pairs ``eval_history.parquet`` already holds for the run in ``run_dir``."""
    run_id = _split(run_dir)[2]
    return {(r.get("adapter"), int(r["version"])) for r in read_history(run_dir, storage_options)
            if r.get("run_id") in (None, run_id)}


def _evaluate(evals: Evaluator, files: RunFiles, refs: RunRefs, version: int | None,
              adapter: str | None, skip: set[tuple[str | None, int]] = frozenset()) -> dict[str, Any] | None:
    """One evaluated policy's row; None when ``version`` is None and the newest is in ``skip``."""
    latest = files.weights.latest() or 0
    if version is None and (adapter, latest) in skip:
        return None
    version = latest if version is None else version
    if version > latest:
        raise ValueError(f"{refs.run_dir}: version {version} is not published (newest: {latest})")
    step = _step_of(files, version)
    metrics = evals.evaluate_version(step if step is not None else -1, version, record=False)
    return {"evaluated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "run_id": refs.run_id,
            "adapter": adapter, "version": version, "step": step, **{k: v for k, v in metrics.items() if k != "step"}}


def file_datasets(run_dir: str, pairs: list[str], storage_options: dict[str, Any] | None = None,
                  **keys: str | None) -> list[dict[str, Any]]:
    """``NAME PATH [NAME PATH ...]`` as held-out file datasets, read with the run's training data's
    keys (``input_key``, ``label_key``, chat template, ...) unless ``keys`` names others."""
    if not pairs or len(pairs) % 2:
        raise ValueError(f"expected NAME PATH pairs, got {len(pairs)} values: {' '.join(pairs)}")
    raw = _config_json(run_dir, storage_options)
    train = raw.get("data") or {}
    inherited = {k: train[k] for k in EVAL_INHERITS if k in train and train.get("type") == "file"}
    inherited.update({k: v for k, v in keys.items() if v is not None})
    return [{"name": name, "data": {**inherited, "type": "file", "path": path}}
            for name, path in zip(pairs[::2], pairs[1::2])]


def _config_json(run_dir: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    from miles_core.storage.layout import RunLayout

    raw = RunLayout(*_split(run_dir), storage_options).read_json("config.json")
    if raw is None:
        raise FileNotFoundError(f"{run_dir}: no config.json (is it the folder of a training run?)")
    return upgrade_mode(raw, strict=False)  # a run's settings of another mode did nothing in it


def with_eval_datasets(cfg: RunConfig, datasets: list[EvalDatasetConfig | dict[str, Any]]) -> RunConfig:
    """``cfg`` evaluating on ``datasets`` (entries or their dicts, validated) instead of its own."""
    if not datasets:
        raise ValueError("datasets: give at least one dataset to evaluate on (None: the run's own)")
    raw = cfg.model_dump()
    raw["eval"].update(data=None, datasets=list(datasets))
    return RunConfig.model_validate_file_dict(raw, source="evaluation datasets")


def evaluate_run(run_dir: str, version: int | None = None, storage_options: dict[str, Any] | None = None,
                 cfg: RunConfig | None = None, datasets: list[EvalDatasetConfig | dict[str, Any]] | None = None,
                 only_new: bool = False) -> list[dict[str, Any]]:
    """Evaluate the run's newest (or ``version``) weights; a multi-LoRA run: every adapter's newest.
    ``datasets``: evaluate on these (named) datasets instead of the run's own held-out ones.
    ``only_new``: a newest version ``eval_history.parquet`` already has is not evaluated again (a
    scheduled evaluation of a finished run evaluates nothing: no rows)."""
    from miles_core.multi_lora import MultiLoraRun

    if cfg is None:
        cfg, refs = open_run(run_dir, storage_options)
    else:
        refs = open_run(run_dir, storage_options)[1]
    if datasets is not None:
        cfg = with_eval_datasets(cfg, datasets)
    skip = evaluated_versions(run_dir, storage_options) if only_new else set()
    if cfg.multi_lora is None:  # only the evaluator of the run: no rollout engine, no trainer
        files, loop = RunFiles.open(cfg, refs), EngineLoop()
        if version is None and (None, files.weights.latest() or 0) in skip:  # before an engine starts
            return []
        evals = Evaluator(cfg, refs, loop, files.weights, RunHistory(files.layout), lambda: setup_tokenizer(refs))
        try:
            return [_evaluate(evals, files, refs, version, None)]
        finally:
            evals.close()
            loop.close()
    if version is not None:
        raise ValueError("a multi-LoRA run has one version counter per adapter: evaluate it without a version")
    run = MultiLoraRun(cfg, refs)
    try:
        rows = []
        for name, session in run.adapters.items():
            t0 = time.perf_counter()
            row = _evaluate(session.evals, session.files, session.refs, None, name, skip)
            if row is not None:
                rows.append(row | {"eval_seconds": time.perf_counter() - t0})
        return rows
    finally:
        run.close()


def read_history(run_dir: str, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    from miles_core.storage.fs import join, open_fs, read_bytes

    fs, path = open_fs(run_dir, storage_options)
    data = read_bytes(fs, join(path, HISTORY_FILE))
    return [] if data is None else pq.read_table(io.BytesIO(data)).to_pylist()


def append_history(run_dir: str, rows: list[dict[str, Any]], storage_options: dict[str, Any] | None = None) -> str:
    """Add ``rows`` to the run's ``eval_history.parquet``; returns the file's URL."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from miles_core.storage.fs import atomic_write, join, open_fs

    history = read_history(run_dir, storage_options) + rows
    columns = sorted({k for r in history for k in r})
    table = pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in history])
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    fs, path = open_fs(run_dir, storage_options)
    atomic_write(fs, join(path, HISTORY_FILE), buffer.getvalue())
    return join(run_dir.rstrip("/"), HISTORY_FILE)
