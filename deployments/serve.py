"""``miles serve``: register the project's deployments with the Prefect API and run them here.

Deployments (``<flow>/<deployment>``), each taking the pydantic ``RunConfig`` as its parameter, so
the UI shows a validated form whose defaults are the config ``miles serve`` was given (``--config``
and flags, as ``miles train``):

- ``train/sync``, ``train/async``, ``train/fully-async``: a training run in that mode;
- ``train-multi-lora/multi-lora``: N adapters over one rollout stream (its default config is
  ``configs/multi-lora-toy.toml`` unless the given config has a ``multi_lora`` section);
- ``rollout/fleet``: one rollout producer of a fully-async run (``--rollout-deployment rollout/fleet``
  launches the run's producers as flow runs of it);
- ``evaluate-run/on-demand``: evaluate a run folder's newest (or a given) version;
- ``tinker-service/serve``: the Tinker API (``miles tinker-serve``) until the run is cancelled;
- ``evaluate-run/scheduled`` (with ``--eval-runs PATH`` and ``--eval-cron`` or ``--eval-every-s``):
  the same on a schedule, over ``PATH``: a run folder, or ``<storage.root>/<name>`` for the newest
  run of that name; a tick with no run yet, or whose newest version was evaluated before, is one
  log line and no evaluation (``only_new``), and one that comes due while the last still runs is
  cancelled.

The runs execute in this process's runner (``prefect.serve``), which also makes them cancellable
from the UI. ``--device-slots gpu=8`` creates (or resizes) the global concurrency limit that runs
with ``--device-pool gpu`` draw their slots from (``ResourcesConfig``). ``deployments(cfg, ...)`` builds the list without serving it (for tests and for
``prefect.yaml`` users: the same deployments, declared there for ``prefect deploy``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from miles_core.config import MODE_TABLES, RunConfig

MODES = {"sync": "sync", "async": "async", "fully-async": "fully_async"}
MULTI_LORA_RECIPE = Path(__file__).resolve().parents[1] / "configs" / "multi-lora-toy.toml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve-only options (the run config's flags come with every run-config command)."""
    parser.add_argument("--eval-runs", metavar="PATH",
                        help="schedule evaluate-run over this run folder, or <storage.root>/<name> (its newest run)")
    parser.add_argument("--eval-cron", metavar="CRON", help="schedule of evaluate-run/scheduled, e.g. '0 * * * *'")
    parser.add_argument("--eval-every-s", type=float, metavar="SECONDS",
                        help="schedule of evaluate-run/scheduled as an interval")
    parser.add_argument("--device-slots", action="append", default=[], metavar="POOL=N",
                        help="create (or resize) the global concurrency limit POOL with N slots, e.g. gpu=8 "
                             "(runs draw from it with --device-pool POOL); repeatable")


def deployments(cfg: RunConfig, eval_runs: str | None = None, eval_cron: str | None = None,
                eval_every_s: float | None = None) -> list[Any]:
    """The project's deployments (``RunnerDeployment`` objects), their defaults taken from ``cfg``."""
    from flows.evaluate import evaluate_run
    from flows.multi_lora import train_multi_lora
    from flows.rollout import rollout
    from flows.tinker import tinker_service
    from flows.train import train

    cfg = absolute_paths(cfg, Path.cwd())
    out = []
    for name, mode in MODES.items():
        table = cfg.mode if cfg.mode.type == mode else MODE_TABLES[mode]()  # the served mode's settings, or defaults
        default = cfg.model_copy(update={"mode": table, "multi_lora": None})
        deployment = train.to_deployment(
            name=name, parameters={"cfg": default.model_dump(mode="json")}, tags=["train", mode],
            description=f"A training run in {mode} mode (the config form's defaults: `miles serve`'s config).",
        )
        _fix_mode(deployment, mode)
        out.append(deployment)
    multi = cfg if cfg.multi_lora is not None else RunConfig.from_toml(MULTI_LORA_RECIPE)
    out.append(train_multi_lora.to_deployment(
        name="multi-lora", parameters={"cfg": multi.model_dump(mode="json")}, tags=["train", "multi-lora"],
        description="N LoRA adapters trained over one rollout stream.",
    ))
    out.append(rollout.to_deployment(
        name="fleet", tags=["rollout"],
        description="One rollout producer of a fully-async run (launched by the run: --rollout-deployment "
                    "rollout/fleet; or started by hand to join one).",
    ))
    out.append(evaluate_run.to_deployment(
        name="on-demand", tags=["eval"], description="Evaluate a run folder's newest (or a given) version.",
    ))
    out.append(tinker_service.to_deployment(
        name="serve", tags=["tinker"], parameters={"storage": cfg.storage.root},
        description="The Tinker API (the tinker SDK and tinker-cookbook) until cancelled; each training client "
                    "is a flow run of tinker-training-client. The API key: MILES_TINKER_API_KEY on the worker.",
    ))
    if eval_runs is not None:
        if (eval_cron is None) == (eval_every_s is None):
            raise ValueError("--eval-runs needs a schedule: --eval-cron CRON or --eval-every-s SECONDS (one of them)")
        from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

        schedule = {"cron": eval_cron} if eval_cron is not None else {"interval": eval_every_s}
        # one scheduled evaluation at a time: one that comes due while the last still runs is
        # cancelled, not started beside it (evaluations slower than their interval would pile up)
        one_at_a_time = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW)
        out.append(evaluate_run.to_deployment(
            name="scheduled", parameters={"run_dir": eval_runs, "only_new": True}, tags=["eval", "scheduled"],
            description=f"Evaluate the newest version of {eval_runs} on a schedule (never two at once).",
            concurrency_limit=one_at_a_time, **schedule,
        ))
    elif eval_cron is not None or eval_every_s is not None:
        raise ValueError("--eval-cron / --eval-every-s schedule evaluations of --eval-runs PATH: give it too")
    return out


def _fix_mode(deployment: Any, mode: str) -> None:
    """The deployment's form offers its own mode only (its runs are tagged with it; a run of another
    mode is refused when it starts: ``flows.begin.deployment_config``)."""
    import copy

    schema = deployment._parameter_openapi_schema
    schema.definitions = copy.deepcopy(schema.definitions)
    properties = schema.definitions["RunConfig"]["properties"]
    union = properties["mode"]
    variant = copy.deepcopy(schema.definitions[MODE_TABLES[mode].__name__])  # the mode's own table, inline
    variant["properties"]["type"].update({"enum": [mode], "readOnly": True})
    description = f"{variant.get('description', '')} This deployment trains in {mode} mode only.".strip()
    properties["mode"] = {**variant, "position": union.get("position"), "title": union.get("title", "Mode"),
                          "description": description}


def absolute_paths(cfg: RunConfig, cwd: Path) -> RunConfig:
    """``cfg`` with its relative local paths (model folder and cache, storage root, dataset files)
    resolved against ``cwd``, the folder ``miles serve`` runs in: a run its deployments start finds
    the same files whatever folder the process that runs it is in."""
    from miles_core.config import dataset_tables

    raw = cfg.model_dump()

    from miles_core.models import BUILTIN_MODELS

    def fix(table: dict[str, Any], key: str) -> None:
        value = table.get(key)
        if isinstance(value, str) and value and "://" not in value and not Path(value).is_absolute():
            table[key] = str(cwd / value)

    if raw["model"]["path"].removeprefix("builtin:") not in BUILTIN_MODELS:  # a model by name is not a path
        fix(raw["model"], "path")
    fix(raw["model"], "cache_dir")
    fix(raw["storage"], "root")
    for table in dataset_tables(raw):
        if table.get("type") == "file":
            fix(table, "path")
    return RunConfig.model_validate(raw)


def device_pools(specs: list[str]) -> dict[str, int]:
    """``["gpu=8", ...]`` -> ``{"gpu": 8}``; errors name the bad entry."""
    pools = {}
    for spec in specs:
        name, sep, count = spec.partition("=")
        if not sep or not name.strip() or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"--device-slots {spec!r}: expected POOL=N with N >= 1, e.g. gpu=8")
        pools[name.strip()] = int(count)
    return pools


def ensure_device_pools(pools: dict[str, int]) -> None:
    """Create each global concurrency limit, or set its limit, on the configured Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        for name, limit in pools.items():
            try:
                client.read_global_concurrency_limit_by_name(name)
                client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=limit, active=True))
            except ObjectNotFound:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit, active=True))


def serve(cfg: RunConfig, args: argparse.Namespace) -> None:
    from prefect import serve as prefect_serve

    pools = device_pools(args.device_slots)
    found = deployments(cfg, args.eval_runs, args.eval_cron, args.eval_every_s)
    ensure_device_pools(pools)
    if pools:
        print("device slots: " + ", ".join(f"{n}={k}" for n, k in pools.items()), flush=True)
    print("serving: " + ", ".join(f"{d.flow_name}/{d.name}" for d in found), flush=True)
    prefect_serve(*found, print_starting_message=False)
