"""The prompt ledger: what became of every prompt of a run, written as the run goes
(``miles_core.audit`` reads it back and checks it).

Two records, both in the run folder, neither reconstructed from logs:
- ``ledger/step-<k>.json``, written by the trainer with every training step: each group it trained
  (group index, prompt row, response tokens) and each group it rejected on the way (stale or
  aborted; dropped or recycled). A resumed run rewinds it with its checkpoint (the redone steps
  write their entries again).
- a fully-async run's prompt log (``fleet/claims/``, see ``rollout/fleet.py``): every prompt drawn
  (a claim), every prompt given back to the pool and why (a producer that stopped or died, a group
  the trainer recycled), every group a producer's dynamic filter dropped, and every partial group a
  producer of a later start took over (adopt).

A multi-LoRA run has one prompt log and one ledger per adapter (``adapters/<name>/ledger/``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from miles_core.storage.fs import join, list_names, open_fs, read_bytes

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
               segment: int | None = None, cursor: dict[str, Any] | None = None) -> None:
    """The ledger entry of training step ``step`` (1-based): the groups it trained, the groups
    rejected since the last entry (``rejection`` rows); a sync or async step: the segment it read
    and the prompt cursor after its rollout drew (``DataSource.state()``: epoch, position, rows)."""
    entry = {
        "step": step, "version": version, "segment": segment,
        "trained": [[g.group_index, g.samples[0].prompt_index, _tokens(g)] for g in trained],
        "rejected": list(rejected),
    }
    if cursor:
        entry["cursor"] = {k: cursor[k] for k in ("epoch", "position", "num_rows", "retry") if k in cursor}
    layout.write_json(_entry_name(step), entry)


def rewind(layout: RunLayout, step: int) -> None:
    """Remove the entries of steps after ``step`` (a run resumed from its checkpoint there)."""
    for k in sorted(_steps_in(layout.fs, join(layout.run_dir, LEDGER))):
        if k > step:
            layout.remove(_entry_name(k))


def used_groups(run_dir: str, storage_options: dict[str, Any] | None = None) -> set[int]:
    """The group indices the run's ledger says its trainer trained or rejected (a fully-async
    run's: what a resume must not generate again, even when the segment that held it is gone)."""
    fs, root = open_fs(run_dir, storage_options)
    used: set[int] = set()
    for e in read_entries(fs, root):
        used.update(row[0] for row in e["trained"])
        used.update(row[0] for row in e["rejected"])
    return used


def _steps_in(fs, folder: str) -> list[int]:
    names = list_names(fs, folder)
    return sorted(int(n[5:-5]) for n in names if n.startswith("step-") and n.endswith(".json") and n[5:-5].isdigit())


def read_entries(fs, folder: str) -> list[dict[str, Any]]:
    """The ledger entries under ``folder`` (a run's, or a multi-LoRA adapter's), by step."""
    return [read_json(fs, join(folder, LEDGER, f"step-{k:06d}.json")) for k in _steps_in(fs, join(folder, LEDGER))]


def read_json(fs, path: str) -> Any:
    data = read_bytes(fs, path)
    if data is None:
        raise FileNotFoundError(path)
    try:
        return json.loads(data)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({len(data)} bytes): {e}") from e
