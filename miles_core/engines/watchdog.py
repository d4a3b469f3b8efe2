"""Run a command in its own process group and take the group down with its parent.

``python watchdog.py --parent-pid P [--log FILE] -- CMD ...`` (started by process ``P``) starts ``CMD`` in a new session, writes
its output to ``FILE`` (else to this process's stdout), forwards SIGTERM and SIGINT to the whole
group, and when process ``P`` is gone (the run that launched the server was killed, even with
SIGKILL) terminates the group, killing it 10 s later. It exits with the command's exit code.

Standard library only (and ``miles_core.processes``, which is too): it runs under another
environment's Python (vLLM's, see ``scripts/setup-vllm.sh``), which does not have this package
installed; the launcher runs it by its file path, and it puts the package's root on its path. A server such as vLLM starts processes of its own (its engine core, workers): the group
takes them down too, so no orphan keeps a port or a core.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run by its file path under another environment's Python: this package's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from miles_core import processes  # noqa: E402 (standard library only, like this file)

GRACE_S = 10.0


def _stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
    """Signal the command's group, then kill it after ``GRACE_S``; the command's exit code."""
    processes.stop_group(proc.pid, GRACE_S, sig, gone=lambda: proc.poll() is not None)
    return proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log", help="file the command's output goes to (appended)")
    parser.add_argument("--poll-s", type=float, default=0.5)
    parser.add_argument("--cpu-affinity", help="cores the command (and what it starts) is pinned to, e.g. 1 or 0,1")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (after --)")
    if args.cpu_affinity and hasattr(os, "sched_setaffinity"):  # inherited by the command and its children
        os.sched_setaffinity(0, {int(c) for c in args.cpu_affinity.split(",")})
    out = open(args.log, "ab", buffering=0) if args.log else None  # noqa: SIM115 (open for the command's life)
    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT if out else None,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    stopping = []

    def forward(signum, _frame) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        code = proc.poll()
        if code is not None:
            return code
        if stopping:
            return _stop_group(proc, stopping[0])
        if processes.orphaned(args.parent_pid) or not processes.alive(args.parent_pid):  # the parent died
            print(f"watchdog: parent {args.parent_pid} is gone; stopping {command[0]} (group {proc.pid})",
                  file=sys.stderr, flush=True)
            return _stop_group(proc)
        time.sleep(args.poll_s)


if __name__ == "__main__":
    sys.exit(main())
