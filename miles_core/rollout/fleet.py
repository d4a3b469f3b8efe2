"""The rollout fleet's control plane: everything producers and the trainer tell each other is an
object in the run folder, so one process, two processes and two machines run the same code.

```
<run>/fleet/claims/<seq:09d>.json       the prompt log: create-only entries, one per seq
<run>/fleet/producers/<id>.json         each producer's heartbeat (status, version, counters, error)
<run>/fleet/control/stop.json           the trainer asks every producer to stop
<run>/fleet/control/pause/<holder>.json while any exists, producers submit nothing (and say so)
<run>/fleet/control/fence/<id>.json     producer <id> was declared dead: it must stop; the trainer
                                        ignores its segments after the offset named there
<run>/samples/rollout-<id>/             producer <id>'s own segment prefix (``stream_name``)
```

Parts:
- ``PromptLog``: prompts exactly once across the fleet. ``claim(producer, n)`` appends the next
  entry of a totally ordered log with a create-only write (S3 ``If-None-Match: *``, local
  ``os.link``); an entry takes rows released earlier first, then the next rows of the data cursor,
  and records the cursor and the still-pending released rows after it. Each entry is computed from
  the one before it and only one entry can exist per seq, so every prompt of an epoch is in
  exactly one claim, and every released row in exactly one later claim. ``release(rows)`` (a dead
  producer's unwritten prompts, or the prompts of groups the trainer rejected with
  ``unused_samples_handler = "retry"``) is an entry too. A claim's groups are numbered
  ``seq * GROUP_STRIDE + i``: unique across the fleet without coordination.
- ``ControlPlane``: heartbeats, stop, pause, fences, read and written by either side.
- ``FleetMonitor``: the trainer's view of the fleet: which producers are alive (a heartbeat whose
  beat counter has not moved for ``heartbeat_timeout_s`` seconds, measured on the trainer's own
  clock, is dead; so is one the launcher reports ended, or one that wrote ``failed``), which
  streams to read (and up to where), and what each dead producer claimed but never wrote, which
  goes back to the pool. Launching and restarting is the launcher's (see ``tasks/fleet.py``).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from miles_core.storage.fs import (
    DEFAULT_RETRY,
    RetryingFS,
    RetryPolicy,
    io_pool,
    is_missing_bucket,
    join,
    list_after,
    list_tree,
    to_url,
)
from miles_core.storage.layout import check_name

FLEET = "fleet"
GROUP_STRIDE = 1 << 16
"""Group indices of claim ``seq`` are ``seq * GROUP_STRIDE + i``; a claim holds fewer prompts."""
_ENTRY = "{:09d}.json"
RECYCLED = "rejected by the trainer (retry)"
"""The reason of a release of groups the trainer rejected (``unused_samples_handler = "retry"``)."""


def stream_name(producer: str) -> str:
    """The sample stream (segment prefix) producer ``producer`` writes."""
    return f"rollout-{check_name('producer', producer)}"


def last_offset(stream) -> int:
    """The offset of the last whole segment of ``stream`` (a ``SampleStream``; -1: none)."""
    offsets = stream.offsets()
    return offsets[-1] if offsets else -1


def written_groups(stream, last: int) -> set[int]:
    """The group indices in ``stream``'s segments up to offset ``last``."""
    written = set()
    for offset in stream.offsets():
        if offset <= last:
            written |= set(stream.read_segment(offset).table.column("group_index").to_pylist())
    return written


class _Files:
    """Small JSON objects under ``<run>/fleet/``, every call retried on transient storage errors."""

    def __init__(self, run_dir_url: str, storage_options: dict[str, Any] | None = None,
                 retry: RetryPolicy | None = None) -> None:
        self.io, run_dir = RetryingFS.open(run_dir_url, storage_options, retry or DEFAULT_RETRY)
        self.fs, self.root = self.io.fs, join(run_dir, FLEET)

    def path(self, rel: str) -> str:
        return join(self.root, rel)

    def url(self, rel: str) -> str:
        return to_url(self.fs, self.path(rel))

    def read(self, rel: str) -> Any | None:
        data = self.io.read(self.path(rel))
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError as e:
            raise ValueError(f"{self.url(rel)} is not valid JSON ({len(data)} bytes): {e}") from e

    def write(self, rel: str, obj: Any) -> None:
        self.io.write(self.path(rel), json.dumps(obj, sort_keys=True).encode())

    def create(self, rel: str, obj: Any) -> None:
        """Write only if nothing is there (FileExistsError otherwise)."""
        self.io.create(self.path(rel), json.dumps(obj, sort_keys=True).encode())

    def exists(self, rel: str) -> bool:
        return self.io.exists(self.path(rel))

    def names(self, folder: str, after: str | None = None) -> list[str]:
        try:
            return self.io.call(lambda: list_after(self.fs, self.path(folder), after), self.path(folder))
        except FileNotFoundError as e:
            if is_missing_bucket(e):
                raise
            return []

    def tree(self, folder: str) -> list[str]:
        """Every file below ``folder`` (relative paths), in one listing on S3."""
        return self.io.call(lambda: list_tree(self.fs, self.path(folder)), self.path(folder))

    def read_many(self, rels: list[str]) -> list[Any | None]:
        """``read`` of each, concurrently (object-store latency, not CPU, is what they wait on)."""
        if len(rels) <= 1:
            return [self.read(r) for r in rels]
        return list(io_pool().map(self.read, rels))

    def remove(self, rel: str) -> None:
        try:
            self.io.call(lambda: self.fs.rm_file(self.path(rel)), self.path(rel))
        except FileNotFoundError:
            pass


# ----------------------------------------------------------------------------------- the prompt log


@dataclass
class Claim:
    """One entry of the prompt log: rows claimed by ``producer`` (or released back to the pool)."""

    seq: int
    kind: str
    """``claim`` (a producer takes rows), ``release`` (rows go back to the pool), ``filtered`` (a
    group a producer's filter dropped) or ``adopt`` (a producer takes over another's partial groups)."""
    producer: str | None
    rows: list[int]
    """Prompt row indices (``PromptRow.index``), in order."""
    cursor: Any
    """The data cursor after this entry (opaque to the log; the ``draw`` function's)."""
    pending: list[int]
    """Released rows not yet claimed again, after this entry."""
    reason: str = ""
    groups: list[int] = field(default_factory=list)
    """A ``release`` or ``filtered`` entry: the group index of each row (the claim it came from)."""
    fenced: bool = False
    """A ``release`` of a producer declared dead: what it claimed and never wrote (its own later
    releases give back nothing more)."""
    source: str = ""
    """An ``adopt`` entry: the producer whose saved partial groups ``producer`` takes over."""

    @property
    def group_base(self) -> int:
        return self.seq * GROUP_STRIDE

    def group_index(self, i: int) -> int:
        return self.group_base + i

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "kind": self.kind, "producer": self.producer, "rows": self.rows,
                "cursor": self.cursor, "pending": self.pending, "reason": self.reason, "groups": self.groups,
                "fenced": self.fenced, "source": self.source, "at": time.time()}

    @classmethod
    def of(cls, obj: dict[str, Any]) -> Claim:
        return cls(obj["seq"], obj["kind"], obj["producer"], list(obj["rows"]), obj["cursor"],
                   list(obj["pending"]), obj.get("reason", ""), list(obj.get("groups", [])),
                   bool(obj.get("fenced", False)), obj.get("source", ""))


Draw = Callable[[Any, int], tuple[list[int], Any]]
"""``draw(cursor, n) -> (rows, cursor_after)``: the next ``n`` rows of the data order after
``cursor`` (None: the start)."""


class PromptLog:
    """The run's prompt log (``fleet/claims/``); see the module docstring."""

    def __init__(self, run_dir_url: str, storage_options: dict[str, Any] | None = None,
                 draw: Draw | None = None, start_cursor: Any = None, retry: RetryPolicy | None = None) -> None:
        self.files = _Files(run_dir_url, storage_options, retry)
        self.draw = draw
        self.start_cursor = start_cursor
        """The cursor before the first entry (a fresh run: None)."""
        self._entries: list[Claim] = []  # every entry read so far, by seq (the log has no gaps)

    def entries(self) -> list[Claim]:
        """Every entry of the log, oldest first (only new ones are read from storage)."""
        after = _ENTRY.format(self._entries[-1].seq) if self._entries else None
        for name in self.files.names("claims", after):
            if not (name.endswith(".json") and name[:-5].isdigit()):
                continue  # a temp file or a stray object
            obj = self.files.read(f"claims/{name}")
            self._entries.append(Claim.of(obj))
        return list(self._entries)

    def last(self) -> Claim | None:
        entries = self.entries()
        return entries[-1] if entries else None

    def claim(self, producer: str, n: int) -> Claim:
        """Take the next ``n`` prompts for ``producer``: released ones first, then new ones."""
        if self.draw is None:
            raise RuntimeError("this PromptLog has no draw function: it can release rows but not claim them")
        if not 0 < n < GROUP_STRIDE:
            raise ValueError(f"a claim takes 1 to {GROUP_STRIDE - 1} prompts, got {n}")

        def entry(last: Claim | None) -> Claim:
            if any(c.fenced and c.producer == producer for c in self._entries):  # what it took would be lost
                raise ProducerFenced(f"producer {producer} was declared dead by the trainer (prompt log entry of its "
                                     "fenced release); it claims nothing more")
            cursor = last.cursor if last is not None else self.start_cursor
            pending = list(last.pending) if last is not None else []
            rows, pending = pending[:n], pending[n:]
            if len(rows) < n:
                new, cursor = self.draw(cursor, n - len(rows))
                rows += new
            seq = last.seq + 1 if last is not None else 0
            return Claim(seq, "claim", producer, rows, cursor, pending)

        return self._append(entry)

    def release(self, rows: Iterable[int], reason: str, producer: str | None = None,
                groups: Iterable[int] | None = None) -> Claim | None:
        """Put ``rows`` back in the pool (claimed again before any new prompt); None if no rows.
        ``groups``: the group index each row had (what the audit follows; see ``ledger.py``)."""
        rows, groups = [int(r) for r in rows], [int(g) for g in groups or []]
        if groups and len(groups) != len(rows):
            raise ValueError(f"release: {len(rows)} rows but {len(groups)} group indices")
        if not rows:
            return None
        return self._append(lambda last: self._release_entry(last, rows, groups, reason, producer))

    def release_own(self, groups: dict[int, int], reason: str, producer: str) -> Claim | None:
        """A producer gives back prompts it claimed (group index -> row): nothing if the trainer
        already declared it dead (that release gave back everything it had not written)."""

        def entry(last: Claim | None) -> Claim | None:
            if self.released_dead(producer):
                return None
            return self._release_entry(last, list(groups.values()), list(groups), reason, producer)

        return self._append(entry) if groups else None

    def release_unwritten(self, producer: str, settled: set[int], reason: str) -> Claim | None:
        """The trainer declared ``producer`` dead: give back every prompt it claimed whose group is
        not in ``settled`` (written up to its fence) and that it did not give back itself (computed
        against the whole log before the entry, so a release of its own racing this one is seen)."""

        def entry(last: Claim | None) -> Claim | None:
            if self.released_dead(producer):
                return None
            done = set(settled)
            for c in self._entries:
                if c.producer == producer and c.kind in ("release", "filtered"):
                    done.update(c.groups)
            groups = {gi: row for gi, row in self.owned(producer).items() if gi not in done}
            release = self._release_entry(last, list(groups.values()), list(groups), reason, producer)
            release.fenced = True
            return release

        return self._append(entry)

    def released_dead(self, producer: str) -> bool:
        """Whether the trainer has given back what dead ``producer`` left (of the entries read so far)."""
        return any(c.fenced and c.producer == producer for c in self._entries)

    def owned(self, producer: str) -> dict[int, int]:
        """Group index -> row of every prompt ``producer`` took: its claims and what it adopted,
        less what others adopted from it (of the entries read so far)."""
        owned: dict[int, int] = {}
        for c in self._entries:
            if c.kind == "claim" and c.producer == producer:
                owned.update((c.group_index(i), row) for i, row in enumerate(c.rows))
            elif c.kind == "adopt" and c.producer == producer:
                owned.update(zip(c.groups, c.rows))
            elif c.kind == "adopt" and c.source == producer:
                for gi in c.groups:
                    owned.pop(gi, None)
        return owned

    def adoptable(self, producer: str, partial: set[int], written: set[int]) -> dict[int, int]:
        """Of the groups in fenced ``producer``'s partial stream (``partial``), those it still owns,
        did not write and did not give back: a new producer may continue them (``adopt``)."""
        self.entries()
        settled = set(written)
        for c in self._entries:
            if c.producer == producer and c.kind in ("release", "filtered"):
                settled.update(c.groups)
        return {gi: row for gi, row in self.owned(producer).items() if gi in partial and gi not in settled}

    def adopt(self, producer: str, groups: dict[int, int], source: str) -> Claim | None:
        """``producer`` takes over ``source``'s saved partial groups (group index -> row), to continue
        them under their own group indices; from now on they are its own (its fence gives them back)."""

        def entry(last: Claim | None) -> Claim:
            seq = last.seq + 1 if last is not None else 0
            cursor = last.cursor if last is not None else self.start_cursor
            return Claim(seq, "adopt", producer, list(groups.values()), cursor, list(last.pending) if last else [],
                         f"partial groups of producer {source}", list(groups), source=source)

        return self._append(entry) if groups else None

    def adopted_by(self, producer: str) -> list[Claim]:
        return [c for c in self.entries() if c.kind == "adopt" and c.producer == producer]

    def filtered(self, producer: str, group: int, row: int, reason: str) -> Claim:
        """A group a producer's dynamic filter dropped: settled, not back in the pool (the audit
        counts it as rejected by that filter)."""

        def entry(last: Claim | None) -> Claim:
            seq = last.seq + 1 if last is not None else 0
            cursor = last.cursor if last is not None else self.start_cursor
            return Claim(seq, "filtered", producer, [row], cursor, list(last.pending) if last else [], reason, [group])

        return self._append(entry)

    def _release_entry(self, last: Claim | None, rows: list[int], groups: list[int], reason: str,
                       producer: str | None) -> Claim:
        cursor = last.cursor if last is not None else self.start_cursor
        pending = (list(last.pending) if last is not None else []) + rows
        seq = last.seq + 1 if last is not None else 0
        return Claim(seq, "release", producer, rows, cursor, pending, reason, groups)

    def _append(self, make: Callable[[Claim | None], Claim | None]) -> Claim | None:
        while True:
            new = make(self.last())
            if new is None:
                return None
            try:
                self.files.create(f"claims/{_ENTRY.format(new.seq)}", new.to_json())
            except FileExistsError:
                continue  # another side appended this seq first: read it, then try the next one
            self._entries.append(new)
            return new


# ---------------------------------------------------------------------------------- control plane


class ProducerFenced(RuntimeError):
    """This producer was declared dead by the trainer; whatever it writes now is ignored."""


@dataclass
class Heartbeat:
    """What a producer last said about itself (``fleet/producers/<id>.json``)."""

    producer: str
    status: str
    """``starting``, ``running``, ``paused``, ``stopping`` (told to stop, settling what is in flight),
    ``stopped`` or ``failed``."""
    beat: int = 0
    """Incremented on every write: the trainer measures liveness by when it last changed."""
    weight_version: int = 0
    outstanding: int = 0
    """Groups this producer holds ahead of the trainer: in flight, unwritten, written but unread."""
    in_engine: int = 0
    paused_for: list[str] = field(default_factory=list)
    """Pause holders this producer has honoured (nothing of its is in the engine)."""
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    traceback: str | None = None
    host: str = ""
    pid: int = 0
    flow_run_id: str | None = None
    updated_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def of(cls, obj: dict[str, Any]) -> Heartbeat:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in obj.items() if k in known})


@dataclass
class Signals:
    """What the run folder tells producers: stop, who holds a pause, who is fenced."""

    stop: bool = False
    pause_holders: list[str] = field(default_factory=list)
    fenced: set[str] = field(default_factory=set)


class ControlPlane:
    """Heartbeats, stop, pause and fences of one run's fleet."""

    def __init__(self, run_dir_url: str, storage_options: dict[str, Any] | None = None,
                 retry: RetryPolicy | None = None) -> None:
        self.files = _Files(run_dir_url, storage_options, retry)

    # -- producers write
    def beat(self, hb: Heartbeat) -> None:
        hb.beat += 1
        hb.updated_at = time.time()
        hb.host, hb.pid = hb.host or socket.gethostname(), hb.pid or os.getpid()
        self.files.write(f"producers/{check_name('producer', hb.producer)}.json", hb.to_json())

    # -- either side reads
    def heartbeats(self) -> dict[str, Heartbeat]:
        names = [n for n in self.files.names("producers") if n.endswith(".json") and not n.startswith(".")]
        objs = self.files.read_many([f"producers/{n}" for n in names])
        return {n[:-5]: Heartbeat.of(obj) for n, obj in zip(names, objs) if obj is not None}

    def signals(self) -> Signals:
        """Stop, pause holders and fences in one listing of ``control/`` (what a producer polls)."""
        stop, holders, fenced = False, [], set()
        for rel in self.files.tree("control"):
            folder, _, name = rel.rpartition("/")
            if name.startswith(".") or not name.endswith(".json"):
                continue  # a temp file being written
            if rel == "stop.json":
                stop = True
            elif folder == "pause":
                holders.append(name[:-5])
            elif folder == "fence":
                fenced.add(name[:-5])
        return Signals(stop, sorted(holders), fenced)

    # -- the fleet's groups ahead of the trainer (the trainer writes it from the heartbeats it reads)
    def write_ahead(self, ahead: dict[str, int]) -> None:
        self.files.write("ahead.json", ahead)

    def ahead(self) -> dict[str, int]:
        return self.files.read("ahead.json") or {}

    def heartbeat(self, producer: str) -> Heartbeat | None:
        obj = self.files.read(f"producers/{producer}.json")
        return None if obj is None else Heartbeat.of(obj)

    # -- stop
    def request_stop(self, reason: str = "") -> None:
        self.files.write("control/stop.json", {"reason": reason, "at": time.time()})

    def stop_requested(self) -> bool:
        return self.files.exists("control/stop.json")

    def clear_stop(self) -> None:
        self.files.remove("control/stop.json")

    # -- pause (an evaluation borrows an engine)
    def pause(self, holder: str) -> None:
        self.files.write(f"control/pause/{check_name('pause holder', holder)}.json", {"at": time.time()})

    def unpause(self, holder: str) -> None:
        self.files.remove(f"control/pause/{holder}.json")

    def pause_holders(self) -> list[str]:
        return [n[:-5] for n in self.files.names("control/pause") if n.endswith(".json") and not n.startswith(".")]

    # -- fences (a producer declared dead)
    def fence(self, producer: str, last_offset: int, reason: str) -> None:
        self.files.write(f"control/fence/{check_name('producer', producer)}.json",
                         {"last_offset": last_offset, "reason": reason, "at": time.time()})

    def fence_of(self, producer: str) -> int | None:
        """The last offset of ``producer``'s stream the trainer reads, if it was fenced."""
        obj = self.files.read(f"control/fence/{producer}.json")
        return None if obj is None else int(obj["last_offset"])

    @property
    def url(self) -> str:
        return self.files.url("")


def recycle_to(log: PromptLog, groups) -> None:
    """Prompts of groups the trainer rejected (``unused_samples_handler = "retry"``) back to the pool."""
    log.release([g.samples[0].prompt_index for g in groups], reason=RECYCLED, groups=[g.group_index for g in groups])


def settle_earlier(monitor: FleetMonitor, base_stream, producers: list[str], heir: str) -> tuple[int, int]:
    """The producers of an earlier start of the run (stopped, or killed with it): fence each at what
    its stream holds (the trainer reads it up to there), hand the partial groups it saved at a clean
    stop to ``heir`` (``PromptLog.adopt``: the next producer continues them, keeping their group
    indices and what was generated), and give back every other prompt it claimed and did not write
    (in flight, queued). Returns (prompts given back, partial groups adopted). Safe to repeat after
    a crash half-way: a fence stays, and partial groups not yet adopted are adopted next time."""
    log, returned, adopted = monitor.log, 0, 0
    log.entries()
    for producer in producers:
        stream = base_stream.sibling(stream_name(producer))
        fence = monitor.fence_at(producer, last_offset(stream), "a producer of an earlier start of the run")
        partial_stream = base_stream.sibling(f"partial-{producer}")
        partial = written_groups(partial_stream, last_offset(partial_stream))
        keep = log.adoptable(producer, partial, written_groups(stream, fence)) if partial else {}
        dead = monitor.declare_dead(producer, "a producer of an earlier start of the run", fence, set(keep))
        returned += dead.released
        if keep:
            log.adopt(heir, keep, source=producer)
            adopted += len(keep)
    return returned, adopted


# ---------------------------------------------------------------------------------------- monitor


class ProducerFailed(RuntimeError):
    """A producer died and no restart is left; the message names it and its last error."""


@dataclass
class _Watched:
    producer: str
    launched_at: float
    beat: int = -1
    beat_seen_at: float = 0.0
    dead: str | None = None
    """Why it was declared dead (None: alive, as far as the trainer knows)."""
    last: Heartbeat | None = None
    released: int = 0
    """Prompts it claimed and never wrote, given back when it was declared dead."""


class FleetMonitor:
    """The trainer's view of the fleet: liveness, the streams to read, releasing a dead producer's
    unwritten prompts. ``poll()`` (rate-limited to ``poll_s``) reads the heartbeats and returns the
    producers found dead since the last poll, each already fenced and released; new producers that
    beat (one started by hand joins the run) are watched from then on."""

    def __init__(self, control: ControlPlane, log: PromptLog, written: Callable[[str, int], set[int]],
                 heartbeat_timeout_s: float, start_timeout_s: float = 300.0, poll_s: float = 0.5,
                 ended: Callable[[str], str | None] = lambda producer: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.control, self.log = control, log
        self.clock = clock
        self.written = written
        """``written(producer, last_offset)``: group indices in that producer's segments up to the offset."""
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.start_timeout_s = start_timeout_s
        self.poll_s = poll_s
        self.ended = ended
        """``ended(producer)``: why the launcher knows it ended (exit code, flow run state), or None."""
        self.watched: dict[str, _Watched] = {}
        self.fences: dict[str, int] = {}
        self.polls = 0
        """How many times ``poll`` read the heartbeats."""
        self._polled_at = 0.0

    def watch(self, producer: str) -> None:
        self.watched.setdefault(producer, _Watched(producer, self.clock()))

    @property
    def alive(self) -> list[str]:
        return sorted(p for p, w in self.watched.items() if w.dead is None)

    def producers(self) -> list[str]:
        """Every producer whose stream the trainer reads (the dead ones' up to their fence)."""
        return sorted(self.watched)

    def heartbeats(self) -> dict[str, Heartbeat]:
        return {p: w.last for p, w in self.watched.items() if w.last is not None}

    def poll(self, force: bool = False, last_offset: Callable[[str], int] = lambda p: -1) -> list[_Watched]:
        now = self.clock()
        if not force and now - self._polled_at < self.poll_s:
            return []
        self._polled_at = now
        self.polls += 1
        beats = self.control.heartbeats()
        blind = self.clock() - now
        if blind > self.poll_s:  # storage was slow or down for the trainer too: nobody could be seen meanwhile
            for w in self.watched.values():
                w.beat_seen_at += blind
                w.launched_at += blind
            now = self.clock()
        joined = [p for p in beats if p not in self.watched]
        if joined:
            fenced = self.control.signals().fenced
            for producer in joined:
                if producer not in fenced:
                    self.watch(producer)  # joined the run
        died = []
        for w in self.watched.values():
            if w.dead is not None:
                continue
            hb = beats.get(w.producer)
            if hb is not None and hb.beat != w.beat:
                w.beat, w.beat_seen_at, w.last = hb.beat, now, hb
            why = self._why_dead(w, hb, now)
            if why is not None:
                self._declare_dead(w, why, last_offset(w.producer))
                died.append(w)
        return died

    def _why_dead(self, w: _Watched, hb: Heartbeat | None, now: float) -> str | None:
        if hb is not None and hb.status == "failed":
            return f"it failed: {hb.error}"
        if hb is not None and hb.status == "stopped":
            return None
        ended = self.ended(w.producer)
        if ended is not None:
            return ended
        if hb is None:
            waited = now - w.launched_at
            return f"no heartbeat {waited:.0f} s after launch" if waited > self.start_timeout_s else None
        quiet = now - w.beat_seen_at
        if quiet > self.heartbeat_timeout_s:
            return f"no heartbeat for {quiet:.1f} s (timeout {self.heartbeat_timeout_s:g} s)"
        return None

    def declare_dead(self, producer: str, why: str, last_offset: int, keep: set[int] = frozenset()) -> _Watched:
        """Watch ``producer`` as dead from now on (a producer of an earlier start of the run);
        ``keep``: groups it claimed and did not write that are not given back (another producer
        adopts them)."""
        self.watch(producer)
        self._declare_dead(self.watched[producer], why, last_offset, keep)
        return self.watched[producer]

    def _declare_dead(self, w: _Watched, why: str, last_offset: int, keep: set[int] = frozenset()) -> None:
        """Fence it at what the trainer can see of its stream now (a fence written before stays:
        what it wrote after that was given back already), and release what it claimed and did not
        write there."""
        w.dead = why
        fence = self.fence_at(w.producer, last_offset, why)
        if self.log.released_dead(w.producer):  # done before (often by an earlier start): its stream is not read again
            w.released = 0
            return
        released = self.log.release_unwritten(w.producer, self.written(w.producer, fence) | set(keep),
                                              reason=f"producer {w.producer} died")
        w.released = len(released.rows) if released is not None else 0

    def fence_at(self, producer: str, last_offset: int, why: str) -> int:
        """``producer``'s fence: the one written before, else one at ``last_offset`` now."""
        fence = self.control.fence_of(producer)
        if fence is None:
            self.control.fence(producer, last_offset, why)
            fence = last_offset
        self.fences[producer] = fence
        return fence

    def describe(self, w: _Watched) -> str:
        """A dead producer, its reason and its last error with traceback (if it wrote one)."""
        text = f"rollout producer {w.producer} died: {w.dead}"
        hb = w.last
        if hb is not None and hb.host:
            text += f" (host {hb.host}, pid {hb.pid}" + (f", flow run {hb.flow_run_id}" if hb.flow_run_id else "") + ")"
        if hb is not None and hb.error and hb.error not in (w.dead or ""):
            text += f"; its last error: {hb.error}"
        if hb is not None and hb.traceback:
            text += "\n" + hb.traceback
        return text
