"""Helpers for tests that serve deployments: ``wait_for`` polls a condition; ``served(argv, api_url)``
runs a serving process (``flow.serve`` or ``miles serve``) against a Prefect API, stops it after,
and prints the tail of its output (which is where a served run's errors are); ``task_run_names``
reads a flow run's task runs once the server has recorded the ones a test expects."""

from __future__ import annotations

import collections
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any
from pathlib import Path

from waiting import wait_for  # noqa: F401 (tests import it from here)

REPO = Path(__file__).resolve().parents[2]


def task_run_names(flow_run_id, expected: set[str], timeout: float = 30) -> list[str]:
    """The names of a flow run's task runs, once all of ``expected`` are among them. The server
    records task runs from events in batches (flows/prefect_defaults.py), so the last ones of a
    run appear up to a flush interval after the flow's own state does."""
    return list(task_runs(flow_run_id, expected, timeout))


def task_runs(flow_run_id, expected: set[str], timeout: float = 30) -> dict[str, Any]:
    """A flow run's task runs by name (as ``task_run_names`` waits for them)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read() -> dict[str, Any]:
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            return {t.name: t for t in runs}

    found: dict[str, Any] = {}

    def recorded() -> bool:
        found.clear()
        found.update(asyncio.run(read()))
        return expected <= set(found)

    wait_for(recorded, timeout, f"task runs {sorted(expected - set(found))} of flow run {flow_run_id}")
    return found


def task_graph(runs: dict[str, Any]) -> dict[str, set[str]]:
    """Each task run's upstream task runs by name (its task inputs, ``wait_for`` included): the
    edges of the flow run's graph in the UI."""
    names = {t.id: name for name, t in runs.items()}
    return {name: {names[i.id] for inputs in t.task_inputs.values() for i in inputs if getattr(i, "id", None) in names}
            for name, t in runs.items()}


@contextlib.contextmanager
def served(argv: list[str], api_url: str, tail: int = 40, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """``python <argv>`` from the repository root against ``api_url`` (its runner, or worker, polling
    every second), with ``env`` added to this process's environment. Its output is read as it comes:
    ``recent_output(proc)`` is its last lines so far (for a failure message mid-test)."""
    env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_RUNNER_POLL_FREQUENCY": "1",
           "PREFECT_WORKER_QUERY_SECONDS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.Popen([sys.executable, *argv], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: collections.deque[str] = collections.deque(maxlen=max(tail, 200))
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in proc.stdout),
                              name="served-output", daemon=True)
    reader.start()
    proc.recent_lines = lines
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
        print(f"--- served process output (last {tail} lines) ---")
        print("\n".join(list(lines)[-tail:]))


def recent_output(proc: subprocess.Popen, lines: int = 60) -> str:
    """The last ``lines`` lines a ``served`` process has written so far."""
    return "\n".join(list(proc.recent_lines)[-lines:])
