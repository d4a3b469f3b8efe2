"""Benchmark: the rewards' speed and the math reward's verdicts, against math-verify alone, in one run.

Run: ``.venv/bin/python bench/rewards.py [--gsm8k 400]``

Items (every one with the verdict a grader should give):
- GSM8K test (``datasets/gsm8k/test.jsonl``, the first ``--gsm8k`` rows): each gold solution against
  its own label (right) and against the next row's label (right only when the two answers agree);
- hand-written MATH-style answers: the cases of ``tests/unit/test_rewards.py`` (``CASES``,
  ``GRADER_CASES``: boxed, ``####``, "the answer is", last numbers, LaTeX labels with thin spaces,
  mixed numbers, lists, bases, pi, matrices), both right and wrong ones.

For each item: our ``math`` reward, and math-verify alone as its README uses it (``verify(parse(label),
parse(response))``, default extraction, in this process's main thread with its own time limits).
The table gives each one's agreement with the expected verdicts, calls/s, and p50/p99/max seconds
per call, with the ratio ours / math-verify; then the other built-in rewards' speed. Writes
``bench/results/rewards.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "unit"))


def items(n_gsm8k: int) -> list[tuple[str, str, float, str]]:
    """(response, label, expected reward, set) of every item."""
    from test_rewards import CASES, GRADER_CASES

    from miles_core.rewards.math import label_answer

    rows = [json.loads(line) for line in (REPO / "datasets" / "gsm8k" / "test.jsonl").open()][:n_gsm8k]
    out = []
    for i, row in enumerate(rows):
        other = rows[(i + 1) % len(rows)]
        out.append((row["answer"], row["answer"], 1.0, "gsm8k"))
        same = float(label_answer(row["answer"]) == label_answer(other["answer"]))
        out.append((row["answer"], other["answer"], same, "gsm8k"))
    out += [(r, label, e, "hand-written") for r, label, e in CASES + GRADER_CASES]
    return out


def math_verify_alone(response: str, label: str) -> float:
    from math_verify import parse, verify

    gold = label.rsplit("####", 1)[1].strip() if "####" in label else label  # GSM8K's answer line
    return 1.0 if verify(parse(f"${gold}$"), parse(response)) else 0.0


def timed(fn, args_list) -> tuple[list[float], list[float]]:
    values, seconds = [], []
    for args in args_list:
        t0 = time.perf_counter()
        values.append(fn(*args))
        seconds.append(time.perf_counter() - t0)
    return values, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gsm8k", type=int, default=400, help="GSM8K test rows (each gives two items)")
    args = parser.parse_args()
    logging_off()
    from miles_core.metrics import quantile
    from miles_core.rewards import get_reward
    from miles_core.rewards.math import math_reward
    from miles_core.types import Sample

    load = os.getloadavg()[0]
    data = items(args.gsm8k)
    pairs = [(r, label) for r, label, _, _ in data]
    math_reward("\\boxed{1}", "1")  # start the worker processes outside the timing
    ours, ours_s = timed(math_reward, pairs)
    alone, alone_s = timed(math_verify_alone, pairs)
    expected = [e for _, _, e, _ in data]
    lines = [f"{len(data)} items ({2 * args.gsm8k} GSM8K test, {len(data) - 2 * args.gsm8k} hand-written), one "
             f"process, load average {load:.2f} before and {os.getloadavg()[0]:.2f} after", "",
             "| verdicts and time per call | ours (`math`) | math-verify alone | ours / math-verify |",
             "|---|---:|---:|---:|"]
    for name in ("gsm8k", "hand-written"):
        idx = [i for i, (*_, s) in enumerate(data) if s == name]
        a = sum(ours[i] == expected[i] for i in idx) / len(idx)
        b = sum(alone[i] == expected[i] for i in idx) / len(idx)
        lines.append(f"| agreement with the expected verdict, {name} ({len(idx)}) | {a:.3f} | {b:.3f} | {a / b:.3f} |")
    for label, q in (("p50 s", 0.5), ("p99 s", 0.99), ("max s", 1.0)):
        a, b = quantile(ours_s, q), quantile(alone_s, q)
        lines.append(f"| {label} | {a:.4f} | {b:.4f} | {a / b:.2f} |")
    a, b = len(ours_s) / sum(ours_s), len(alone_s) / sum(alone_s)
    lines.append(f"| calls/s (one caller) | {a:.0f} | {b:.0f} | {a / b:.2f} |")
    misses = [(data[i][0][-60:], data[i][1][-30:], expected[i], ours[i]) for i in range(len(data)) if ours[i] != expected[i]]
    lines += ["", f"Our misses: {len(misses)}" + "".join(f"\n- response ...{r!r}, label {lab!r}: expected {e}, got {o}"
                                                          for r, lab, e, o in misses[:10])]
    samples = [Sample("q", [1], [2], r, label=label) for r, label in pairs[:200]]
    lines += ["", "| other rewards (200 calls) | calls/s | p50 s | max s |", "|---|---:|---:|---:|"]
    for name in ("format", "toy"):
        fn = get_reward(name)
        if name == "toy":
            samples_for = [Sample("q", [1], [2], "12", label="12")] * 200
        else:
            samples_for = samples
        _, secs = timed(fn, [(s,) for s in samples_for])
        lines.append(f"| {name} | {len(secs) / sum(secs):.0f} | {quantile(secs, 0.5):.5f} | {max(secs):.5f} |")
    text = "\n".join(lines)
    print(text)
    (REPO / "bench" / "results" / "rewards.md").write_text(
        f"`.venv/bin/python bench/rewards.py --gsm8k {args.gsm8k}`\n\n{text}\n")


def logging_off() -> None:
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)


if __name__ == "__main__":
    main()
