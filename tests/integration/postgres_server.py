"""A real Prefect server on PostgreSQL for tests: ``postgres_prefect_server(tmp_dir)`` yields its API URL.

It runs ``deployments.server.LocalServer`` (what ``miles server start`` runs) in a fresh home and
stops it on exit, leaving no process behind. A start takes ~7-10 s (initdb, postgres, Prefect's
migrations), so wrap it in one session-scoped fixture::

    @pytest.fixture(scope="session")
    def postgres_backend():
        settings = {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}
        with postgres_prefect_server() as api_url, temporary_settings({PREFECT_API_URL: api_url, **settings}):
            yield api_url
            APILogWorker.drain_all(); EventsWorker.drain_all()  # task-run states travel as events

The home is made under ``tmp_dir`` (default: the system temp folder). When tests run as root,
postgres runs as ``nobody``, which must be able to traverse that folder: pytest's ``tmp_path``
lives under ``/tmp/pytest-of-root`` (mode 0700), which it cannot, hence the default.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from deployments.server import LocalServer, ServerError
from miles_core import processes


@contextlib.contextmanager
def postgres_prefect_server(tmp_dir: str | Path | None = None, *, keep: bool = False) -> Iterator[str]:
    """Start a Prefect server on Postgres in a new home under ``tmp_dir``; yield its API URL; stop it
    and (unless ``keep``) delete the home."""
    for attempt in (1, 2):
        home = Path(tempfile.mkdtemp(prefix="miles-prefect-server-", dir=tmp_dir))
        home.chmod(0o755)  # mkdtemp makes it 0700; the postgres user must get through it
        server = LocalServer(home, log=lambda _msg: None)
        try:
            status = server.start(port=processes.free_port())
        except ServerError as e:
            # once in CI the Prefect server exited at start with an empty log (not reproduced in 8
            # starts under load): say so, and start a fresh one once
            server.stop()
            if not keep:
                shutil.rmtree(home, ignore_errors=True)
            if attempt == 2:
                raise
            print(f"the test's Prefect server did not start, starting another: {e}")
            continue
        try:
            yield status.api_url
        finally:
            server.stop()
            if not keep:
                shutil.rmtree(home, ignore_errors=True)
        return


def _fresh_workers() -> None:
    """Send what Prefect's event and log workers hold, then drop them: each process keeps one of
    each, bound to the API URL it first saw, so after switching servers task-run states (which
    travel as events) would go on to the old one."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all()
    EventsWorker.drain_all()
    for worker in (EventsWorker, APILogWorker):
        worker._instances.clear()


@contextlib.contextmanager
def prefect_api(api_url: str) -> Iterator[str]:
    """Point this process at ``api_url`` for the block (settings and fresh event/log workers), then
    back (fresh workers again, for whatever server the process uses next)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    _fresh_workers()
    try:
        with temporary_settings({PREFECT_API_URL: api_url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield api_url
            _fresh_workers()
    finally:
        _fresh_workers()
