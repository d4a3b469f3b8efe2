"""The child processes this project starts: waiting until one is ready, saying how one ended,
stopping one or its process group, and liveness that survives zombies and recycled pids.

Every HTTP server the project starts (the engine server, vLLM under its watchdog, the Prefect
server, moto's S3 endpoint) is waited for with ``wait_ready``: a probe until it answers, an error
naming the server and its last output when it exits first or misses its deadline. (PostgreSQL is
waited for by ``pg_ctl -w``, trainer ranks by their connections: ``train/launch.py``.) ``ended`` and
``exit_text`` say how a child ended, in the same words wherever it is reported; ``terminate`` stops
a process, ``stop_group`` the group a server leads (SIGKILLed whole if the leader outlives its grace).

``os.kill(pid, 0)`` answers "some process has this pid", which is not "the process that wrote this
record still runs": a process killed with SIGKILL stays a zombie (and answers) until its parent or
init reaps it, and the kernel hands its pid to a new process later. ``identity(pid)`` names one
process for the life of the machine (the boot it runs in and its start time in clock ticks);
``alive(pid, identity)`` is true only while that very process runs and is not a zombie.

Linux reads ``/proc``; elsewhere there is no start time to compare, and ``alive`` falls back to
``kill(pid, 0)``. Standard library only: the watchdog imports it under vLLM's Python.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

_PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first); None if no such process."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()  # the name may hold spaces and parentheses


def _boot_id() -> str:
    try:
        return (_PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def identity(pid: int | None = None) -> str | None:
    """``"BOOT:START"`` for process ``pid`` (this one by default): equal for the same process, different
    for any later process that reuses the pid. None where ``/proc`` is missing or the process is gone."""
    fields = _stat_fields(os.getpid() if pid is None else pid)
    if fields is None or len(fields) < 20:
        return None
    return f"{_boot_id()}:{fields[19]}"  # field 22 of stat (starttime), counting pid and name


def orphaned(parent_pid: int) -> bool:
    """Whether ``parent_pid`` is no longer this process's parent: it died (even by SIGKILL, which
    closes no pipe a child would notice in time) and this process was handed to another."""
    return os.getppid() != parent_pid


def when_orphaned(parent_pid: int, action: Callable[[], None], poll_s: float = 0.5,
                  name: str = "parent-watch") -> None:
    """Call ``action`` on a daemon thread once ``orphaned(parent_pid)`` (checked every ``poll_s``
    between bytecodes: a C loop holding the interpreter lock delays it until it lets go)."""
    def watch() -> None:
        while not orphaned(parent_pid):
            time.sleep(poll_s)
        action()

    threading.Thread(target=watch, name=name, daemon=True).start()


def die_with_parent() -> None:
    """Linux: the kernel sends this process SIGKILL when the thread that started it dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """The pids of ``pid``'s children, their children, and so on (Linux, from ``/proc``; elsewhere none)."""
    if not _PROC.is_dir():
        return []
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and len(fields) > 1:
                children.setdefault(int(fields[1]), []).append(int(entry.name))  # after the state: the parent
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every process under it, and reap ``proc``. For a hung process: what it
    started (an engine server) would watch for its parent's death, but cannot if it hangs too."""
    found = [(pid, identity(pid)) for pid in descendants(proc.pid)]  # before the kill: then init is their parent
    for pid, known_as in found:
        if known_as is not None and alive(pid, known_as):  # not a later process given a pid that ended
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.kill()
    proc.wait(10)


def http_status(url: str, body: dict | None = None, timeout: float = 5) -> int | None:
    """Status of a GET (or a JSON POST when ``body`` is given) to ``url``, as a readiness probe of a
    server we started; None when nothing answers."""
    import json
    import urllib.error
    import urllib.request  # ~30 ms: not on the `miles --help` path

    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):  # URLError is an OSError; ValueError: not a URL
        return None


def terminate(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM ``proc`` if it runs, SIGKILL it if it has not ended within ``grace_s``; reaps it."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group that ``pid`` leads (started with ``start_new_session``),
    if it still exists."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(pid: int, grace_s: float, sig: int = signal.SIGTERM,
               gone: Callable[[], bool] | None = None) -> bool:
    """Signal the group that ``pid`` leads with ``sig``, and SIGKILL the group if its leader has not
    ended within ``grace_s``; True once the leader is gone (within 5 s of the kill). ``gone`` says
    whether the leader has ended (default: ``not alive(pid)``; a parent passes its child's own
    ``poll``, which also reaps it)."""
    gone = gone or (lambda: not alive(pid))
    for signum, wait_s in ((sig, grace_s), (signal.SIGKILL, 5.0)):
        signal_group(pid, signum)
        if wait_until(gone, wait_s):
            return True
    return False


def wait_until(condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    """Whether ``condition()`` turned true within ``timeout_s`` (checked every ``poll_s``)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def exit_text(code: int) -> str:
    """``"exited with code 1"`` or ``"was killed by signal SIGKILL"`` for a ``returncode``."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by signal {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def ended(proc: subprocess.Popen) -> str | None:
    """How ``proc`` ended (``exit_text``), reaping it; None while it runs."""
    code = proc.poll()
    return None if code is None else exit_text(code)


def wait_ready(ready: Callable[[], bool], *, what: str, probe: str, timeout_s: float,
               ended: Callable[[], str | None], tail: Callable[[], str], setting: str = "",
               poll_s: float = 0.1) -> None:
    """Wait until ``ready()`` (a probe of ``probe``: a URL, or what stands for one) is true for a
    server this process started.
    Raises RuntimeError as soon as ``ended()`` says how its process ended, and TimeoutError after
    ``timeout_s`` (``setting``: where that deadline is set); both name ``what`` and end with
    ``tail()`` (its last output, or where its log is)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        how = ended()
        if how is not None:
            raise RuntimeError(f"{what} {how}; {tail()}")
        if time.monotonic() > deadline:
            where = f" ({setting})" if setting else ""
            raise TimeoutError(f"{what} did not answer {probe} within {timeout_s:g} s{where}; {tail()}")
        time.sleep(poll_s)


def package_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (this process's by default) with this package's root first on ``PYTHONPATH``: a
    child started with ``python -m miles_core...`` imports the same code from any directory,
    installed or not."""
    env = dict(os.environ if env is None else env)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def alive(pid: int, known_as: str | None = None) -> bool:
    """Whether process ``pid`` runs and is not a zombie; with ``known_as`` (an ``identity``), also
    whether it is still that process and not a later one with the same pid."""
    if pid <= 0:
        return False
    if _PROC.is_dir():
        fields = _stat_fields(pid)
        if fields is None or fields[0] in ("Z", "X"):
            return False
        return known_as is None or identity(pid) == known_as
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
