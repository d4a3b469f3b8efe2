"""Child processes (``miles_core.processes``): waiting for one to be ready, saying how it ended,
stopping it with what it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

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


def test_wait_ready_says_how_a_server_that_never_answered_ended_and_what_it_printed():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; print('no model at /nowhere'); sys.exit(3)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        with pytest.raises(RuntimeError) as raised:
            processes.wait_ready(lambda: False, what="toy server", probe="http://127.0.0.1:1/health",
                                 timeout_s=60, ended=lambda: processes.ended(proc),
                                 tail=lambda: f"its last output:\n{proc.stdout.read()}")
        assert str(raised.value) == "toy server exited with code 3; its last output:\nno model at /nowhere\n"
    finally:
        proc.stdout.close()


def test_wait_ready_gives_up_at_its_deadline_naming_the_probe_and_the_setting():
    calls = []
    with pytest.raises(TimeoutError, match=r"^toy server did not answer http://h/health within 0.2 s "
                                           r"\(engine.startup_timeout_s\); \(no log\)$"):
        processes.wait_ready(lambda: calls.append(1) and False, what="toy server", probe="http://h/health",
                             timeout_s=0.2, ended=lambda: None, tail=lambda: "(no log)",
                             setting="engine.startup_timeout_s", poll_s=0.01)
    assert calls  # it asked before it gave up


def test_wait_ready_returns_once_the_probe_answers():
    answers = iter([False, False, True])
    processes.wait_ready(lambda: next(answers), what="toy server", probe="p", timeout_s=60, ended=lambda: None,
                         tail=str, poll_s=0)
    assert next(answers, "done") == "done"


# leads a group, ignores SIGTERM, starts a child in its group, prints that child's pid, waits
_STUBBORN = """
import signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
print(child.pid, flush=True)
sys.stdin.read()
"""


def test_stop_group_kills_a_group_whose_leader_ignores_sigterm_and_what_it_started():
    proc = subprocess.Popen([sys.executable, "-c", _STUBBORN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        child = int(proc.stdout.readline())
        assert processes.stop_group(proc.pid, 0.3, gone=lambda: proc.poll() is not None)
        assert processes.ended(proc) == "was killed by signal SIGKILL"
        wait_for(lambda: not processes.alive(child), 10, f"the child {child} to end")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
        proc.stdout.close()


def test_exit_text_names_codes_and_signals():
    assert processes.exit_text(0) == "exited with code 0"
    assert processes.exit_text(-signal.SIGTERM) == "was killed by signal SIGTERM"
    assert processes.exit_text(-200) == "was killed by signal 200"  # no such signal name


def test_package_env_puts_this_package_first_and_keeps_what_was_there(tmp_path):
    env = processes.package_env({"PYTHONPATH": str(tmp_path), "X": "1"})
    root = env["PYTHONPATH"].split(os.pathsep)[0]
    assert env["PYTHONPATH"].split(os.pathsep)[1:] == [str(tmp_path)] and env["X"] == "1"
    # -S: no site-packages, so not this package's editable install either; only PYTHONPATH finds it
    done = subprocess.run([sys.executable, "-S", "-c", "import miles_core.processes as p; print(p.__file__)"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == os.path.join(root, "miles_core", "processes.py")
