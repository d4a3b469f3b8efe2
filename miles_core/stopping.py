"""Clean stops of ``miles train`` on Ctrl-C or SIGTERM: the run ends after the step in progress.

- ``supervise(argv)``: ``miles train`` runs the run itself as a child process in a session of its
  own (``python -m deployments.cli ...``), so a terminal's Ctrl-C reaches only this small parent,
  not the Prefect server, engine servers or producers the run started. The first SIGINT or SIGTERM
  is passed on to the run (as SIGINT: a flow run's SIGTERM belongs to Prefect), which stops cleanly; a second one kills the run's whole
  session at once. Returns the exit code (130 after SIGINT, 143 after SIGTERM).
- ``follow_supervisor()``: in the run's process, ends the run's session once that parent is gone
  (SIGKILL of the ``miles`` command or its process group included): a run never outlives its command.
- ``install_stop_handlers()``: in the run's process, SIGINT and SIGTERM ask for a stop instead of
  interrupting whatever runs (``stop_requested()`` turns true). Loops that can take long check it:
  the training flows between steps (``RunStopped``, after saving a checkpoint when the run has
  ``--save-interval``; the flow run ends Cancelled, ``cancelled(stop)``), the fully-async trainer while it waits for data, and the tiny model's warm
  start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from miles_core import processes

SUPERVISED = "MILES_SUPERVISED"
"""Set in the run's process by ``supervise`` to its own pid (the run does not supervise itself
again, and ``follow_supervisor`` watches that pid)."""
SUPERVISOR_CHECK_S = 0.5
"""How often the run's process looks whether its supervisor is still there."""

_STOP = threading.Event()


class RunStopped(RuntimeError):
    """The run stopped early because it was asked to (Ctrl-C, SIGTERM)."""

    def __init__(self, message: str, run_id: str | None = None, checkpoint_step: int | None = None) -> None:
        super().__init__(message)
        self.run_id, self.checkpoint_step = run_id, checkpoint_step


def cancelled(stop: RunStopped):
    """The Prefect state a flow that stopped as asked returns: Cancelled, with the stop's message
    (which says where its checkpoint is); calling the flow raises ``stop`` itself."""
    from prefect.states import Cancelled

    return Cancelled(message=str(stop), data=stop)


def stop_requested() -> bool:
    return _STOP.is_set()


def request_stop() -> None:
    _STOP.set()


def install_stop_handlers() -> None:
    """SIGINT and SIGTERM ask this process's run to stop after the step in progress (main thread only)."""

    supervised = bool(os.environ.get(SUPERVISED))  # the supervisor has said which signal it received

    def handler(signum, frame) -> None:
        if not _STOP.is_set() and not supervised:
            print(f"miles: {signal.Signals(signum).name}: stopping after the step in progress", file=sys.stderr,
                  flush=True)
        _STOP.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def follow_supervisor() -> None:
    """In a supervised run's process: once the ``miles`` command that supervises it is gone (killed,
    even with SIGKILL, or its terminal closed), end the run's whole session at once: nothing is left
    that a Ctrl-C could stop, and the run folder's lease is free for ``--run-id`` to resume it
    (from its last checkpoint). Processes the run started in sessions of their own (engine servers,
    producers) watch this process and end with it. Nothing to do in an unsupervised process (a
    deployment's flow run)."""
    supervisor = os.environ.pop(SUPERVISED, "")  # not for the processes this one starts
    if not supervisor.isdigit():
        return

    def stop_everything() -> None:
        try:
            print(f"miles: the miles command that ran this run (pid {supervisor}) is gone; stopping the run and "
                  "everything it started (resume it with --run-id)", file=sys.stderr, flush=True)
        except OSError:  # its terminal closed, or the pipe's reader died with it
            pass
        finally:
            os.killpg(os.getpgid(0), signal.SIGKILL)

    processes.when_orphaned(int(supervisor), stop_everything, SUPERVISOR_CHECK_S, name="follow-supervisor")


def supervise(argv: list[str], grace_s: float = 120.0) -> int:
    """Run ``python -m deployments.cli *argv`` in its own session, passing on the first Ctrl-C or
    SIGTERM and killing the session on the second (or when the run has not stopped ``grace_s``
    seconds after the first)."""
    env = {**os.environ, SUPERVISED: str(os.getpid())}
    child = subprocess.Popen([sys.executable, "-m", "deployments.cli", *argv], env=env, start_new_session=True)
    received: list[int] = []
    first_at: list[float] = []

    def handler(signum, frame) -> None:
        received.append(signum)
        if len(received) == 1:
            first_at.append(time.monotonic())
            print(f"miles: {signal.Signals(signum).name}: the run stops after the step in progress "
                  "(press Ctrl-C again to stop it at once)", file=sys.stderr, flush=True)
            _signal(child, signal.SIGINT)  # not SIGTERM: Prefect's flow engine takes that one over
        else:
            print("miles: stopping the run at once", file=sys.stderr, flush=True)
            _kill_session(child)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                code = child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            if first_at and time.monotonic() - first_at[0] > grace_s:
                print(f"miles: the run did not stop within {grace_s:.0f} s; stopping it at once", file=sys.stderr,
                      flush=True)
                _kill_session(child)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    _kill_session(child)  # whatever the run left behind in its session (it normally leaves nothing)
    if received:
        return 128 + received[0]
    return code


def _signal(child: subprocess.Popen, sig: int) -> None:
    try:
        child.send_signal(sig)
    except ProcessLookupError:
        pass


def _kill_session(child: subprocess.Popen) -> None:
    """SIGKILL every process of the run's session (its group: the run leads it)."""
    processes.signal_group(child.pid, signal.SIGKILL)
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
