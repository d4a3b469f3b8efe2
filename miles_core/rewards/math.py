"""Math answer reward (registered as ``math`` and ``gsm8k``): 1.0 when the response's final answer
equals the label's, else 0.0.

math-verify (Hugging Face's answer verifier) parses and compares the answers (``parse`` with its
LaTeX and plain-expression extraction, ``verify``); this module only decides which part of a
response is its final answer. The first kind present wins, its last occurrence:

1. ``\\boxed{...}`` (or ``\\fbox{...}``);
2. GSM8K's marker as GSM8K writes it: a line that starts with ``#### `` and goes on with an answer
   (a number, a sign, ``$``, a fraction or LaTeX): ``#### 72``; a markdown heading such as
   ``#### Step 2`` is not one;
3. "the answer is ..." or "Answer: ...": the rest of that sentence;
4. the response's end (its last ``MAX_ANSWER_CHARS`` characters), as math-verify reads it (its own
   "final answer is" patterns, then the last LaTeX or plain expression, such as the last number).

The label: a GSM8K solution's answer is the text after its last ``#### `` line; any other label is
the answer as written, in LaTeX or plain (``11,\\! 111``, ``1\\frac{4}{5}``, ``1,-2``, ``40_9``).

- ``final_answer(text)``: the part of a response that is its final answer; ``marked_answer`` /
  ``marks_an_answer``: the one steps 1-3 find, if any (the ``format`` reward).
- ``math_reward(response, label)``: the reward. math-verify runs in a worker process of
  ``miles_core.rewards.isolated``, where its own time limits work (they use ``signal.alarm``, which
  only a process's main thread can): ``PARSE_TIMEOUT_S`` per parse, ``VERIFY_TIMEOUT_S`` per
  comparison; an answer that takes longer than that scores 0, and a worker that still does not
  answer within ``CALL_DEADLINE_S`` is killed (``WorkerTimeout``). No lock: two answers are
  verified side by side in two workers.
"""

from __future__ import annotations

import re

PARSE_TIMEOUT_S = 1
"""math-verify's limit on parsing one answer (whole seconds: ``signal.alarm``)."""
VERIFY_TIMEOUT_S = 1
"""math-verify's limit on one comparison of two parsed answers."""
CALL_DEADLINE_S = 10.0
"""A worker that has not answered by then is killed and the call raises ``WorkerTimeout``."""
MAX_ANSWER_CHARS = 1000
"""A marked final answer longer than this scores 0 (no sympy work on a wall of text); a response
without a marker is read from its last ``MAX_ANSWER_CHARS`` characters."""

_GSM8K_MARKER = re.compile(r"^#### +([-+$\\(.\d].*?)\s*$", re.M)
_ANSWER_IS = re.compile(r"\b(?:the\s+(?:final\s+)?answer\s+is|answer\s*:)\s*:?\s*(.+?)\s*$", re.I | re.M)
_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
_SENTENCE_END = re.compile(r"\.\s")


def marked_answer(text: str) -> str | None:
    """The answer ``text`` marks as final (module docstring, steps 1-3): a ``\\boxed{...}``, or the
    rest of a marker's line or sentence; None if it marks none."""
    text = text.replace("\u2212", "-")  # a unicode minus
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    for marker in (_GSM8K_MARKER, _ANSWER_IS):
        found = [m.group(1) for m in marker.finditer(text) if m.group(1).strip()]
        if found:  # the marker's sentence: "The answer is 18. Check: 20 - 2 = 18" is 18
            return _SENTENCE_END.split(found[-1], 1)[0].rstrip(".")
    return None


def final_answer(text: str) -> str:
    """The part of ``text`` math-verify reads as its final answer: the marked one, else the text's end
    (step 4: its last ``MAX_ANSWER_CHARS`` characters)."""
    marked = marked_answer(text)
    return marked if marked is not None else text.replace("\u2212", "-")[-MAX_ANSWER_CHARS:]


def marks_an_answer(text: str) -> bool:
    """Whether ``text`` states its final answer in a form the math reward reads as one (steps 1-3:
    a box, GSM8K's marker, "the answer is"), rather than leaving it to be found (step 4)."""
    return marked_answer(text) is not None


def label_answer(label: str) -> str:
    """A label's answer: after a GSM8K solution's last ``#### `` line, else the whole label."""
    found = _GSM8K_MARKER.findall(label)
    if found:
        return found[-1]
    if re.search(r"^####", label, re.M):
        raise ValueError(f"label {label[-80:]!r} has no answer after '####'")
    if not label.strip():
        raise ValueError("the label is empty")
    return label.strip()


def math_reward(response: str, label: str | None) -> float:
    """1.0 if the response's final answer equals the label's (math-verify), else 0.0."""
    from miles_core.rewards.isolated import call

    if label is None:
        raise ValueError("the math reward needs a label; set data.label_key to the answer field")
    gold = label_answer(label)
    pred = final_answer(response)
    if not pred.strip() or len(pred) > MAX_ANSWER_CHARS:
        return 0.0
    return 1.0 if call(verify_answers, gold, pred, deadline_s=CALL_DEADLINE_S) else 0.0


def verify_answers(gold: str, pred: str) -> bool:
    """In a worker process's main thread: math-verify's verdict on the two answers (``final_answer``
    parts), each parsed as LaTeX or a plain expression, within its own time limits."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    gold_parsed = parse(f"${gold}$", configs, parsing_timeout=PARSE_TIMEOUT_S) or parse(
        gold, configs, parsing_timeout=PARSE_TIMEOUT_S)
    pred_parsed = parse(pred, configs, parsing_timeout=PARSE_TIMEOUT_S)
    if not pred_parsed and not pred.lstrip().startswith(("$", "\\")):
        pred_parsed = parse(f"${pred}$", configs, parsing_timeout=PARSE_TIMEOUT_S)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=VERIFY_TIMEOUT_S))


def _last_boxed(text: str) -> str | None:
    """The last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text``, braces balanced, with its content."""
    for m in reversed(list(_BOX_START.finditer(text))):
        depth = 1
        for i in range(m.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                if text[m.end():i].strip():
                    return "\\boxed{" + text[m.end():i] + "}"
                break
    return None
