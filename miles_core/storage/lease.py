"""One trainer per run: ``lease.json`` in the run folder, held by the process that trains the run.

``RunLease(layout, owner).acquire()`` takes the lease before the run writes anything (its
``config.json`` included) and renews it every ``ttl_s / 4`` seconds on a daemon thread; ``release()``
gives it back when the run ends. A second trainer of the same run id is refused with
``RunBusy``, naming the holder (host, pid, flow run) and when it last renewed. A lease is taken
over when it expired (not renewed for ``ttl_s``: its holder died or lost storage) or when its
holder is a process of this host that no longer trains: gone, a zombie not yet reaped, or a later
process that reuses its pid (``miles_core.processes``). So a run killed with SIGKILL resumes at once.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from typing import Any

from miles_core import processes

LEASE_FILE = "lease.json"


class RunBusy(RuntimeError):
    """Another trainer holds the run's lease."""


class RunLease:
    def __init__(self, layout, owner: dict[str, Any] | None = None, ttl_s: float = 60.0,
                 clock=time.time) -> None:
        self.layout, self.ttl_s, self.clock = layout, ttl_s, clock
        self.token = uuid.uuid4().hex
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(), "process": processes.identity(),
                      **(owner or {})}
        self._stop = threading.Event()
        self.lost: str | None = None
        """Why the lease was lost while held (taken over after it expired), or None."""

    def acquire(self) -> RunLease:
        held = self.layout.read_json(LEASE_FILE)
        if held is not None and held.get("token") != self.token:
            why_free = self._free(held)
            if why_free is None:
                raise RunBusy(self._busy_message(held))
        self._write()
        threading.Thread(target=self._renew, name="run-lease", daemon=True).start()
        return self

    def release(self) -> None:
        self._stop.set()
        held = self.layout.read_json(LEASE_FILE)
        if held is not None and held.get("token") == self.token:
            self.layout.remove(LEASE_FILE)

    def _write(self) -> None:
        self.layout.write_json(LEASE_FILE, {**self.owner, "token": self.token, "renewed_at": self.clock(),
                                            "ttl_s": self.ttl_s})

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                held = self.layout.read_json(LEASE_FILE)
                if held is not None and held.get("token") != self.token:
                    self.lost = f"taken over by {_who(held)}"
                    return
                self._write()
            except Exception:  # noqa: BLE001 (storage trouble: the next renewal tries again)
                continue

    def _free(self, held: dict[str, Any]) -> str | None:
        """Why ``held`` can be taken over (None: it is alive)."""
        age = self.clock() - float(held.get("renewed_at", 0))
        if age > float(held.get("ttl_s", self.ttl_s)):
            return f"expired {age:.0f} s after its last renewal"
        if held.get("host") == socket.gethostname():
            pid = int(held.get("pid", -1))
            if pid == os.getpid() and held.get("process") in (None, processes.identity()):
                return "it is this process's (a run begun again here)"
            if not processes.alive(pid, held.get("process")):
                return f"its process {pid} is gone"
        return None

    def _busy_message(self, held: dict[str, Any]) -> str:
        age = self.clock() - float(held.get("renewed_at", 0))
        run = self.layout.run_dir
        return (f"run {self.layout.run_id} ({run}) is being trained by {_who(held)} (its lease, {run}/{LEASE_FILE}, "
                f"was renewed {age:.0f} s ago); wait for that run to end, or use a new run id. A lease not renewed "
                f"for {float(held.get('ttl_s', self.ttl_s)):.0f} s is taken over.")


def _who(held: dict[str, Any]) -> str:
    who = f"pid {held.get('pid')} on {held.get('host')}"
    if held.get("flow_run_id"):
        who += f" (flow run {held['flow_run_id']})"
    return who

