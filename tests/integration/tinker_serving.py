"""``miles tinker-serve`` as a user starts it, for the Tinker tests (``tinker_serve``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
KEY = "tml-test-key"


@contextmanager
def tinker_serve(storage: Path, port: int = 0, key: str = KEY, prefect_api: str | None = None,
                 args: tuple[str, ...] = (), ready_s: float = 120) -> Iterator[tuple[str, subprocess.Popen]]:
    """The service as a user starts it (``miles tinker-serve``, with ``args`` more); its URL once it
    says it is ready. With ``prefect_api``, its training clients are flow runs there; without, it has
    no Prefect API."""
    from miles_core import processes

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"MILES_TINKER_API_KEY": key, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    if prefect_api:
        env["PREFECT_API_URL"] = prefect_api
    log = open(storage.parent / f"serve-{storage.name}.log", "a")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "deployments.cli", "tinker-serve", "--base-model", "tiny-addition",
                             "--storage", str(storage), "--port", str(port),
                             "--prefect" if prefect_api else "--no-prefect", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=log, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        ready = wait_for(lambda: next((ln for ln in lines if "ready on" in ln), None) or proc.poll() is not None,
                         ready_s, "the tinker service's ready line")
        assert proc.poll() is None, f"miles tinker-serve exited {proc.returncode}: {_tail(log.name)}"
        yield ready.split("ready on ", 1)[1].split()[0], proc
    finally:
        if proc.poll() is None:
            processes.terminate(proc)
        log.close()


def _tail(path: str) -> str:
    return Path(path).read_text()[-3000:]


