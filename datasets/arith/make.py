"""Write this folder's arithmetic prompts for a real instruction model (``configs/smollm2-arith.toml``):
the toy addition task's problems (``miles_core.data.toy``: the same pairs, the same held-out split,
never overlapping), asked in words. Deterministic: ``python datasets/arith/make.py`` writes the same
files every time.

    {"prompt": "What is 59 + 63? Reply with only the number.", "label": "122"}
"""

from __future__ import annotations

import json
from pathlib import Path

from miles_core.config import ToyDataConfig
from miles_core.data.toy import toy_problems

TEMPLATE = "What is {a} + {b}? Reply with only the number."
SIZES = {"train": 2400, "test": 200}


def rows(split: str) -> list[dict[str, str]]:
    problems = toy_problems(ToyDataConfig(max_operand=99, seed=1), split, SIZES[split])
    out = []
    for p in problems:
        a, b = p["prompt"].rstrip("=").split("+")
        out.append({"prompt": TEMPLATE.format(a=a, b=b), "label": p["label"]})
    return out


if __name__ == "__main__":
    here = Path(__file__).parent
    for split in SIZES:
        lines = [json.dumps(r) for r in rows(split)]
        (here / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        print(f"{here / split}.jsonl: {len(lines)} rows")
