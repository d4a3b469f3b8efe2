"""DataSource: the cursor that hands out prompt rows, epoch after epoch, with a retry buffer.

``next_batch(n)`` serves rows pushed back with ``push_back`` first (e.g. the prompts of aborted
groups), then continues through the current epoch's order, crossing into the next epoch when
the dataset runs out. Each epoch's order is a deterministic function of (seed, epoch), so
``state()`` only records the epoch, the position in it and the retry buffer (row indices), and a
source restored with ``load_state`` serves exactly what the original would have.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from miles_core.data.datasets import PromptRow


class DataSource:
    """Batches of ``PromptRow``s over epochs. Rows are identified by ``row.index`` (unique)."""

    def __init__(self, rows: Sequence[PromptRow], seed: int = 0, shuffle: bool = True):
        if not rows:
            raise ValueError("DataSource needs at least one prompt row; the dataset is empty")
        self._rows = list(rows)
        self._by_index = {row.index: row for row in self._rows}
        if len(self._by_index) != len(self._rows):
            raise ValueError("DataSource rows must have unique indices (PromptRow.index)")
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._retry: deque[PromptRow] = deque()
        self._order: list[PromptRow] = self._order_of(0)

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def epoch(self) -> int:
        """Epoch of the next row served from the dataset (0-based)."""
        return self._epoch

    def next_batch(self, n: int) -> list[PromptRow]:
        """The next ``n`` rows: retry buffer first, then the epoch order (crossing epochs)."""
        if n < 0:
            raise ValueError(f"next_batch: n must be >= 0, got {n}")
        batch = []
        while len(batch) < n and self._retry:
            batch.append(self._retry.popleft())
        while len(batch) < n:
            take = min(n - len(batch), len(self._order) - self._position)
            batch.extend(self._order[self._position : self._position + take])
            self._position += take
            if self._position == len(self._order):  # roll over now, so `epoch` names the next row's
                self._epoch += 1
                self._position = 0
                self._order = self._order_of(self._epoch)
        return batch

    def push_back(self, rows: Iterable[PromptRow]) -> None:
        """Queue rows to be served again before any new row (in the order given)."""
        rows = list(rows)
        for row in rows:
            if row.index not in self._by_index:
                raise ValueError(f"push_back: no row with index {row.index} in this DataSource")
        self._retry.extend(self._by_index[row.index] for row in rows)

    def rows(self, indices: Iterable[int]) -> list[PromptRow]:
        """The rows with these indices, in the order given."""
        try:
            return [self._by_index[i] for i in indices]
        except KeyError as e:
            raise ValueError(f"no prompt row with index {e.args[0]} in this DataSource (a prompt log of "
                             "another dataset?)") from None

    def draw(self, cursor: dict[str, int] | None, n: int) -> tuple[list[int], dict[str, int]]:
        """The indices of the ``n`` rows of the epoch order after ``cursor`` (``{"epoch",
        "position"}``; None: the start), and the cursor after them. Pure: this source's own cursor
        does not move (a fleet's prompt log keeps the cursor; see ``rollout/fleet.py``)."""
        epoch, position = (0, 0) if cursor is None else (int(cursor["epoch"]), int(cursor["position"]))
        order = self._order if epoch == self._epoch else self._order_of(epoch)
        out = []
        while len(out) < n:
            take = min(n - len(out), len(order) - position)
            out += [row.index for row in order[position : position + take]]
            position += take
            if position == len(order):
                epoch, position = epoch + 1, 0
                order = self._order_of(epoch)
        return out, {"epoch": epoch, "position": position}

    def state(self) -> dict[str, Any]:
        """JSON-able cursor: epoch, position in the epoch, retry buffer (row indices)."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "retry": [row.index for row in self._retry],
            "num_rows": len(self._rows),
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def start_state(self) -> dict[str, Any]:
        """The ``state()`` of this source before it served anything."""
        return {"epoch": 0, "position": 0, "retry": [], "num_rows": len(self._rows), "seed": self.seed,
                "shuffle": self.shuffle}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a ``state()``; errors if it was saved for a different dataset or order."""
        saved = (state["num_rows"], state["seed"], state["shuffle"])
        if saved != (len(self._rows), self.seed, self.shuffle):
            raise ValueError(
                f"DataSource state was saved for (num_rows, seed, shuffle) = {saved}, but this source has "
                f"{(len(self._rows), self.seed, self.shuffle)}; resume with the same dataset and seed"
            )
        missing = [i for i in state["retry"] if i not in self._by_index]
        if missing or not 0 <= state["position"] < len(self._rows):
            raise ValueError(
                f"DataSource state does not fit this dataset (position {state['position']}, "
                f"unknown retry rows {missing[:5]}); resume with the same dataset"
            )
        self._epoch = state["epoch"]
        self._position = state["position"]
        self._retry = deque(self._by_index[i] for i in state["retry"])
        self._order = self._order_of(self._epoch)

    def _order_of(self, epoch: int) -> list[PromptRow]:
        order = list(self._rows)
        if self.shuffle:
            # A string seed is hashed (sha512) by random.Random: stable across runs and processes,
            # and (seed, epoch) pairs do not collide the way seed + epoch would.
            random.Random(f"miles-data:{self.seed}:{epoch}").shuffle(order)
        return order
