"""The ``miles`` command: parses flags into a ``RunConfig`` (``miles_core.cli``) and runs a command.

Heavy imports (prefect, torch) happen only inside the command that needs them, so ``miles --help``
and ``miles show-config`` answer at once. ``miles engine-serve`` takes its own flags (not a run
config): it serves a model folder under SGLang's HTTP API (``miles_core.engines.server``); so does
``miles tinker-serve``, the Tinker API over LoRA adapters (``miles_core.tinker.server``).
``miles audit RUN`` prints what became of every prompt of a run (``miles_core.ledger``);
``miles evaluate RUN`` evaluates a run's newest (or a given) version (``flows/evaluate.py``).
``miles server start|stop|status`` runs a local Prefect server on PostgreSQL (``deployments/server.py``)
for concurrent runs and the UI; single runs keep Prefect's ephemeral default.

``miles train`` runs the run in a child process of its own session (``miles_core.stopping``): the
first Ctrl-C or SIGTERM stops it after the step in progress (with a checkpoint when it has
``--save-interval``, and the command that resumes it), a second one at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from deployments import serve as serve_deployments
from deployments import server as prefect_server
from miles_core import stopping
from miles_core.cli import build_parser, resolve_config
from miles_core.engines import server as engine_server
from miles_core.models import tiny_model_threads
from miles_core.storage.lease import RunBusy
from miles_core.tinker import server as tinker_server


def _quiet_defaults(verbose: bool = False) -> None:
    """No hub; and unless ``--verbose``, no progress bars, deprecation notices or banners from the
    libraries (``miles_core.quiet``), here and in every child process. Values the user set stay.
    (Prefect's settings for runs, telemetry off among them, were applied when ``deployments`` was
    imported: ``flows/prefect_defaults.py``.)"""
    from miles_core.quiet import quiet_environment

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local folders; never reach for a hub
    if not verbose:
        quiet_environment()


def cli_parser() -> argparse.ArgumentParser:
    """The run-config commands of ``miles_core.cli`` plus ``engine-serve``."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = "serve a model folder under SGLang's HTTP API (transformers engine, CPU)"
    engine_server.add_arguments(sub.add_parser("engine-serve", help=text, description=text, allow_abbrev=False))
    text = "serve the Tinker API: the tinker SDK and tinker-cookbook train LoRA adapters here (docs/tinker.md)"
    tinker_server.add_arguments(sub.add_parser("tinker-serve", help=text, description=text, allow_abbrev=False))
    text = "a local Prefect server on PostgreSQL (start | stop | status), for concurrent runs and the UI"
    prefect_server.add_arguments(sub.add_parser("server", help=text, description=text, allow_abbrev=False))
    serve_deployments.add_arguments(sub.choices["serve"])
    text = "audit a run's prompt ledger: what became of every prompt; exits 1 if any was lost or trained twice"
    audit = sub.add_parser("audit", help=text, description=text, allow_abbrev=False)
    audit.add_argument("run_dir", metavar="RUN", help="the run's folder (a path, or a URL such as s3://bucket/runs/NAME/ID)")
    audit.add_argument("--json", action="store_true", help="print the audit as JSON")
    audit.add_argument("--storage-options", type=json.loads, default=None, metavar="JSON",
                       help="fsspec storage options for the run's URL, as JSON (e.g. an S3 endpoint)")
    text = "evaluate a run's newest (or a given) version on its held-out data, or on other datasets"
    ev = sub.add_parser("evaluate", help=text, description=text, allow_abbrev=False)
    ev.add_argument("run_dir", metavar="RUN", help="a run's folder, or <storage root>/<name> for that name's newest run")
    ev.add_argument("--version", type=int, default=None, help="the weight version (default: the newest)")
    ev.add_argument("--eval-prompt-data", nargs="+", default=None, metavar="NAME PATH",
                    help="evaluate on these files instead of the run's held-out data: NAME PATH [NAME PATH ...], "
                         "read with the run's data keys")
    ev.add_argument("--eval-input-key", default=None, help="the prompt key of those files (default: the run's)")
    ev.add_argument("--eval-label-key", default=None, help="the label key of those files (default: the run's)")
    ev.add_argument("--storage-options", type=json.loads, default=None, metavar="JSON",
                    help="fsspec storage options for the run's URL, as JSON (e.g. an S3 endpoint)")
    ev.add_argument("--verbose", action="store_true", help="show the libraries' progress bars and warnings")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = cli_parser().parse_args(argv)
    if args.command == "engine-serve":
        _quiet_defaults()
        return engine_server.run(args)
    if args.command == "tinker-serve":
        _quiet_defaults()
        return tinker_server.run(args)
    if args.command == "server":
        return prefect_server.run(args)
    if args.command == "audit":
        return _audit(args)
    if args.command == "evaluate":
        _quiet_defaults(args.verbose)
        return _evaluate(args)
    if args.command == "config-doc":
        from miles_core.config_doc import config_markdown

        print(config_markdown(), end="")
        return 0
    if args.command == "flags-doc":
        from miles_core.miles_flags import flags_markdown

        print(flags_markdown(), end="")
        return 0
    try:
        cfg = resolve_config(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.command == "show-config":
        print(json.dumps(cfg.public_dict(), indent=2))
        return 0
    _quiet_defaults(getattr(args, "verbose", False))
    tiny_model_threads(cfg.model.path)  # before torch is imported, here and in every process the run starts
    if args.command == "build-model":
        from miles_core.models import ensure_model

        try:
            print(ensure_model(cfg.model, shipped=not args.no_shipped))
        except (ValueError, FileNotFoundError) as e:  # ModelUnavailable is a ValueError
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "serve":
        try:
            serve_deployments.serve(cfg, args)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command in ("train", "train-multi-lora"):
        if not os.environ.get(stopping.SUPERVISED):  # Ctrl-C reaches only the supervisor, which stops the run cleanly
            return stopping.supervise(sys.argv[1:] if argv is None else list(argv))
        stopping.install_stop_handlers()
        stopping.follow_supervisor()
        try:
            _preflight(cfg)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        try:
            return _train(args.command, cfg)
        except RunBusy as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except stopping.RunStopped as e:
            print(f"\n{e}", file=sys.stderr)
            if e.checkpoint_step is not None:
                again = _without_run_id(sys.argv[1:] if argv is None else list(argv))
                print(f"resume it with: miles {' '.join(again)} --run-id {e.run_id}", file=sys.stderr)
            return 130
    return 0


def _audit(args: argparse.Namespace) -> int:
    from miles_core.audit import audit, format_audit

    try:
        result = audit(args.run_dir, args.storage_options)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: cannot audit {args.run_dir}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json(), indent=2) if args.json else format_audit(result))
    return 0 if result.ok else 1


def _evaluate(args: argparse.Namespace) -> int:
    """``miles evaluate RUN``: the evaluate-run flow here (Prefect's ephemeral API unless one is set);
    its rows as a table."""
    from miles_core.eval.standalone import file_datasets, resolve_run_dir

    options = args.storage_options or {}
    try:
        run_dir = resolve_run_dir(args.run_dir, options)
        datasets = None if args.eval_prompt_data is None else file_datasets(
            run_dir, args.eval_prompt_data, options, input_key=args.eval_input_key, label_key=args.eval_label_key)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: cannot evaluate {args.run_dir}: {e}", file=sys.stderr)
        return 2
    from flows.evaluate import evaluate_run

    state = evaluate_run(run_dir, args.version, options, datasets, return_state=True)
    if not state.is_completed():
        print(f"error: the evaluation of {run_dir} {state.name.lower()}: {state.message}", file=sys.stderr)
        return 1
    rows = state.result()
    print(format_eval_rows(run_dir, rows))
    return 0


def format_eval_rows(run_dir: str, rows: list[dict]) -> str:
    named = sorted({k for r in rows for k in r if k.endswith("/accuracy")})
    head = ["adapter", "version", "step", "accuracy", *named]
    lines = ["", f"  {run_dir}", "  " + "  ".join(f"{h:>10}" for h in head)]
    for r in rows:
        cells = [r.get("adapter") or "-", r["version"], "-" if r.get("step") is None else r["step"], r["accuracy"],
                 *(r.get(k) for k in named)]
        lines.append("  " + "  ".join(f"{c:>10.3f}" if isinstance(c, float) else f"{c!s:>10}" for c in cells))
    return "\n".join(lines)


def _without_run_id(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--run-id":
            skip = True
        elif not a.startswith("--run-id="):
            out.append(a)
    return out


def _preflight(cfg) -> None:
    """What must hold before any flow starts, so that it fails as one line on stderr, not a traceback
    in a task's log: the held-out datasets resolve (a file dataset needs held-out prompts), and the
    starting model is found (built, imported once)."""
    from miles_core.models import ensure_model

    cfg.eval.resolved(cfg.data, cfg.rollout)
    ensure_model(cfg.model, log=lambda line: print(line, file=sys.stderr))


def _train(command: str, cfg) -> int:
    if command == "train-multi-lora" or cfg.multi_lora is not None:  # Miles' train --lora-count N too
        if cfg.multi_lora is None:
            print("error: train-multi-lora needs adapters: --lora-count N (with --lora-rank R), or a [multi_lora] "
                  "section with adapters", file=sys.stderr)
            return 2
        from flows.multi_lora import train_multi_lora

        print(format_multi_lora_summary(train_multi_lora(cfg)))
        return 0
    from flows.train import train

    summary = train(cfg)
    print(format_summary(summary))
    return 0


def format_multi_lora_summary(summary: dict) -> str:
    from miles_core.multi_lora import accuracy_table

    return "\n".join([
        "",
        "held-out accuracy per adapter (step 0: the base model)",
        accuracy_table(summary),
        "",
        f"failed adapters  {', '.join(summary['failed_adapters']) or 'none'}",
        f"run folder       {summary['run_dir']}  (adapters under adapters/<name>/, report in adapters.md)",
        f"wall time        {summary['seconds']} s",
    ])


def format_summary(summary: dict) -> str:
    fmt = lambda x: "  n/a" if x is None else f"{x:.3f}"  # noqa: E731
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    delta = "" if before is None or after is None else f"  ({after - before:+.3f})"
    return "\n".join([
        "",
        "  held-out accuracy            ",
        "  ---------------------------  -----",
        f"  starting policy              {fmt(before)}",
        f"  after {summary['steps']:>3} GRPO steps        {fmt(after)}{delta}",
        "",
        f"  run folder  {summary['run_dir']}",
        f"  metrics     {summary['metrics']}",
        f"  evals       {summary['eval']}",
        f"  samples     {summary['samples']}  (Arrow IPC segments)",
        f"  weights     {summary['weights']}  (latest v{summary['final_version']})",
        f"  wall time   {summary['seconds']} s",
    ])


if __name__ == "__main__":
    sys.exit(main())
