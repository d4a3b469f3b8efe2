"""One trainer per run: ``lease.json`` in the run folder, held by the process that trains the run.

``RunLease(layout, owner).acquire()`` takes the lease before the run writes anything (its
``config.json`` included) and renews it every ``ttl_s / 4`` seconds on a daemon thread; ``release()``
gives it back when the run ends. Every write is a compare-and-swap on the lease file (S3
``If-Match``, an ``flock`` on local files): of two trainers that start together exactly one gets
the lease, and a renewal never overwrites a lease taken over meanwhile. A second trainer of the
same run id is refused with ``RunBusy``, naming the holder (host, pid, flow run) and when it last
renewed. A lease is taken over when it was released, when it expired (not renewed for ``ttl_s``:
its holder died or lost storage) or when its holder is a process of this host that no longer
trains: gone, a zombie not yet reaped, or a later process that reuses its pid
(``miles_core.processes``). So a run killed with SIGKILL resumes at once.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from typing import Any

from miles_core import processes
from miles_core.storage.fs import PreconditionFailed

LEASE_FILE = "lease.json"
_ATTEMPTS = 5


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
        for _ in range(_ATTEMPTS):
            held, tag = self.layout.read_json_tagged(LEASE_FILE)
            if held is not None and held.get("token") == self.token:
                break  # our own write, whose answer was lost
            if held is not None and self._free(held) is None:
                raise RunBusy(self._busy_message(held))
            if self._swap(self._record(), tag):
                break
        else:
            raise RunBusy(f"run {self.layout.run_id}: its lease ({self.layout.url(LEASE_FILE)}) changed "
                          f"{_ATTEMPTS} times while this trainer tried to take it; try again")
        threading.Thread(target=self._renew, name="run-lease", daemon=True).start()
        return self

    def release(self) -> None:
        """Mark the lease released (the file stays, so no later holder's lease is ever deleted)."""
        self._stop.set()
        for _ in range(_ATTEMPTS):
            held, tag = self.layout.read_json_tagged(LEASE_FILE)
            if held is None or held.get("token") != self.token or held.get("released_at"):
                return
            if self._swap({**held, "released_at": self.clock()}, tag):
                return

    def _record(self) -> dict[str, Any]:
        return {**self.owner, "token": self.token, "renewed_at": self.clock(), "ttl_s": self.ttl_s}

    def _swap(self, record: dict[str, Any], tag: str | None) -> bool:
        """Write ``record`` if the lease still has ``tag``; False when another writer was first."""
        try:
            self.layout.swap_json(LEASE_FILE, record, tag)
            return True
        except PreconditionFailed:
            return False

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                held, tag = self.layout.read_json_tagged(LEASE_FILE)
                if held is None or held.get("token") != self.token:
                    self.lost = f"taken over by {_who(held)}" if held else "its file was deleted"
                    return
                self._swap(self._record(), tag)  # lost to a writer: the next round reads who
            except Exception:  # noqa: BLE001 (storage trouble: the next renewal tries again)
                continue

    def _free(self, held: dict[str, Any]) -> str | None:
        """Why ``held`` can be taken over (None: it is alive)."""
        if held.get("released_at"):
            return "its holder released it"
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
