"""Child processes (``miles_core.processes``): a hung process is killed with what it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from waiting import wait_for

from miles_core import processes

# a process that starts a child (waiting on its stdin, as a server waits on requests), prints its pid, waits
_PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
print(child.pid, flush=True)
sys.stdin.read()
"""


def test_kill_tree_ends_a_process_and_the_hung_child_it_started():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(child, signal.SIGSTOP)  # hung: it could not notice its parent's death by itself
        assert processes.descendants(parent.pid) == [child]
        processes.kill_tree(parent)
        assert parent.returncode == -signal.SIGKILL
        wait_for(lambda: not processes.alive(child), 10, f"the child {child} to end")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_descendants_of_a_process_without_children_is_empty():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert processes.descendants(proc.pid) == []
    finally:
        proc.stdin.close()
        proc.wait()
