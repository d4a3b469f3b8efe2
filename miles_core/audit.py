"""The audit of a run's prompt ledger (``miles_core.ledger``): what became of every prompt.

``audit(run_dir)`` follows each prompt drawn (an *instance*: a fresh draw of the data order; a
prompt given back and claimed again is the same instance) through the groups it became and says
what became of it: trained at a step, dropped by the trainer, filtered by a producer, still in a
stream at the end (written, never read), in flight or saved as partial at the end, or given back
and not claimed again by the end. An instance trained twice, or one with no outcome at all, is a
problem; so is a group the trainer's cursor passed without using it. The token balance counts the
response tokens written to the streams: generated = trained + rejected + abandoned, exactly.

A sync or async run has no prompt log: its audit checks that every step has its entry, that no
group was trained twice, and the same balance over the segments the steps read (segments of redone
steps count as discarded by the resume); and, from the prompt cursor each entry records, that every
step trained exactly the prompts its rollout drew and no prompt was trained twice in one epoch.

A multi-LoRA run has one prompt log and one ledger per adapter (``adapters/<name>/ledger/``): each
adapter is audited like a fully-async run's trainer, over its own cursors, for the groups that are
its own (every group with shared rollouts; with per-adapter rollouts, the groups it generated,
by each sample's ``adapter``; the others' outcome for it is "another adapter's").
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from miles_core.ledger import read_entries, read_json
from miles_core.storage.fs import join, open_fs, read_bytes


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
    adapters: dict[str, Audit] = field(default_factory=dict)
    """A multi-LoRA run: each adapter's own audit (its problems are also the run's, named)."""
    ledger_tokens: dict[int, int] = field(default_factory=dict, repr=False)
    """Each trained group's response tokens, as the ledger has them."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        out = {"ok": self.ok, "mode": self.mode, "counts": dict(sorted(self.counts.items())),
               "problems": self.problems[:50], "num_problems": len(self.problems)}
        if self.adapters:  # steps and tokens are each adapter's (a shared rollout's groups are every adapter's)
            out["adapters"] = {name: a.to_json() for name, a in self.adapters.items()}
        else:
            t = self.tokens
            out.update(steps=self.steps, tokens=dict(t),
                       token_balance=t["generated"] - t["trained"] - t["rejected"] - t["abandoned"])
        return out


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
    config = read_json(fs, join(root, "config.json"))
    multi_lora = config.get("multi_lora")
    if multi_lora:
        return _audit_multi_lora(run_dir, storage_options, fs, root, multi_lora, finished)
    entries = read_entries(fs, root)
    if fs.exists(join(root, "fleet", "claims")):
        result = _audit_fleet(run_dir, storage_options, entries, finished)
    else:
        result = _audit_steps(run_dir, storage_options, entries)
        if not (config.get("rollout") or {}).get("rollout_function_path"):  # ours draw exactly one batch a step
            _audit_epochs(result, entries)
    _check_entries(result, entries, fs, root)
    return result


def _check_entries(result: Audit, entries: list[dict[str, Any]], fs, folder: str) -> None:
    """Every step once, in order, and the token balance."""
    steps = [e["step"] for e in entries]
    result.steps = len(steps)
    if not steps and read_bytes(fs, join(folder, "metrics.jsonl")):
        raise ValueError(f"{folder} has training steps but no prompt ledger (ledger/): it was trained by a version "
                         "that did not write one, so it cannot be audited")
    if steps != list(range(1, len(steps) + 1)):
        result.problems.append(f"ledger steps are not 1..{len(steps)}: {steps[:20]}")
    balance = result.to_json()["token_balance"]
    if balance:
        result.problems.append(f"token balance off by {balance}: generated {result.tokens['generated']} != trained "
                               f"{result.tokens['trained']} + rejected {result.tokens['rejected']} + abandoned "
                               f"{result.tokens['abandoned']}")


def _audit_multi_lora(run_dir: str, options, fs, root: str, raw: dict[str, Any], finished: bool) -> Audit:
    """Each adapter of a multi-LoRA run audited over the run's prompt log and its own ledger."""
    from miles_core.config import MultiLoraConfig

    ml = MultiLoraConfig.model_validate(raw)
    names = ml.names
    result = Audit(run_dir, "multi_lora")
    for name in names:
        folder = join(root, "adapters", name)
        mine = name if ml.rollout_source == "per_adapter" else None  # each group is generated by the adapter it is for
        entries = read_entries(fs, folder)
        reader = f"adapter-{name}"  # its cursors' name (multi_lora.adapter_reader)
        a = _audit_fleet(run_dir, options, entries, finished, reader=reader, mine=mine)
        _check_entries(a, entries, fs, folder)
        result.adapters[name] = a
        result.problems += [f"adapter {name}: {p}" for p in a.problems]
        result.counts.update({f"{name}: {k}": n for k, n in a.counts.items()})
    return result


def _trained_by_group(entries: list[dict[str, Any]], result: Audit) -> tuple[dict[int, int], dict[int, tuple]]:
    """Group index -> the step that trained it, and -> its rejection; a group trained twice is a
    problem. ``result.ledger_tokens``: each trained group's response tokens."""
    trained: dict[int, int] = {}
    rejected: dict[int, tuple] = {}
    for e in entries:
        for gi, _row, tokens in e["trained"]:
            if gi in trained:
                result.problems.append(f"group {gi} trained twice: at steps {trained[gi]} and {e['step']}")
            trained[gi] = e["step"]
            result.ledger_tokens[gi] = tokens
            result.tokens["trained"] += tokens
        for gi, _row, reason, handled, tokens in e["rejected"]:
            rejected[gi] = (reason, handled, tokens, e["step"])
    return trained, rejected


def _segments(stream) -> dict[int, list[tuple[int, int, int, str | None]]]:
    """Offset -> (group index, prompt row, response tokens, adapter) of each group in ``stream`` (a ``SampleStream``)."""
    out: dict[int, list[tuple[int, int, int, str | None]]] = {}
    for segment in stream.read():
        groups: dict[int, list] = {}
        t = segment.table
        adapters = t.column("adapter").to_pylist() if "adapter" in t.column_names else [None] * t.num_rows
        for gi, row, resp, adapter in zip(t.column("group_index").to_pylist(), t.column("prompt_index").to_pylist(),
                                          t.column("response_ids").to_pylist(), adapters):
            groups.setdefault(gi, [row, 0, adapter])[1] += len(resp)
        out[segment.offset] = [(gi, row, tokens, adapter) for gi, (row, tokens, adapter) in groups.items()]
    return out


def _audit_steps(run_dir: str, options, entries: list[dict[str, Any]]) -> Audit:
    from miles_core.storage import SampleStream

    result = Audit(run_dir, "steps")
    trained, rejected = _trained_by_group(entries, result)
    stream = SampleStream(run_dir, storage_options=options)
    segments = _segments(stream)
    read = {e["segment"]: e for e in entries if e.get("segment") is not None}
    for offset in _count_set_aside(result, stream):  # damaged and moved aside: the ledger says what they held
        if offset in read:
            for gi, _row, tokens in read[offset]["trained"]:
                result.counts["trained"] += 1
                result.counts[SET_ASIDE_TRAINED] += 1
                result.tokens["generated"] += tokens
            for gi, _row, reason, _handled, tokens in read[offset]["rejected"]:
                result.counts[f"rejected ({reason}; their segment damaged and moved aside since)"] += 1
                result.tokens["generated"] += tokens
                result.tokens["rejected"] += tokens
    for offset, groups in segments.items():
        for gi, _row, tokens, _adapter in groups:
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


SET_ASIDE = "segments damaged and moved aside"
SET_ASIDE_TRAINED = "of those trained: groups whose segment was damaged and moved aside since"


def _count_set_aside(result: Audit, stream) -> list[int]:
    """The offsets of ``stream``'s segments moved aside as damaged (counted in ``result``)."""
    aside = stream.set_aside()
    if aside:
        result.counts[SET_ASIDE] += len(aside)
    return aside


def _audit_epochs(result: Audit, entries: list[dict[str, Any]]) -> None:
    """A sync or async run's prompts, epoch by epoch: each step trained exactly the prompts its
    rollout drew (the cursor moved by as many rows as it trained), and no prompt twice in an
    epoch, so every epoch the cursor finished had each prompt once. Steps drawn from a retry buffer
    are not checked (its rows are outside the epoch order)."""
    seen: dict[tuple[int, int], int] = {}  # (epoch, prompt row) -> the step that trained it
    epoch, position = 0, 0
    for e in entries:
        cursor = e.get("cursor")
        if cursor is None:  # written by a version without cursors: nothing to follow
            return
        rows = [row for _gi, row, _t in sorted(e["trained"])]  # by group index: the order they were drawn
        n = int(cursor["num_rows"])
        drawn = (int(cursor["epoch"]) - epoch) * n + int(cursor["position"]) - position
        if cursor.get("retry") or e.get("rejected"):
            epoch, position = int(cursor["epoch"]), int(cursor["position"])
            continue
        if drawn != len(rows):
            result.problems.append(f"step {e['step']}: the prompt cursor moved by {drawn} prompts (to epoch "
                                   f"{cursor['epoch']} position {cursor['position']}) but it trained {len(rows)}")
        for row in rows:
            if (epoch, row) in seen:
                result.problems.append(f"prompt row {row} trained twice in epoch {epoch}: at steps "
                                       f"{seen[(epoch, row)]} and {e['step']}")
            seen[(epoch, row)] = e["step"]
            position += 1
            if position == n:
                epoch, position = epoch + 1, 0
        epoch, position = int(cursor["epoch"]), int(cursor["position"])
    result.counts["epochs completed"] = epoch


def _audit_fleet(run_dir: str, options, entries: list[dict[str, Any]], finished: bool, reader: str = "trainer",
                 mine=None) -> Audit:
    """``reader``: the trainer's cursor name; ``mine``: the adapter whose groups that trainer
    trains (the others' written groups are "another adapter's"; None: every group)."""
    result = Audit(run_dir, "fleet")
    trained, rejected = _trained_by_group(entries, result)
    claims = _replay_prompt_log(run_dir, options, result)
    streams = _read_fleet_streams(run_dir, options, claims, reader, mine, result)
    outcome_of: dict[int, list[str]] = {}
    for gi, inst in claims.instance_of.items():
        what = _group_outcome(gi, inst, claims, streams, trained, rejected, finished, result)
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
    result.counts["prompts drawn"] = claims.instances
    return result


@dataclass
class _Claims:
    """The prompt log replayed: each group index belongs to a prompt instance (a release puts
    instances back in the pool, the next claim takes them first)."""

    instance_of: dict[int, int] = field(default_factory=dict)
    claimed_by: dict[int, str] = field(default_factory=dict)
    settled: dict[int, str] = field(default_factory=dict)  # group index -> released / filtered, and why
    instances: int = 0


def _replay_prompt_log(run_dir: str, options, result: Audit) -> _Claims:
    from miles_core.rollout.fleet import RECYCLED, PromptLog

    claims, pool = _Claims(), deque()
    for c in PromptLog(run_dir, options).entries():
        if c.kind == "claim":
            reclaimed = min(len(pool), len(c.rows))
            for i in range(len(c.rows)):
                if i < reclaimed:
                    inst = pool.popleft()
                else:
                    inst, claims.instances = claims.instances, claims.instances + 1
                claims.instance_of[c.group_index(i)] = inst
                claims.claimed_by[c.group_index(i)] = c.producer or ""
        elif c.kind == "release":
            if len(c.groups) != len(c.rows):
                result.problems.append(f"prompt log entry {c.seq} releases rows without their group indices")
                continue
            for gi in c.groups:
                pool.append(claims.instance_of[gi])
                claims.settled[gi] = "recycled" if c.reason == RECYCLED else "released"
        elif c.kind == "filtered":
            for gi in c.groups:
                claims.settled[gi] = f"filtered ({c.reason})"
        elif c.kind == "adopt":  # a producer of a later start continues this partial group: its stream has it
            for gi in c.groups:
                claims.claimed_by[gi] = c.producer or ""
    return claims


@dataclass
class _Written:
    """What the producers' streams hold, up to each one's fence."""

    groups: dict[int, tuple[int, bool]] = field(default_factory=dict)  # group -> (tokens, at or below the cursor)
    partial: set[int] = field(default_factory=set)
    others: set[int] = field(default_factory=set)  # written, by another adapter (per-adapter rollouts)


def _read_fleet_streams(run_dir: str, options, claims: _Claims, reader: str, mine, result: Audit) -> _Written:
    from miles_core.rollout.fleet import ControlPlane, stream_name
    from miles_core.storage import SampleStream

    control, written = ControlPlane(run_dir, options), _Written()
    base = SampleStream(run_dir, storage_options=options)
    for producer in sorted(set(claims.claimed_by.values())):
        stream = base.sibling(stream_name(producer))
        _count_set_aside(result, stream)
        cursor, fence = stream.reader(reader).cursor, control.fence_of(producer)
        for offset, groups in _segments(stream).items():
            if fence is not None and offset > fence:
                continue  # written after it was declared dead: never read, its prompts were given back
            for gi, _row, tokens, adapter in groups:
                if mine is not None and adapter != mine:
                    written.others.add(gi)
                    continue
                written.groups[gi] = (tokens, offset <= cursor)
                result.tokens["generated"] += tokens
        for groups in _segments(base.sibling(f"partial-{producer}")).values():
            written.partial |= {gi for gi, *_ in groups}
    return written


def _group_outcome(gi: int, inst: int, claims: _Claims, written: _Written, trained, rejected, finished: bool,
                   result: Audit) -> str:
    """What became of group ``gi`` (of prompt instance ``inst``); counts its tokens and problems."""
    settled = claims.settled
    if gi in written.others:
        return "another adapter's"
    if gi in written.groups:
        tokens, passed = written.groups[gi]
        if gi in trained:
            return "trained"
        if settled.get(gi) == "recycled":
            result.tokens["rejected"] += tokens
            return "recycled"
        if gi in rejected:
            result.tokens["rejected"] += tokens
            return f"rejected ({rejected[gi][0]}, {rejected[gi][1]})"
        result.tokens["abandoned"] += tokens
        if passed and finished:
            result.problems.append(f"group {gi} (prompt row of instance {inst}) was written and the trainer's "
                                   "cursor passed it, but it was neither trained nor rejected")
            return "lost"
        if passed:  # rejected in the step that was going on (its entry comes with the step; a resume redoes it)
            return "read by the trainer when the run stopped"
        return "written, not read by the end"
    if gi in trained:  # its segment was damaged and moved aside: the ledger says what it held
        result.counts[SET_ASIDE_TRAINED] += 1
        result.tokens["generated"] += result.ledger_tokens[gi]
        return "trained"
    if gi in rejected and not settled.get(gi):
        result.tokens["generated"] += rejected[gi][2]
        result.tokens["rejected"] += rejected[gi][2]
        return f"rejected ({rejected[gi][0]}, {rejected[gi][1]}; its segment damaged and moved aside since)"
    if gi in settled:
        return settled[gi]
    if gi in written.partial:
        return "saved as partial at the end"
    return "in flight at the end"


def audit_at_end(run_dir: str, storage_options: dict[str, Any] | None, log) -> dict[str, Any]:
    """A finished run's audit for its summary (``Audit.to_json``), logged with ``log`` (problems
    as errors). An audit that cannot be read is logged and returned as an error; it does not fail
    the run, which trained."""
    try:
        result = audit(run_dir, storage_options, finished=True)
    except Exception as e:  # noqa: BLE001 (the run trained: an audit that cannot be read must not fail it)
        log.error("the prompt ledger could not be audited (run `miles audit %s` again): %s: %s", run_dir,
                  type(e).__name__, e)
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:500], "counts": {}, "tokens": {}, "problems": [],
                "num_problems": 0}
    (log.info if result.ok else log.error)(format_audit(result))
    return result.to_json()


class AuditFailed(RuntimeError):
    """A finished run's prompt ledger does not balance: a prompt lost or trained twice."""


def raise_if_unbalanced(a: dict[str, Any], run_dir: str) -> None:
    """Fail a finished run whose end-of-run audit (``audit_at_end``) found problems, after its
    summary and files are written: it trained, but lost or duplicated prompts (an audit that could
    not be read does not fail it)."""
    if a.get("problems"):
        raise AuditFailed(f"the run's prompt ledger does not balance: {'; '.join(a['problems'][:3])} "
                          f"({a['num_problems']} problem(s); `miles audit {run_dir}` lists them)")


def audit_line(a: dict[str, Any]) -> str:
    """An ``audit_at_end`` result in one markdown line (the summary artifact's)."""
    if "error" in a:
        return f"**not audited**: {a['error']}"
    counts = ", ".join(f"{n} {name}" for name, n in a["counts"].items())
    head = "OK" if a["ok"] else f"**{a['num_problems']} problem(s)**: {'; '.join(a['problems'][:3])}"
    tokens = ("; ".join(f"{name}: {_token_sum(x['tokens'])}" for name, x in a["adapters"].items()) if "adapters" in a
              else _token_sum(a["tokens"]))
    return f"{head}; {counts}; tokens {tokens}"


def _token_sum(t: dict[str, int]) -> str:
    return (f"generated {t.get('generated', 0)} = trained {t.get('trained', 0)} + rejected {t.get('rejected', 0)} + "
            f"abandoned {t.get('abandoned', 0)}")


def format_audit(a: Audit) -> str:
    """What ``miles audit`` prints."""
    j = a.to_json()
    steps = (f"{j['steps']} steps in the ledger" if not a.adapters else
             "steps in the adapters' ledgers: " + ", ".join(f"{n} {x.steps}" for n, x in a.adapters.items()))
    lines = [f"audit of {a.run_dir}: {'OK' if a.ok else 'PROBLEMS'} ({steps})"]
    for name, n in j["counts"].items():
        lines.append(f"  {name:<52} {n:>8}")
    for name, x in ({f" of {n}": x for n, x in a.adapters.items()} or {"": a}).items():
        balance = x.to_json()["token_balance"]
        lines.append(f"  tokens{name}: {_token_sum(x.tokens)}" + ("" if not balance else f" (off by {balance})"))
    lines += [f"  problem: {p}" for p in a.problems[:50]]
    if len(a.problems) > 50:
        lines.append(f"  ... and {len(a.problems) - 50} more problems")
    return "\n".join(lines)
