"""One rollout producer of a fleet as a process of its own, built from (config, run folder,
producer id) alone.

- ``run_fleet_producer(cfg, refs, producer_id)``: builds its own engine, tokenizer and reward (a
  ``RolloutSide``: the run's generating parts, nothing of the trainer's), claims prompts from the
  run's prompt log (``rollout.worker.ClaimedPrompts``), writes ``samples/rollout-<id>/``, heartbeats
  to ``fleet/producers/<id>.json`` (``rollout.worker.ProducerLink``), and runs until the run folder
  says stop (or ``cancel`` is set, or the process that launched it is gone). On its way out it gives
  back the prompts it claimed and never started; on failure its heartbeat says ``failed`` with the
  error and its traceback, which the trainer reports.
- ``SubprocessLauncher``: the laptop default: each producer is ``python -m miles_core.session.fleet_member``,
  a child process of the trainer's, given its config on stdin (secrets never touch disk or argv).
  ``tasks/fleet.py`` has the other launcher, flow runs of a deployment (``DeploymentLauncher``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import traceback
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from miles_core import processes
from miles_core.rollout.fleet import ControlPlane, Heartbeat, ProducerFenced, PromptLog, stream_name
from miles_core.rollout.worker import ClaimedPrompts, ProducerLink
from miles_core.session.refs import RunRefs

if TYPE_CHECKING:
    from miles_core.config import RunConfig
    from miles_core.rollout.producer import RolloutProducer


def run_fleet_producer(cfg: RunConfig, refs: RunRefs, producer_id: str, *, cancel: threading.Event | None = None,
                       flow_run_id: str | None = None, parent_pid: int | None = None, log=print) -> dict[str, Any]:
    """Run producer ``producer_id`` of the run until the run folder says stop; returns its stats."""
    # imported here: the entry point's signal handlers are in place before the heavy imports
    from miles_core.session.parts import EngineLoop, RunFiles
    from miles_core.session.rollouts import RolloutSide

    a = cfg.mode
    opts = cfg.storage.storage_options
    files, loop = RunFiles.open(cfg, refs), EngineLoop()
    control = ControlPlane(refs.run_dir, opts, retry=files.layout.retry)
    link = ProducerLink(control, Heartbeat(producer_id, "starting", flow_run_id=flow_run_id), a.producer_heartbeat_s,
                        cancel, parent_pid)
    link.beat()
    starting = link.beat_while_starting()
    side = RolloutSide(cfg, refs, files, loop)
    try:
        prompt_log = PromptLog(refs.run_dir, opts, draw=side.source.draw, retry=files.layout.retry)
        prompts = ClaimedPrompts(prompt_log, producer_id, side.render_rows, a.prompt_claim_size)
        stream = files.stream.sibling(stream_name(producer_id))
        producer = side.producer(prompts, stream, files.weights, link=link,
                                 state_file=f"state/producer-{producer_id}.json", partial_stream=f"partial-{producer_id}")
        log(f"producer {producer_id}: writing {stream.uri} (engine at weights v{side.engine.weight_version})")

        def stopped(stats, why: str) -> dict[str, Any]:
            """Give back what was claimed and never started, say ``stopped``."""
            released = prompts.release_own({**prompts.unstarted(), **producer.abandoned_groups},
                                           reason=f"producer {producer_id} {why}")
            link.beat(status="stopped", stats=asdict(stats), outstanding=0, in_engine=0)
            log(f"producer {producer_id}: {why} after {stats.groups_written} groups in {stats.segments_written} "
                f"segments; {len(released.rows) if released else 0} claimed prompts given back")
            return asdict(stats)

        try:
            return stopped(_run_until_stopped(loop, producer, link), "stopped")
        except Exception:
            raise
        except BaseException:  # cancelled or interrupted: the producer stopped cleanly before this propagates
            stopped(producer.stats, "cancelled")
            raise
    except Exception as e:
        starting.set()
        link.fail(e)
        raise
    finally:
        starting.set()
        side.close()
        loop.close()


def _run_until_stopped(loop, producer: RolloutProducer, link: ProducerLink):
    """Run the producer on the engines' loop; an interruption of this thread (Ctrl-C, a Prefect
    cancellation) stops it cleanly (whole segments only) before it propagates."""
    import asyncio

    future = asyncio.run_coroutine_threadsafe(producer.run(), loop.loop)
    try:
        return future.result()
    except BaseException:
        link.cancel.set()  # the producer stops at its next look at the control plane
        try:
            future.result(timeout=20)
        except BaseException:  # noqa: BLE001 (the interruption is what propagates)
            pass
        raise


# ------------------------------------------------------------------------------------- launchers


class SubprocessLauncher:
    """Producers as child processes of this one (``python -m miles_core.session.fleet_member``)."""

    def __init__(self, cfg: RunConfig, refs: RunRefs, log=print) -> None:
        self.cfg, self.refs, self.log = cfg, refs, log
        self.procs: dict[str, subprocess.Popen] = {}

    def launch(self, producer: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        cmd = [sys.executable, "-m", "miles_core.session.fleet_member", "--producer-id", producer,
               "--run-id", self.refs.run_id, "--run-dir", self.refs.run_dir, "--model-dir", self.refs.model_dir,
               "--parent-pid", str(os.getpid())]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env, text=True)
        cores = self.cfg.mode.producer_cpu_affinity
        if cores and hasattr(os, "sched_setaffinity"):  # before it has imported anything heavy
            os.sched_setaffinity(proc.pid, cores)
        from miles_core.config import WITH_SECRETS

        proc.stdin.write(self.cfg.model_dump_json(context=WITH_SECRETS))  # storage credentials too: never on disk
        proc.stdin.close()
        self.procs[producer] = proc
        self.log(f"launched rollout producer {producer}: process {proc.pid}")

    def ended(self, producer: str) -> str | None:
        proc = self.procs.get(producer)
        how = None if proc is None else processes.ended(proc)
        return None if how is None else f"its process {proc.pid} {how}"

    def stop(self, producer: str, timeout: float = 10.0) -> bool:
        """Make sure it is gone: SIGTERM (it stops cleanly), then SIGKILL after ``timeout``; True
        if it had to be killed."""
        proc = self.procs.get(producer)
        if proc is None or proc.poll() is not None:
            return False
        proc.terminate()
        try:
            proc.wait(timeout)
            return False
        except subprocess.TimeoutExpired:
            processes.kill_tree(proc)  # its engine server too
            return True

    def abandon(self, producer: str, reason: str) -> None:
        proc = self.procs.get(producer)
        if proc is not None and proc.poll() is None:
            processes.kill_tree(proc)  # a hung producer (and its engine server): its fence stops it counting

    def cancel(self, producer: str) -> None:
        proc = self.procs.get(producer)
        if proc is not None and proc.poll() is None:
            proc.terminate()  # SIGTERM: it stops cleanly

    def wait(self, producer: str, timeout: float) -> bool:
        proc = self.procs.get(producer)
        if proc is None:
            return True
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False


def main(argv: list[str] | None = None) -> int:
    """The subprocess entry point: the config as JSON on stdin, the run's references as flags."""
    parser = argparse.ArgumentParser(prog="python -m miles_core.session.fleet_member")
    parser.add_argument("--producer-id", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--parent-pid", type=int)
    args = parser.parse_args(argv)
    from miles_core.config import RunConfig

    cfg = RunConfig.model_validate(json.loads(sys.stdin.read()))
    refs = RunRefs(args.run_id, args.run_dir, args.model_dir)
    cancel = threading.Event()
    name = f"producer {args.producer_id}"

    def on_signal(signum, _frame) -> None:  # stop cleanly: whole segments, heartbeat "stopped"
        first = not cancel.is_set()
        cancel.set()
        if first:  # said, so a producer that goes on anyway shows whether it was heard
            with contextlib.suppress(RuntimeError, OSError):  # (a signal inside this thread's own print)
                print(f"{name}: {signal.Signals(signum).name}: stopping (whole segments only)", file=sys.stderr,
                      flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        run_fleet_producer(cfg, refs, args.producer_id, cancel=cancel, parent_pid=args.parent_pid,
                           log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except ProducerFenced as e:
        print(f"{name}: {e}", file=sys.stderr, flush=True)
        return 3
    except BaseException as e:  # noqa: BLE001 (the heartbeat has the traceback; say it here too)
        print(f"{name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
