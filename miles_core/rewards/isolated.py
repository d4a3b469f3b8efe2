"""Reward work in worker processes that can be abandoned: ``call(fn, *args, deadline_s)``.

Rewards run in threads, and a thread cannot be stopped: a symbolic comparison that takes minutes
(sympy on an answer with a degree sign took 80 s) would hold its thread, and anything it locks,
for as long. ``call`` runs ``fn(*args)`` in the main thread of a worker process instead, where
libraries' own signal-based time limits work (math-verify's), and kills the worker if it has not
answered ``deadline_s`` seconds after it started (``WorkerTimeout``; the next call starts a new
one). Only the calls that are running wait: up to ``MAX_WORKERS`` run side by side, each in its own
process, and a slow one costs only its own call.

Workers are new interpreters (``python -m miles_core.rewards.isolated``; not forked: this process
has threads, and a forked child could inherit a held lock), started on first use; they stay for
the next calls and are stopped when this process exits (a worker whose parent was killed ends
itself within a second). ``fn`` must be importable by name (a
module-level function); its arguments, result and exceptions are pickled.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

from miles_core import processes

MAX_WORKERS = max(2, min(4, os.cpu_count() or 2))
"""Worker processes at most (each ~70 MB with sympy); more calls than that wait for one."""
PRELOAD = ("math_verify",)
"""Modules a worker imports before it says it is ready (the math reward's)."""
STARTUP_TIMEOUT_S = 120.0
"""How long a new worker may take to import them (seconds of a busy machine)."""
PARENT_CHECK_S = 0.5
"""How often a worker looks whether the process that started it is still there."""


class WorkerTimeout(Exception):
    def __init__(self, what: str, deadline_s: float) -> None:
        super().__init__(f"{what} did not return within {deadline_s:g} s; its worker process was killed")


class WorkerDied(RuntimeError):
    pass


class _Worker:
    """One worker: ``python -m miles_core.rewards.isolated``, spoken to over its stdin and stdout."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", __name__, *PRELOAD], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, close_fds=True, env=processes.package_env())
        self.send = Connection(os.dup(self.process.stdin.fileno()), readable=False)
        self.recv = Connection(os.dup(self.process.stdout.fileno()), writable=False)
        self.process.stdin.close()
        self.process.stdout.close()
        self.mid_call = False
        """Whether a call was sent whose answer has not been read (``run``)."""
        # a call's deadline starts once the worker has imported what it needs, not with the interpreter
        if not self.recv.poll(STARTUP_TIMEOUT_S):
            self.kill()
            raise WorkerDied(f"a reward worker process did not start within {STARTUP_TIMEOUT_S:g} s")
        try:
            self.recv.recv()
        except (EOFError, OSError):
            self.kill()
            raise WorkerDied(f"a reward worker process exited on start (code {self.process.poll()})") from None

    def run(self, fn: Callable[..., Any], args: tuple, deadline_s: float) -> Any:
        """``fn(*args)`` in the worker; ``mid_call`` stays True unless its answer came back (then the
        worker can take the next call; else it is killed: an answer may still be on its way)."""
        what = f"{fn.__module__}.{fn.__qualname__}"
        self.mid_call = True
        try:
            self.send.send((fn, args))
            if not self.recv.poll(deadline_s):
                raise WorkerTimeout(what, deadline_s)
            ok, value = self.recv.recv()
        except (EOFError, OSError):
            raise WorkerDied(f"the reward worker process ended (exit code {self.process.poll()}) "
                             f"during {what}") from None
        self.mid_call = False
        if not ok:
            raise value
        return value

    def kill(self) -> None:
        self.process.kill()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:  # reaped later by the interpreter; the slot is free either way
            pass
        self.send.close()
        self.recv.close()


class _Pool:
    def __init__(self, size: int) -> None:
        self.size = size
        self.idle: list[_Worker] = []
        self.busy = 0
        self.cond = threading.Condition()

    def call(self, fn: Callable[..., Any], args: tuple, deadline_s: float) -> Any:
        worker = self._take()
        try:
            return worker.run(fn, args, deadline_s)
        finally:
            self._give_back(worker)

    def _take(self) -> _Worker:
        with self.cond:
            while not self.idle and self.busy >= self.size:
                self.cond.wait()
            self.busy += 1
            if self.idle:
                return self.idle.pop()
        try:
            return _Worker()
        except BaseException:
            with self.cond:
                self.busy -= 1
                self.cond.notify()
            raise

    def _give_back(self, worker: _Worker) -> None:
        """Back to the idle ones if its call's answer came back; else killed. Its slot is free either way."""
        try:
            if worker.mid_call:
                worker.kill()
        finally:
            with self.cond:
                self.busy -= 1
                if not worker.mid_call:
                    self.idle.append(worker)
                self.cond.notify()

    def close(self) -> None:
        with self.cond:
            idle, self.idle = self.idle, []
        for worker in idle:
            worker.kill()


_POOL = _Pool(MAX_WORKERS)
atexit.register(_POOL.close)


def call(fn: Callable[..., Any], *args: Any, deadline_s: float) -> Any:
    """``fn(*args)`` in a worker process's main thread; its exception is raised here. ``WorkerTimeout``
    if it has not returned ``deadline_s`` seconds after it started (the worker is killed)."""
    return _POOL.call(fn, args, deadline_s)


def _serve() -> None:
    """A worker's loop: run each call read from stdin, write back (True, result) or (False, exception).
    The protocol has stdout to itself: whatever the functions print goes to stderr."""
    recv = Connection(os.dup(0), writable=False)
    send = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    # killed with SIGKILL, the parent closes no pipe we would notice while a call runs: a worker
    # in the middle of a long call would otherwise go on alone
    processes.when_orphaned(os.getppid(), lambda: os._exit(1), PARENT_CHECK_S)
    import importlib

    for name in sys.argv[1:]:
        try:
            importlib.import_module(name)
        except ImportError:  # the call that needs it raises, naming it
            pass
    send.send("ready")
    while True:
        try:
            fn, args = recv.recv()
        except (EOFError, OSError):
            return
        try:
            reply = (True, fn(*args))
        except Exception as e:  # noqa: BLE001 (sent back to the caller)
            reply = (False, e)
        try:
            send.send(reply)
        except Exception as e:  # noqa: BLE001 (an unpicklable result or exception)
            send.send((False, RuntimeError(f"{type(e).__name__}: {e}")))


if __name__ == "__main__":
    _serve()
