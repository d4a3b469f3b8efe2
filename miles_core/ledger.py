"""The prompt ledger: what became of every prompt of a run, written as the run goes, and its audit.

Two records, both in the run folder, neither reconstructed from logs:
- ``ledger/step-<k>.json``, written by the trainer with every training step: each group it trained
  (group index, prompt row, response tokens) and each group it rejected on the way (stale or
  aborted; dropped or recycled). A resumed run rewinds it with its checkpoint (the redone steps
  write their entries again).
- a fully-async run's prompt log (``fleet/claims/``, see ``rollout/fleet.py``): every prompt drawn
  (a claim), every prompt given back to the pool and why (a producer that stopped or died, a group
  the trainer recycled), and every group a producer's dynamic filter dropped.

``audit(run_dir)`` follows each prompt drawn (an *instance*: a fresh draw of the data order; a
prompt given back and claimed again is the same instance) through the groups it became and says
what became of it: trained at a step, dropped by the trainer, filtered by a producer, still in a
stream at the end (written, never read), in flight or saved as partial at the end, or given back
and not claimed again by the end. An instance trained twice, or one with no outcome at all, is a
problem; so is a group the trainer's cursor passed without using it. The token balance counts the
response tokens written to the streams: generated = trained + rejected + abandoned, exactly.

A sync or async run has no prompt log: its audit checks that every step has its entry, that no
group was trained twice, and the same balance over the segments the steps read (segments of redone
steps count as discarded by the resume).
"""

from __future__ import annotations

import json
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles_core.storage.fs import join, open_fs, read_bytes

if TYPE_CHECKING:
    from miles_core.rollout.buffer import Rejected
    from miles_core.storage.layout import RunLayout
    from miles_core.types import Group

LEDGER = "ledger"


def _tokens(group: Group) -> int:
    return sum(len(s.response_ids) for s in group.samples)


def _entry_name(step: int) -> str:
    return f"{LEDGER}/step-{step:06d}.json"


def rejection(r: Rejected, handled: str) -> list:
    """A rejected group as the ledger keeps it; ``handled``: ``dropped`` or ``recycled``."""
    return [r.group.group_index, r.group.samples[0].prompt_index, r.reason, handled, _tokens(r.group)]


def write_step(layout: RunLayout, step: int, version: int, trained: list[Group], rejected: list[list] = (),
               segment: int | None = None) -> None:
    """The ledger entry of training step ``step`` (1-based): the groups it trained, the groups
    rejected since the last entry (``rejection`` rows), and the segment a sync step read."""
    entry = {
        "step": step, "version": version, "segment": segment,
        "trained": [[g.group_index, g.samples[0].prompt_index, _tokens(g)] for g in trained],
        "rejected": list(rejected),
    }
    layout.write_json(_entry_name(step), entry)


def rewind(layout: RunLayout, step: int) -> None:
    """Remove the entries of steps after ``step`` (a run resumed from its checkpoint there)."""
    for k in sorted(_steps_in(layout.fs, join(layout.run_dir, LEDGER))):
        if k > step:
            layout.remove(_entry_name(k))


def _steps_in(fs, folder: str) -> list[int]:
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(folder, detail=False)]
    except FileNotFoundError:
        return []
    return sorted(int(n[5:-5]) for n in names if n.startswith("step-") and n.endswith(".json") and n[5:-5].isdigit())


# --------------------------------------------------------------------------------------- audit


@dataclass
class Audit:
    run_dir: str
    mode: str
    """``fleet`` (a fully-async run's prompt log) or ``steps`` (sync and async runs)."""
    steps: int = 0
    counts: Counter = field(default_factory=Counter)
    """Outcomes: of prompt instances (fleet), or of groups (steps)."""
    tokens: Counter = field(default_factory=Counter)
    """Response tokens: generated, trained, rejected, abandoned."""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        balance = self.tokens["generated"] - self.tokens["trained"] - self.tokens["rejected"] - self.tokens["abandoned"]
        return {"ok": self.ok, "mode": self.mode, "steps": self.steps, "counts": dict(sorted(self.counts.items())),
                "tokens": dict(self.tokens), "token_balance": balance, "problems": self.problems[:50],
                "num_problems": len(self.problems)}


def audit(run_dir: str, storage_options: dict[str, Any] | None = None, finished: bool | None = None) -> Audit:
    """Audit the run in ``run_dir`` (a path or URL); see the module docstring. ``finished``: whether
    the run is over (None: it is when it has ``summary.json``); a prompt still in flight in a
    finished run was lost."""
    fs, root = open_fs(run_dir, storage_options)
    if not fs.exists(join(root, "config.json")):
        raise FileNotFoundError(f"{run_dir}: no run here (no config.json); give the folder of a training run, "
                                "e.g. runs/<name>/<run id>")
    if finished is None:
        finished = fs.exists(join(root, "summary.json"))
    entries = [_read_json(fs, join(root, LEDGER, f"step-{k:06d}.json")) for k in _steps_in(fs, join(root, LEDGER))]
    if fs.exists(join(root, "fleet", "claims")):
        result = _audit_fleet(run_dir, storage_options, entries, finished)
    else:
        result = _audit_steps(run_dir, storage_options, entries)
    steps = [e["step"] for e in entries]
    result.steps = len(steps)
    if not steps and read_bytes(fs, join(root, "metrics.jsonl")):
        raise ValueError(f"{run_dir} has training steps but no prompt ledger (ledger/): it was trained by a version "
                         "that did not write one, so it cannot be audited")
    if steps != list(range(1, len(steps) + 1)):
        result.problems.append(f"ledger steps are not 1..{len(steps)}: {steps[:20]}")
    balance = result.to_json()["token_balance"]
    if balance:
        result.problems.append(f"token balance off by {balance}: generated {result.tokens['generated']} != trained "
                               f"{result.tokens['trained']} + rejected {result.tokens['rejected']} + abandoned "
                               f"{result.tokens['abandoned']}")
    return result


def _read_json(fs, path: str) -> Any:
    data = read_bytes(fs, path)
    if data is None:
        raise FileNotFoundError(path)
    try:
        return json.loads(data)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({len(data)} bytes): {e}") from e


def _trained_by_group(entries: list[dict[str, Any]], result: Audit) -> tuple[dict[int, int], dict[int, tuple]]:
    """Group index -> the step that trained it, and -> its rejection; a group trained twice is a problem."""
    trained: dict[int, int] = {}
    rejected: dict[int, tuple] = {}
    for e in entries:
        for gi, _row, tokens in e["trained"]:
            if gi in trained:
                result.problems.append(f"group {gi} trained twice: at steps {trained[gi]} and {e['step']}")
            trained[gi] = e["step"]
            result.tokens["trained"] += tokens
        for gi, _row, reason, handled, tokens in e["rejected"]:
            rejected[gi] = (reason, handled, tokens, e["step"])
    return trained, rejected


def _segments(stream) -> dict[int, list[tuple[int, int, int]]]:
    """Offset -> (group index, prompt row, response tokens) of each group in ``stream`` (a ``SampleStream``)."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for segment in stream.read():
        groups: dict[int, list[int]] = {}
        t = segment.table
        for gi, row, resp in zip(t.column("group_index").to_pylist(), t.column("prompt_index").to_pylist(),
                                 t.column("response_ids").to_pylist()):
            groups.setdefault(gi, [row, 0])[1] += len(resp)
        out[segment.offset] = [(gi, row, tokens) for gi, (row, tokens) in groups.items()]
    return out


def _audit_steps(run_dir: str, options, entries: list[dict[str, Any]]) -> Audit:
    from miles_core.storage import SampleStream

    result = Audit(run_dir, "steps")
    trained, rejected = _trained_by_group(entries, result)
    segments = _segments(SampleStream(run_dir, storage_options=options))
    read = {e["segment"]: e for e in entries if e.get("segment") is not None}
    for offset, groups in segments.items():
        for gi, _row, tokens in groups:
            result.tokens["generated"] += tokens
            if offset not in read:
                result.counts["discarded (a step redone after a resume)"] += 1
                result.tokens["abandoned"] += tokens
            elif gi in trained:
                result.counts["trained"] += 1
            elif gi in rejected:
                result.counts[f"rejected ({rejected[gi][0]})"] += 1
                result.tokens["rejected"] += tokens
            else:
                result.problems.append(f"group {gi} of segment {offset} (read by step {read[offset]['step']}) "
                                       "was neither trained nor rejected")
    return result


def _audit_fleet(run_dir: str, options, entries: list[dict[str, Any]], finished: bool) -> Audit:
    from miles_core.rollout.fleet import RECYCLED, ControlPlane, PromptLog, stream_name
    from miles_core.storage import SampleStream

    result = Audit(run_dir, "fleet")
    trained, rejected = _trained_by_group(entries, result)
    log = PromptLog(run_dir, options).entries()

    # replay the log: each group index belongs to a prompt instance; a release puts instances in the pool
    instance_of: dict[int, int] = {}
    claimed_by: dict[int, str] = {}
    settled: dict[int, str] = {}  # group index -> released / filtered, and why
    pool: deque[int] = deque()
    instances = 0
    for c in log:
        if c.kind == "claim":
            reclaimed = min(len(pool), len(c.rows))
            for i in range(len(c.rows)):
                if i < reclaimed:
                    inst = pool.popleft()
                else:
                    inst, instances = instances, instances + 1
                instance_of[c.group_index(i)] = inst
                claimed_by[c.group_index(i)] = c.producer or ""
        elif c.kind == "release":
            if len(c.groups) != len(c.rows):
                result.problems.append(f"prompt log entry {c.seq} releases rows without their group indices")
                continue
            for gi in c.groups:
                pool.append(instance_of[gi])
                settled[gi] = "recycled" if c.reason == RECYCLED else "released"
        elif c.kind == "filtered":
            for gi in c.groups:
                settled[gi] = f"filtered ({c.reason})"

    control = ControlPlane(run_dir, options)
    written: dict[int, tuple[int, bool]] = {}  # group index -> (tokens, at or below the trainer's cursor)
    partial: set[int] = set()
    base = SampleStream(run_dir, storage_options=options)
    for producer in sorted(set(claimed_by.values())):
        stream = base.sibling(stream_name(producer))
        cursor, fence = stream.reader("trainer").cursor, control.fence_of(producer)
        for offset, groups in _segments(stream).items():
            if fence is not None and offset > fence:
                continue  # written after it was declared dead: never read, its prompts were given back
            for gi, _row, tokens in groups:
                written[gi] = (tokens, offset <= cursor)
                result.tokens["generated"] += tokens
        for groups in _segments(base.sibling(f"partial-{producer}")).values():
            partial |= {gi for gi, _, _ in groups}

    outcome_of: dict[int, list[str]] = {}
    for gi, inst in instance_of.items():
        if gi in written:
            tokens, passed = written[gi]
            if gi in trained:
                what = "trained"
            elif settled.get(gi) == "recycled":
                what = "recycled"
                result.tokens["rejected"] += tokens
            elif gi in rejected:
                what = f"rejected ({rejected[gi][0]}, {rejected[gi][1]})"
                result.tokens["rejected"] += tokens
            elif passed and finished:
                what = "lost"
                result.problems.append(f"group {gi} (prompt row of instance {inst}) was written and the trainer's "
                                       "cursor passed it, but it was neither trained nor rejected")
                result.tokens["abandoned"] += tokens
            elif passed:  # rejected in the step that was going on (its entry comes with the step; a resume redoes it)
                what = "read by the trainer when the run stopped"
                result.tokens["abandoned"] += tokens
            else:
                what = "written, not read by the end"
                result.tokens["abandoned"] += tokens
        elif gi in settled:
            what = settled[gi]
        elif gi in partial:
            what = "saved as partial at the end"
        else:
            what = "in flight at the end"
        outcome_of.setdefault(inst, []).append(what)
    for inst, outcomes in sorted(outcome_of.items()):
        final = outcomes[-1]
        if outcomes.count("trained") > 1:
            result.problems.append(f"prompt instance {inst} was trained {outcomes.count('trained')} times")
        if final in ("released", "recycled"):  # the last thing that happened to it: it waits in the pool
            final = "in the pool at the end (given back, not claimed again)"
        elif final == "in flight at the end" and finished:
            final = "lost"
            result.problems.append(f"prompt instance {inst} was claimed, and its producer neither wrote it nor "
                                   "gave it back, in a run that finished")
        result.counts["trained" if "trained" in outcomes else final] += 1
    result.counts["prompts drawn"] = instances
    return result


def format_audit(a: Audit) -> str:
    """What ``miles audit`` prints."""
    j = a.to_json()
    lines = [f"audit of {a.run_dir}: {'OK' if a.ok else 'PROBLEMS'} ({j['steps']} steps in the ledger)"]
    for name, n in j["counts"].items():
        lines.append(f"  {name:<52} {n:>8}")
    t = a.tokens
    lines.append(f"  tokens: generated {t['generated']} = trained {t['trained']} + rejected {t['rejected']} + "
                 f"abandoned {t['abandoned']}" + ("" if not j["token_balance"] else f" (off by {j['token_balance']})"))
    lines += [f"  problem: {p}" for p in a.problems[:50]]
    if len(a.problems) > 50:
        lines.append(f"  ... and {len(a.problems) - 50} more problems")
    return "\n".join(lines)
