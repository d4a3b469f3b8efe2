"""The trainer's side of a rollout fleet: launch, watch, replace, pause and stop producers,
through the run folder only (``rollout/fleet.py``) and a launcher.

``Fleet(cfg, refs, launcher)``:
- ``start()`` launches ``rollout_producers`` producers (ids ``p0``, ``p1``, ...);
- ``check()`` (the feed calls it for every batch and on every poll) finds dead producers (``FleetMonitor``), fences
  them, gives their claimed-but-unwritten prompts back to the pool, and launches a replacement,
  at most ``producer_restarts`` times over the run; one more death raises ``ProducerFailed``
  naming the producer and its last error with its traceback;
- ``streams()``: what the trainer reads: every producer's stream, a dead one's up to its fence;
- ``recycle(groups)``: prompts of rejected groups back to the pool (``unused_samples_handler = retry``);
- ``pause(holder)`` / ``resume(holder)``: an evaluation borrows the engines; ``pause`` returns once
  every live producer says it has nothing in its engine;
- ``stop()``: ``control/stop.json``, wait for every producer to say ``stopped``, then the launcher
  makes sure each is gone; ``cancel()`` (the run was cancelled or failed) cancels them at once.

A launcher has ``launch(producer)``, ``ended(producer) -> reason | None``, ``stop(producer, timeout)``
(make sure it is gone, after it was asked to stop), ``cancel(producer)`` (now) and
``abandon(producer, reason)`` (it was declared dead: kill what is left of it, mark it crashed):
``session.fleet_member.SubprocessLauncher`` (child processes) or ``tasks/fleet.DeploymentLauncher`` (flow runs of
a deployment, children of the training run).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from miles_core.rollout.fleet import (
    ControlPlane,
    FleetMonitor,
    ProducerFailed,
    PromptLog,
    last_offset,
    recycle_to,
    settle_earlier,
    stream_name,
    written_groups,
)
from miles_core.ledger import used_groups
from miles_core.rollout.throughput import ThroughputMeter
from miles_core.types import Group

if TYPE_CHECKING:
    from miles_core.config import RunConfig
    from miles_core.run import RunRefs
    from miles_core.storage.stream import SampleStream


class Launcher(Protocol):
    def launch(self, producer: str) -> None: ...

    def ended(self, producer: str) -> str | None: ...

    def stop(self, producer: str, timeout: float = 10.0) -> bool: ...

    def cancel(self, producer: str) -> None: ...

    def abandon(self, producer: str, reason: str) -> None: ...


class Fleet:
    def __init__(self, cfg: RunConfig, refs: RunRefs, launcher: Launcher, base_stream: SampleStream,
                 warn=print) -> None:
        a = cfg.mode
        opts = cfg.storage.storage_options
        self.cfg, self.refs, self.launcher, self.warn = cfg, refs, launcher, warn
        self.base_stream = base_stream
        self.control = ControlPlane(refs.run_dir, opts, retry=base_stream.retry)
        self.log = PromptLog(refs.run_dir, opts, retry=base_stream.retry)
        self.monitor = FleetMonitor(self.control, self.log, self._written, a.producer_heartbeat_timeout_s,
                                    a.producer_start_timeout_s, ended=launcher.ended)
        self.restarts_left = a.producer_restarts
        self.deaths: list[str] = []
        self._streams: dict[str, SampleStream] = {}
        self._next = 0
        self._meter = ThroughputMeter()
        self._stopped = False
        self._lock = threading.Lock()  # the monitor's state: the watcher thread and the trainer's
        self._died: list = []
        self._watch_error: BaseException | None = None
        self._watching = threading.Event()
        self._used: set[int] = set()
        """Groups the trainer's ledger says it used, read when an earlier start is settled."""

    # ----------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self.control.clear_stop()
        for holder in self.control.pause_holders():  # left by a run killed while it evaluated
            self.control.unpause(holder)
        earlier = self.control.heartbeats()
        known = [int(p[1:]) for p in earlier if p[:1] == "p" and p[1:].isdigit()]
        self._next = max(known, default=-1) + 1  # a run started again never reuses a producer's stream
        self._settle_earlier(earlier)
        for _ in range(self.cfg.mode.rollout_producers):
            self._launch()
        self._watching.set()
        threading.Thread(target=self._watch, name="fleet-monitor", daemon=True).start()

    def _settle_earlier(self, earlier: dict) -> None:
        """The producers of an earlier start of this run (``fleet.settle_earlier``): fenced, their
        partial groups adopted by the first producer launched now, the rest given back."""
        if not earlier:
            return
        # what the trainer used stays used, even when the segment that held it was damaged and moved aside
        self._used = used_groups(self.refs.run_dir, self.cfg.storage.storage_options)
        with self._lock:
            returned, adopted = settle_earlier(self.monitor, self.base_stream, sorted(earlier), f"p{self._next}")
        self.warn(f"run {self.refs.run_id} was started before: the trainer reads what its producers "
                  f"{sorted(earlier)} wrote and not yet trained; {returned} prompts they claimed and never "
                  f"wrote went back to the pool" + (f", and p{self._next} continues {adopted} partial groups they "
                                                    "saved" if adopted else ""))

    def _launch(self) -> str:
        producer = f"p{self._next}"
        self._next += 1
        with self._lock:
            self.monitor.watch(producer)
        self.launcher.launch(producer)
        return producer

    def _watch(self) -> None:
        """The watcher thread: reads the heartbeats every ``poll_s`` (storage latency stays off the
        trainer's thread), fences and releases the dead, tells the fleet its size
        (``fleet/ahead.json``). ``check`` acts on what it found."""
        while self._watching.is_set():
            try:
                self.poll()
            except BaseException as e:  # noqa: BLE001 (raised by check, on the trainer's thread)
                self._watch_error = e
                return
            time.sleep(self.monitor.poll_s)

    def poll(self) -> None:
        with self._lock:
            polls = self.monitor.polls
            died = self.monitor.poll(last_offset=self._last_offset)
            if self.monitor.polls != polls:
                beats = self.monitor.heartbeats()
                self.control.write_ahead({p: beats[p].outstanding for p in self.monitor.alive if p in beats})
            self._died += died

    def check(self) -> None:
        """Replace the producers found dead (or fail the run when no restart is left); raises what
        broke the watcher thread. The trainer's feed calls it for every batch and on every poll."""
        if self._watch_error is not None:
            raise self._watch_error
        with self._lock:
            died, self._died = self._died, []
        for w in died:
            self.deaths.append(w.producer)
            text = self.monitor.describe(w)
            if self.restarts_left <= 0:
                self.launcher.abandon(w.producer, w.dead or "declared dead")
                limit = self.cfg.mode.producer_restarts
                raise ProducerFailed(f"{text}\n(no restart left: --producer-restarts {limit} used up)")
            self.restarts_left -= 1
            self.launcher.abandon(w.producer, w.dead or "declared dead")
            replacement = self._launch()
            self.warn(f"{text.splitlines()[0]}; {w.released} of its claimed prompts went back to the pool; "
                      f"launched {replacement} in its place ({self.restarts_left} restart(s) left)")

    def stop(self, timeout: float = 60.0) -> None:
        """Ask every producer to stop, wait for each to say so, then make sure each is gone."""
        if self._stopped:
            return
        self._stopped = True
        self._watching.clear()
        self.control.request_stop("the training run is over")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            beats = self.control.heartbeats()
            waiting = [p for p in self.monitor.alive
                       if beats.get(p) is None or beats[p].status not in ("stopped", "failed")]
            waiting = [p for p in waiting if self.launcher.ended(p) is None]
            if not waiting:
                break
            time.sleep(0.1)
        else:
            self.warn(f"rollout producers {waiting} did not stop within {timeout:.0f} s; stopping them")
        for producer in self.monitor.producers():
            self.launcher.stop(producer, timeout=10)

    def cancel(self, timeout: float = 20.0) -> None:
        """The training run was cancelled or failed: cancel every producer now (a flow run ends
        CANCELLED, a child process gets SIGTERM) and say so in the run folder at once (a producer
        elsewhere, or one its signal did not stop, stops at its next poll); each still stops
        cleanly, whole segments only. One still running after ``timeout`` is killed (inside the 30 s
        a Prefect runner gives a cancelled run's processes before it kills them all)."""
        if self._stopped:
            return
        self._stopped = True
        self._watching.clear()
        for producer in self.monitor.alive:
            self.launcher.cancel(producer)
        # on a thread: a storage outage must not hold up the kills below (a CI run once saw a child
        # producer go on polling the run folder for 20 s after two SIGTERMs, until it was killed)
        said = threading.Thread(target=self._say_cancelled, name="fleet-cancel", daemon=True)
        said.start()
        deadline = time.monotonic() + timeout
        for producer in self.monitor.alive:
            if self.launcher.stop(producer, timeout=max(0.0, deadline - time.monotonic())):
                beat = self.control.heartbeats().get(producer)
                self.warn(f"rollout producer {producer} had not stopped {timeout:.0f} s after it was cancelled; "
                          f"killed it (its last heartbeat: {beat.status if beat else 'none'})")
        said.join(max(0.0, deadline - time.monotonic()))

    def _say_cancelled(self) -> None:
        try:
            self.control.request_stop("the training run was cancelled")
        except Exception as e:  # noqa: BLE001 (the launcher's cancel and the kills still stop them)
            self.warn(f"could not write the stop request to {self.refs.run_dir}/control ({type(e).__name__}: {e}); "
                      "the producers are stopped by their launcher only")

    # -------------------------------------------------------------------------- the trainer reads

    def stream(self, producer: str) -> SampleStream:
        if producer not in self._streams:
            self._streams[producer] = self.base_stream.sibling(stream_name(producer))
        return self._streams[producer]

    def streams(self) -> list[tuple[SampleStream, int | None]]:
        """Each producer's stream and, for a fenced one, the last offset to read of it."""
        with self._lock:
            found = [(p, self.monitor.fences.get(p)) for p in self.monitor.producers()]
        return [(self.stream(p), fence) for p, fence in found]

    def recycle(self, groups: list[Group]) -> None:
        recycle_to(self.log, groups)

    def _last_offset(self, producer: str) -> int:
        return last_offset(self.stream(producer))

    def _written(self, producer: str, last: int) -> set[int]:
        """Groups ``producer`` wrote up to offset ``last``, and those the trainer used (whose segment
        may have been moved aside since): not to be given back."""
        return written_groups(self.stream(producer), last) | self._used

    # ------------------------------------------------------------------------------ pause

    def pause(self, holder: str, timeout: float = 120.0) -> None:
        """Hold every producer until none has a request in its engine."""
        self.control.pause(holder)
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            beats = self.control.heartbeats()
            waiting = [p for p in self.monitor.alive if beats.get(p) is None or
                       (holder not in beats[p].paused_for and beats[p].status not in ("stopped", "failed"))]
            if not waiting:
                return
            if time.monotonic() > deadline:
                self.control.unpause(holder)
                raise TimeoutError(f"rollout producers {waiting} did not pause for {holder} within {timeout:.0f} s "
                                   f"(their heartbeats: {self.control.url}producers/)")
            time.sleep(0.05)

    def resume(self, holder: str) -> None:
        self.control.unpause(holder)

    # ---------------------------------------------------------------------------- metrics

    def metrics(self) -> dict[str, float]:
        """The running producers' throughput and idle share (``ThroughputMeter``, from their heartbeats)."""
        with self._lock:
            beats, alive = self.monitor.heartbeats(), list(self.monitor.alive)
        stats = {p: hb.stats for p, hb in beats.items() if hb.stats}  # every producer's counters count
        running = [p for p in alive if p in stats and beats[p].status not in ("stopped", "failed")]
        return {
            **self._meter(stats, sum(beats[p].in_engine for p in alive if p in beats), running),
            "async/producers_alive": float(len(alive)),
            "async/producer_deaths": float(len(self.deaths)),
        }

    def summary(self) -> dict[str, Any]:
        """Which producer wrote what (for summary.json)."""
        beats = self.control.heartbeats()
        return {p: {"status": hb.status, "host": hb.host, "pid": hb.pid, "flow_run_id": hb.flow_run_id,
                    "groups_written": hb.stats.get("groups_written", 0),
                    "segments_written": hb.stats.get("segments_written", 0), "stream": self.stream(p).uri,
                    "fenced_at": self.monitor.fences.get(p), "error": hb.error}
                for p, hb in sorted(beats.items())}
