"""Which project files one fully-async step passes through, on each side.

Runs a tiny fully-async toy run in this process (no Prefect server): the trainer side calls the
training tasks' bodies (``train_from_stream.fn``, ``record_step.fn``), the producer side is one
fleet member (``run_fleet_producer``) in a child process. ``sys.setprofile`` (and
``threading.setprofile`` for the threads started meanwhile) records every call during one training
step (the second) and during one producer step (the producer's third segment), and the script
prints the distinct files under miles_core/, flows/, tasks/ and deployments/ each side went through.

    python scripts/step_trace.py [--list]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = tuple(str(ROOT / d) + os.sep for d in ("miles_core", "flows", "tasks", "deployments"))


class FileTrace:
    """The project files called into while ``on`` (this thread, and threads started after ``install``)."""

    def __init__(self) -> None:
        self.on = False
        self.files: set[str] = set()

    def _profile(self, frame, event, arg):
        if self.on and event == "call" and frame.f_code.co_filename.startswith(PACKAGES):
            self.files.add(os.path.relpath(frame.f_code.co_filename, ROOT))

    def install(self) -> None:
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)


def toy_config(root: str):
    from miles_core.config import RunConfig

    return RunConfig.model_validate({
        "name": "step-trace",
        "mode": {"type": "fully_async"},
        "model": {"path": "builtin:tiny-addition"},
        "data": {"type": "toy"},
        "rollout": {"num_rollout": 3, "rollout_batch_size": 4, "n_samples_per_prompt": 4,
                    "rollout_max_response_len": 6},
        "engine": {"type": "hf", "num_threads": 1},
        "eval": {"skip_eval_before_train": True, "eval_interval": None},
        "storage": {"root": root},
    })


def produce(cfg, refs, producer: str, out) -> None:
    """The producer side (a child process): trace while it writes its third segment."""
    from miles_core.rollout.fleet import stream_name
    from miles_core.session.fleet_member import run_fleet_producer
    from miles_core.storage.stream import SampleStream

    trace, stream = FileTrace(), SampleStream(refs.run_dir, producer=stream_name(producer))

    def watch() -> None:  # started before the profiler: not traced itself
        while len(stream.offsets()) < 2:  # the first segments: the engine warming up
            time.sleep(0.01)
        trace.on = True
        while len(stream.offsets()) < 3:
            time.sleep(0.01)
        trace.on = False
        out.put(sorted(trace.files))

    threading.Thread(target=watch, daemon=True).start()
    trace.install()
    run_fleet_producer(cfg, refs, producer)


class ChildLauncher:
    """A fleet launcher whose producers are ``produce`` in child processes."""

    def __init__(self, cfg, refs) -> None:
        self.cfg, self.refs = cfg, refs
        self.ctx = multiprocessing.get_context("spawn")
        self.out = self.ctx.Queue()
        self.procs: dict[str, multiprocessing.Process] = {}

    def launch(self, producer: str) -> None:
        self.procs[producer] = self.ctx.Process(target=produce, args=(self.cfg, self.refs, producer, self.out),
                                                daemon=True)
        self.procs[producer].start()

    def ended(self, producer: str) -> str | None:
        proc = self.procs.get(producer)
        return None if proc is None or proc.is_alive() else f"exited {proc.exitcode}"

    def stop(self, producer: str, timeout: float = 10.0) -> None:
        self.procs[producer].join(timeout)
        self.cancel(producer)

    def cancel(self, producer: str) -> None:
        if self.procs[producer].is_alive():
            self.procs[producer].terminate()

    def abandon(self, producer: str, reason: str) -> None:
        self.cancel(producer)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print each side's files too")
    args = parser.parse_args()
    import tasks.train
    from miles_core.run import close_session, get_session, prepare_run

    tasks.train.get_run_logger = lambda: logging.getLogger("step-trace")  # the task bodies, outside a task run
    with tempfile.TemporaryDirectory() as root:
        cfg = toy_config(root)
        refs = prepare_run(cfg, log=lambda *_: None)
        trace = FileTrace()
        trace.install()
        launcher = ChildLauncher(cfg, refs)
        session = get_session(cfg, refs)
        try:
            tasks.train.resume_run.fn(cfg, refs)
            session.start_fleet(launcher)
            sides = {}
            for step in range(2):
                trace.on = step == 1  # the first step builds the trainer and the feed
                ref = tasks.train.train_from_stream.fn(cfg, refs, step)
                tasks.train.record_step.fn(cfg, refs, step + 1, {**ref.metrics, "version": ref.version})
                trace.on = False
            sides["trainer (one training step)"] = sorted(trace.files)
            sides["producer (one segment)"] = launcher.out.get(timeout=300)
            session.stop_fleet()
        finally:
            close_session(refs)
    for side, files in sides.items():
        print(f"{side}: {len(files)} project files")
        if args.list:
            print("".join(f"  {f}\n" for f in files), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
