"""Write this folder's arithmetic prompts for a real instruction model, from the toy addition task's
problems (``miles_core.data.toy``: the same pairs and the same held-out split, never overlapping):

- ``train.jsonl`` / ``test.jsonl`` (``configs/smollm2-arith.toml``): two-digit sums asked in words,
  answered with a number: ``{"prompt": "What is 59 + 63? Reply with only the number.", "label": "122"}``;
- ``steps-train.jsonl`` / ``steps-test.jsonl`` (``configs/smollm2-steps.toml``, generation-heavy):
  sums up to 19 + 19 as a story, answered step by step in tens to hundreds of tokens:
  ``{"prompt": "Tom has 7 apples and gets 12 more. ... The answer is <number>.", "label": "19"}``.

Deterministic: ``python datasets/arith/make.py`` writes the same files every time.
"""

from __future__ import annotations

import json
from pathlib import Path

from miles_core.config import ToyDataConfig
from miles_core.data.toy import toy_problems, toy_split

SETS = {
    # file prefix: (template, max operand, {split: rows})
    "": ("What is {a} + {b}? Reply with only the number.", 99, {"train": 2400, "test": 200}),
    "steps-": ("Tom has {a} apples and gets {b} more. How many apples does he have now? Explain step by step, "
               "then end with: The answer is <number>.", 19, {"train": None, "test": None}),
}


def rows(template: str, max_operand: int, split: str, n: int | None) -> list[dict[str, str]]:
    """``n`` problems of ``split`` (None: all of them) in words."""
    if n is None:
        n = sum(toy_split(a, b) == split for a in range(max_operand + 1) for b in range(max_operand + 1))
    problems = toy_problems(ToyDataConfig(max_operand=max_operand, seed=1), split, n)
    out = []
    for p in problems:
        a, b = p["prompt"].rstrip("=").split("+")
        out.append({"prompt": template.format(a=a, b=b), "label": p["label"]})
    return out


def main() -> None:
    here = Path(__file__).parent
    for prefix, (template, max_operand, splits) in SETS.items():
        for split, n in splits.items():
            lines = [json.dumps(r) for r in rows(template, max_operand, split, n)]
            path = here / f"{prefix}{split}.jsonl"
            path.write_text("\n".join(lines) + "\n")
            print(f"{path}: {len(lines)} rows")


if __name__ == "__main__":
    main()
