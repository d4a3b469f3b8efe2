"""One trainer per run: the run folder's lease (``miles_core.storage.lease``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from miles_core import processes
from miles_core.storage.layout import RunLayout
from miles_core.storage.lease import LEASE_FILE, RunBusy, RunLease


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def layout(tmp_path):
    return RunLayout(str(tmp_path / "runs"), "r", "run-1")


@pytest.fixture
def other_process():
    """A live process of this host that is not this one (the holder of a lease)."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield proc.pid
    proc.stdin.close()  # it ends when its stdin does
    proc.wait()


def _held_by(layout, pid: int, clock, host: str | None = None, flow_run_id: str | None = "fr-1",
             process: str | None = None) -> None:
    layout.write_json(LEASE_FILE, {"host": host or socket.gethostname(), "pid": pid, "flow_run_id": flow_run_id,
                                   "process": process or processes.identity(pid), "token": "theirs",
                                   "renewed_at": clock(), "ttl_s": 60.0})


def test_a_live_lease_refuses_a_second_trainer_naming_the_holder(layout, other_process):
    clock = Clock()
    _held_by(layout, other_process, clock)
    clock.now += 5
    with pytest.raises(RunBusy) as busy:
        RunLease(layout, clock=clock).acquire()
    text = str(busy.value)
    assert f"is being trained by pid {other_process} on {socket.gethostname()} (flow run fr-1)" in text
    assert "renewed 5 s ago" in text and "use a new run id" in text
    assert layout.read_json(LEASE_FILE)["token"] == "theirs", "the holder's lease is left as it was"


def test_a_lease_of_another_host_is_live_until_it_expires(layout):
    clock = Clock()
    _held_by(layout, 12345, clock, host="elsewhere")
    clock.now += 59
    with pytest.raises(RunBusy, match="pid 12345 on elsewhere"):
        RunLease(layout, clock=clock).acquire()
    clock.now += 2  # not renewed for 61 s > 60 s: its holder is gone or cut off
    lease = RunLease(layout, owner={"flow_run_id": "fr-2"}, clock=clock).acquire()
    try:
        held = layout.read_json(LEASE_FILE)
        assert held["token"] == lease.token and held["flow_run_id"] == "fr-2" and held["pid"] == os.getpid()
    finally:
        lease.release()
    assert layout.read_json(LEASE_FILE)["released_at"] == clock.now, "released, and free for the next trainer"
    RunLease(layout, clock=clock).acquire().release()


def test_the_lease_of_a_killed_process_of_this_host_is_taken_at_once(layout):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    clock = Clock()
    _held_by(layout, dead.pid, clock)
    lease = RunLease(layout, clock=clock).acquire()
    lease.release()


def test_the_lease_of_a_killed_process_not_yet_reaped_is_taken_at_once(layout):
    """A SIGKILLed holder stays a zombie until its parent reaps it, and a zombie answers kill(pid, 0):
    it must not lock the run (here this test is the parent and reaps it only at the end)."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    clock = Clock()
    _held_by(layout, holder.pid, clock)
    holder.kill()
    try:
        wait_for_zombie(holder.pid)
        os.kill(holder.pid, 0)  # still answers: the old check would call it alive
        RunLease(layout, clock=clock).acquire().release()
    finally:
        holder.stdin.close()
        holder.wait()


def test_the_lease_of_a_pid_now_used_by_another_process_is_taken_at_once(layout, other_process):
    """pids are reused: a live process with the holder's pid but another start is not the holder."""
    clock = Clock()
    _held_by(layout, other_process, clock, process="another-boot:12345")
    RunLease(layout, clock=clock).acquire().release()


def wait_for_zombie(pid: int) -> None:
    """Block until our killed child ``pid`` has exited, leaving it unreaped (a zombie)."""
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


_CONTENDER = """
import sys
from miles_core.storage.layout import RunLayout
from miles_core.storage.lease import RunBusy, RunLease
layout = RunLayout(sys.argv[1], "r", "run-1")
print("ready", flush=True)
sys.stdin.readline()
try:
    RunLease(layout).acquire()
    print("won", flush=True)
except RunBusy:
    print("busy", flush=True)
sys.stdin.read()  # the winner stays alive (a live holder) until the test has every answer
"""


def test_of_trainers_that_start_together_exactly_one_gets_the_lease(tmp_path):
    contenders = [subprocess.Popen([sys.executable, "-c", _CONTENDER, str(tmp_path / "runs")], text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(4)]
    try:
        assert [c.stdout.readline().strip() for c in contenders] == ["ready"] * 4
        for c in contenders:
            c.stdin.write("go\n")
            c.stdin.flush()
        answers = sorted(c.stdout.readline().strip() for c in contenders)
    finally:
        for c in contenders:
            c.stdin.close()
            c.wait(timeout=30)
    assert answers == ["busy", "busy", "busy", "won"]


def test_release_leaves_a_lease_that_is_not_its_own(layout, other_process):
    clock = Clock()
    lease = RunLease(layout, clock=clock)
    _held_by(layout, other_process, clock)  # taken over meanwhile
    lease.release()
    assert layout.read_json(LEASE_FILE)["token"] == "theirs"
