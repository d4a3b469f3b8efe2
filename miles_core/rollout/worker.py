"""One rollout producer of a fleet, built from (config, run folder, producer id) alone.

- ``run_fleet_producer(cfg, refs, producer_id)``: builds its own engine, tokenizer and reward (a
  ``RolloutSide``: the run's generating parts, nothing of the trainer's), claims prompts from the run's prompt log,
  writes ``samples/rollout-<id>/``, heartbeats to ``fleet/producers/<id>.json``, and runs until the
  run folder says stop (or ``cancel`` is set, or the process that launched it is gone). On its
  way out it gives back the prompts it claimed and never started; on failure its heartbeat says
  ``failed`` with the error and its traceback, which the trainer reports.
- ``ProducerLink``: what ``RolloutProducer`` polls (``control_poll_s``): stop, pause, fence, in one
  listing; it also writes the heartbeat (every ``producer_heartbeat_s``) and reads how many live
  producers share the buffer bound (``fleet/ahead.json``: the trainer writes it from the
  heartbeats it reads, so no producer reads the others' heartbeats).
- ``ClaimedPrompts``: the producer's prompt supply, ``prompt_claim_size`` prompts per claim.
- ``SubprocessLauncher``: the laptop default: each producer is ``python -m miles_core.rollout.worker``,
  a child process of the trainer's, given its config on stdin (secrets never touch disk or argv).
  ``tasks/fleet.py`` has the other launcher, flow runs of a deployment (``DeploymentLauncher``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from miles_core import processes
from miles_core.rollout.fleet import ControlPlane, Heartbeat, ProducerFenced, PromptLog, stream_name

if TYPE_CHECKING:
    from miles_core.config import RunConfig
    from miles_core.rollout.generate import PromptItem
    from miles_core.rollout.producer import RolloutProducer
    from miles_core.session.refs import RunRefs
    from miles_core.types import Group


class ClaimedPrompts:
    """A producer's prompts (its ``PromptSupply``): blocks claimed from the run's prompt log, each
    prompt with its group index (unique in the run)."""

    def __init__(self, log: PromptLog, producer: str, render, block: int) -> None:
        self.log, self.producer, self.render, self.block = log, producer, render, block
        self._queue: deque[tuple[PromptItem, int]] = deque()
        self.claims = 0
        self._lock = threading.Lock()  # the producer calls take and filtered from worker threads; one log

    def take(self) -> tuple[PromptItem, int]:
        with self._lock:
            if not self._queue:
                claim = self.log.claim(self.producer, self.block)
                self.claims += 1
                items = self.render(claim.rows)
                self._queue.extend((item, claim.group_index(i)) for i, item in enumerate(items))
            return self._queue.popleft()

    def unstarted(self) -> dict[int, int]:
        """Group index -> row of the prompts claimed and not started yet."""
        return {group: item.prompt_index for item, group in self._queue}

    def filtered(self, group: Group, reason: str) -> None:
        """A dynamic filter dropped ``group``: the prompt log records it as settled."""
        with self._lock:
            self.log.filtered(self.producer, group.group_index, group.samples[0].prompt_index, reason)

    def release_own(self, groups: dict[int, int], reason: str):
        """Give back prompts this producer claimed (group index -> row); see ``PromptLog.release_own``."""
        with self._lock:
            return self.log.release_own(groups, reason=reason, producer=self.producer)

    def adopted(self) -> list[tuple[str, set[int]]]:
        """The partial groups this producer took over: (the producer that saved them, group indices)."""
        with self._lock:
            return [(c.source, set(c.groups)) for c in self.log.adopted_by(self.producer)]

    def state(self) -> dict[str, Any]:
        return {"claims": self.claims, "queued": len(self._queue)}

    def load_state(self, state: dict[str, Any]) -> None:
        """Nothing to load: the prompt log is the cursor."""


@dataclass
class Signal:
    """What one poll of the control plane tells a producer."""

    stop: bool = False
    pause_holders: list[str] = field(default_factory=list)
    fleet_size: int | None = None
    """Live producers sharing the buffer bound (``fleet/ahead.json``), when this poll read it."""


class ProducerLink:
    """A producer's side of the control plane (polled from the producer's loop, on a worker thread)."""

    def __init__(self, control: ControlPlane, heartbeat: Heartbeat, heartbeat_s: float,
                 cancel: threading.Event | None = None, parent_pid: int | None = None) -> None:
        self.control, self.hb, self.heartbeat_s = control, heartbeat, heartbeat_s
        self.cancel = cancel or threading.Event()
        self.parent_pid = parent_pid
        """Stop when this process is no longer our parent (the trainer died without stopping us)."""
        self._beat_at = 0.0
        self._lock = threading.Lock()  # the starting beat's thread and the producer's loop

    def poll(self, producer: RolloutProducer, beat_now: bool = False) -> Signal:
        """One listing of ``control/`` (stop, pause, fence); on the heartbeat's cadence also the
        heartbeat and the fleet's groups ahead (``ahead.json``, which the trainer writes)."""
        signals = self.control.signals()
        if self.hb.producer in signals.fenced:
            raise ProducerFenced(f"producer {self.hb.producer} was declared dead by the trainer "
                                 f"({self.control.files.url(f'control/fence/{self.hb.producer}.json')}); stopping")
        stop = self.cancel.is_set() or signals.stop
        if self.parent_pid is not None and processes.orphaned(self.parent_pid):
            stop = True
        now, fleet_size = time.monotonic(), None
        if beat_now or now - self._beat_at >= self.heartbeat_s:
            self.beat(**producer.heartbeat_fields())
            self._beat_at = now
            fleet_size = len(set(self.control.ahead()) | {self.hb.producer})
        return Signal(stop, signals.pause_holders, fleet_size)

    def beat(self, **fields: Any) -> None:
        with self._lock:
            for key, value in fields.items():
                setattr(self.hb, key, value)
            self.control.beat(self.hb)

    def fail(self, error: BaseException) -> None:
        """Say ``failed``, with ``error`` and its traceback (call it in the ``except`` that caught it)."""
        self.beat(status="failed", error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc(),
                  outstanding=0, in_engine=0)

    def beat_while_starting(self) -> threading.Event:
        """Beat ``starting`` from a thread until the producer's loop beats by itself (loading an
        engine can take minutes); set the returned event to end it early."""
        done = threading.Event()

        def run() -> None:
            while not done.wait(self.heartbeat_s):
                with self._lock:
                    if self.hb.status != "starting":
                        return
                try:
                    self.beat()
                except Exception:  # noqa: BLE001 (the loop's own beats report storage errors)
                    return

        threading.Thread(target=run, name=f"heartbeat-{self.hb.producer}", daemon=True).start()
        return done


def run_fleet_producer(cfg: RunConfig, refs: RunRefs, producer_id: str, *, cancel: threading.Event | None = None,
                       flow_run_id: str | None = None, parent_pid: int | None = None, log=print) -> dict[str, Any]:
    """Run producer ``producer_id`` of the run until the run folder says stop; returns its stats."""
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
    """Producers as child processes of this one (``python -m miles_core.rollout.worker``)."""

    def __init__(self, cfg: RunConfig, refs: RunRefs, log=print) -> None:
        self.cfg, self.refs, self.log = cfg, refs, log
        self.procs: dict[str, subprocess.Popen] = {}

    def launch(self, producer: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        cmd = [sys.executable, "-m", "miles_core.rollout.worker", "--producer-id", producer,
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
        if proc is None or proc.poll() is None:
            return None
        code = proc.returncode
        return f"its process {proc.pid} exited with code {code}" if code >= 0 else \
            f"its process {proc.pid} was killed by signal {signal.Signals(-code).name}"

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
    parser = argparse.ArgumentParser(prog="python -m miles_core.rollout.worker")
    parser.add_argument("--producer-id", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--parent-pid", type=int)
    args = parser.parse_args(argv)
    from miles_core.config import RunConfig
    from miles_core.run import RunRefs

    cfg = RunConfig.model_validate(json.loads(sys.stdin.read()))
    refs = RunRefs(args.run_id, args.run_dir, args.model_dir)
    cancel = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # stop cleanly: whole segments, heartbeat "stopped"
        signal.signal(sig, lambda *_: cancel.set())
    name = f"producer {args.producer_id}"
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
