"""Pictures of a run, for people: the training reward and the held-out accuracy as curves (PNG).

- ``curves_png(reward, accuracy, title)``: two panels, each a line per named series of
  ``(step, value)`` points (``panels_png``: any panels).
- ``run_curves(metrics_rows, eval_rows, title)``: a run's, from its ``metrics.jsonl`` rows (the mean
  reward of each step's rollout) and ``eval.jsonl`` rows (the held-out accuracy; with named eval
  datasets, a line per dataset).
- ``data_url(png)``: the image as a ``data:`` URL, which a Prefect image artifact shows in the UI
  without any file server (the run folder may be on S3 or on another machine).
- ``summary_markdown(name, summary, curves)``: a finished run's summary, as its markdown artifact
  shows it; ``artifact_key(...)``: a Prefect artifact key from a run's name, id, ...
"""

from __future__ import annotations

import base64
import io
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

Series = Mapping[str, Sequence[tuple[float, float]]]


def curves_png(reward: Series, accuracy: Series, title: str) -> bytes:
    return panels_png([("training reward (mean)", reward), ("held-out accuracy", accuracy)], title, "step")


def panels_png(panels: Sequence[tuple[str, Series]], title: str, xlabel: str) -> bytes:
    """Side-by-side panels, each a line per named series of ``(x, y)`` points."""
    from matplotlib.figure import Figure  # a bare Figure draws without pyplot or a display

    fig = Figure(figsize=(4.5 * len(panels), 3.2), dpi=90, layout="constrained")
    fig.suptitle(title, fontsize=11)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (label, series) in zip(axes, panels):
        for name, points in series.items():
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(points) < 30 else None, markersize=3, label=name)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=8)
        if not any(series.values()):
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def accuracy_series(eval_rows: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Held-out accuracy per step: one series per named eval dataset (``<name>/accuracy`` keys), or
    the run's ``accuracy`` when it has none."""
    names = sorted({k.rsplit("/", 1)[0] for r in eval_rows for k in r if k.endswith("/accuracy")})
    keys = {name: f"{name}/accuracy" for name in names} or {"accuracy": "accuracy"}
    return {name: [(r["step"], r[key]) for r in eval_rows if r.get(key) is not None] for name, key in keys.items()}


def reward_points(metrics_rows: Sequence[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """The mean reward of each step's training batch."""
    return [(r["step"], r["reward_mean"]) for r in metrics_rows if r.get("reward_mean") is not None]


def run_curves(metrics_rows: Sequence[Mapping[str, Any]], eval_rows: Sequence[Mapping[str, Any]], title: str) -> bytes:
    return curves_png({"reward": reward_points(metrics_rows)}, accuracy_series(eval_rows), title)


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes) from a run's name, id, ...:
    ``artifact_key("Toy_Addition", "20261204-101502-ab12", "metrics")`` ->
    ``toy-addition-20261204-101502-ab12-metrics``."""
    return "-".join(re.sub(r"[^a-z0-9]+", "-", part.lower()).strip("-") for part in parts if part)


def summary_markdown(name: str, summary: Mapping[str, Any], curves: str) -> str:
    """Run ``name``'s summary (``RunSession.summary`` with its ``audit``) in markdown: held-out
    accuracy before and after, and links to its folder, metrics, curves, samples and weights."""
    from miles_core.audit import audit_line

    before, after = summary["accuracy_before"], summary["accuracy_after"]
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    return "\n".join([
        f"# Run `{summary['run_id']}` ({name})",
        "",
        "| held-out accuracy | value |", "|---|---|",
        f"| before training | {fmt(before)} |", f"| after {summary['steps']} steps | {fmt(after)} |",
        "",
        f"- run folder: {_link(summary['run_dir'])}",
        f"- metrics: {_link(summary['metrics'])}, evaluations: {_link(summary['eval'])}, curves: {_link(curves)}",
        f"- samples: {_link(summary['samples'])}",
        f"- weights: {_link(summary['weights'])} (latest version {summary['final_version']})",
        f"- wall time: {summary['seconds']} s",
        f"- prompt ledger (`miles audit`): {audit_line(summary['audit'])}",
    ])


def _link(url: str) -> str:
    """A markdown link to a run file: ``file://`` for a local folder, the URL itself otherwise."""
    href = url if "://" in url else "file://" + os.path.abspath(url)
    return f"[{url}]({href})"
