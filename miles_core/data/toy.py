"""The toy addition task: prompt ``"37+45="``, answer ``"82"`` (the model then emits ``<eos>``).

Problems are pairs ``(a, b)`` with ``0 <= a, b <= max_operand``. Every pair belongs to exactly one
split, fixed by a hash of the pair alone (not of the seed or the operand range):

- ``test`` (bucket 0-14 of 100, ~15 %): held-out problems for evaluation. They never appear in the
  warm-start corpus nor in the RL prompts, whatever the seed or ``max_operand``. Returned in a
  fixed order (by hash), so "the first N" is the same eval set for every seed.
- ``sft`` (buckets 15-39, ~25 %): the pool the built-in tiny model's supervised warm start draws
  from (``miles_core.models.tiny.warm_start``).
- ``train`` (buckets 40-99, ~60 %): the RL prompts.

With the default ``max_operand=99`` that is 1,448 test, 2,607 sft and 5,945 train problems. The
seed only chooses which problems of a split are returned, and their order.

Parts: ``toy_problems`` (rows ``{"prompt", "label"}``), ``toy_reward`` (exact match), ``toy_split``
(the split of one pair), ``carry_free_sum`` (the systematic mistake the tiny model's warm start
teaches on purpose, see ``miles_core.models.tiny``).
"""

from __future__ import annotations

import hashlib
import random
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from miles_core.config import ToyDataConfig

Split = Literal["train", "test", "sft"]

# Upper bounds (exclusive) of each split's hash buckets, out of 100.
_SPLIT_BUCKETS: tuple[tuple[Split, int], ...] = (("test", 15), ("sft", 40), ("train", 100))


def _hash(a: int, b: int) -> int:
    digest = hashlib.sha256(f"toy-addition:{a}+{b}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _bucket(a: int, b: int) -> int:
    return _hash(a, b) % 100


def toy_split(a: int, b: int) -> Split:
    """The split that owns the problem ``a+b=`` (the same for every config)."""
    bucket = _bucket(a, b)
    return next(name for name, upper in _SPLIT_BUCKETS if bucket < upper)


def _row(a: int, b: int) -> dict[str, str]:
    return {"prompt": f"{a}+{b}=", "label": str(a + b)}


def toy_problems(cfg: ToyDataConfig, split: Split, n: int | None = None) -> list[dict[str, str]]:
    """Problems of one split as rows ``{"prompt": "37+45=", "label": "82"}``, deterministic in ``cfg``.

    ``n`` is how many to return; None means ``cfg.num_prompts`` for ``train`` and the whole split for
    ``test`` and ``sft``. ``train`` and ``sft`` are a ``cfg.seed``-shuffled draw of their pool;
    ``test`` is always in the same (hash) order."""
    if split not in ("train", "test", "sft"):
        raise ValueError(f"toy_problems: split must be 'train', 'test' or 'sft', got {split!r}")
    pairs = [(a, b) for a in range(cfg.max_operand + 1) for b in range(cfg.max_operand + 1)]
    pool = sorted((p for p in pairs if toy_split(*p) == split), key=lambda p: _hash(*p))
    if split != "test":
        random.Random(f"{cfg.seed}:{split}").shuffle(pool)
    if n is None:
        n = cfg.num_prompts if split == "train" else len(pool)
    if not 0 <= n <= len(pool):
        raise ValueError(
            f"toy_problems: asked for {n} {split} problems but max_operand={cfg.max_operand} gives only "
            f"{len(pool)}; lower the count (data.num_prompts for train) or raise data.max_operand"
        )
    return [_row(a, b) for a, b in pool[:n]]


def carry_free_sum(a: int, b: int) -> int:
    """``a + b`` computed digit by digit with every carry forgotten: ``37+45`` gives ``72``, ``98+45``
    gives ``33``. The systematic mistake the built-in tiny model's warm start is taught on purpose."""
    total, place = 0, 1
    while a or b:
        total += (a % 10 + b % 10) % 10 * place
        a, b, place = a // 10, b // 10, place * 10
    return total


def toy_reward(response: str, label: str) -> float:
    """1.0 when the response, stripped of surrounding whitespace, is exactly the label, else 0.0."""
    return 1.0 if response.strip() == str(label).strip() else 0.0
