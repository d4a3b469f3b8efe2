"""Math answer reward (registered as ``math`` and ``gsm8k``): 1.0 when the response's final answer
equals the label's, else 0.0.

Parts:
- ``extract_answer(text)``: the final answer of a response, found by the first kind of marker
  present, taking its last occurrence: ``#### 18``, ``\\boxed{18}``, "the answer is 18",
  "Answer: 18", "A: 18"; without any marker, the last number in the text. Numbers are normalised:
  thousands separators, ``$`` signs, ``%`` signs and trailing unit words are dropped (``"$1,234.00"``
  -> ``"1234"``, ``"18 apples"`` -> ``"18"``, ``"25%"`` -> ``"25"``: GSM8K labels give percentages
  as plain numbers). A marked answer that is not a plain number (``\\boxed{\\frac{\\sqrt3}{2}}``) is
  returned as written, for symbolic comparison.
- ``label_answer(label)``: the gold answer; a GSM8K solution's part after the last ``####``, or a
  plain label, normalised the same way.
- ``answers_match(gold, pred)``: numbers compare exactly as fractions (``"0.5" == "1/2"``) within
  an absolute 1e-6 (``0.333333`` matches ``1/3``); anything else goes to math-verify's
  ``verify(parse(gold), parse(pred))``.
- ``math_reward(response, label)``: the reward.

Rewards run in worker threads, where math-verify's signal-based timeouts cannot work, so they are
switched off; symbolic comparison is bounded instead by only ever handing math-verify the short
extracted answers (at most ``MAX_SYMBOLIC_CHARS``), and serialised by a lock because sympy's
caches are not meant for concurrent use. math-verify (and sympy) are imported on first symbolic use.
"""

from __future__ import annotations

import logging
import re
import threading
from fractions import Fraction

MAX_SYMBOLIC_CHARS = 300
"""Longer extracted answers are not handed to sympy (they score 0 unless equal as strings)."""
NUMERIC_TOLERANCE = Fraction(1, 10**6)

_INT = r"(?:\d{1,3}(?:,\d{3})+|\d+)"
_NUMBER = rf"(?:(?<![\w)\]}}])-)?(?<![\w.])(?:\d+\s*/\s*\d+(?![\d.,]\d)|{_INT}(?:\.\d+)?)"
_NUMBER_RE = re.compile(_NUMBER)
_LEADING_NUMBER_RE = re.compile(rf"\s*[:=]?\s*({_NUMBER})")
# What may follow a number for it to be the whole answer: nothing, sentence punctuation, or a unit
# word ("18 apples", "18cm", "5 a day"); "2x", "2^3" or "2 + 3" are expressions, not numbers.
_AFTER_NUMBER_RE = re.compile(r"\s*(?:$|[.,;:!?)\]](?!\d)|[A-Za-z]{2,}|(?<=\s)[A-Za-z]\b)")
_INLINE_MATH_RE = re.compile(r"\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.S)
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(\d+)\s*\}")
_MARKERS = {
    "hashes": re.compile(r"####\s*([^\n]*)"),
    "answer_is": re.compile(r"\banswer\s+is\s*:?\s*([^\n]*)", re.I),
    "answer_colon": re.compile(r"\banswer\s*:\s*([^\n]*)", re.I),
    "a_colon": re.compile(r"(?:^|(?<=\s))A:\s*([^\n]*)"),
}


def extract_answer(text: str) -> str | None:
    """The final answer of ``text`` (normalised number, or a symbolic expression), None if none."""
    text = text.replace("\u2212", "-")
    candidates = [("hashes", _last_marked(text, "hashes"))]
    candidates.append(("boxed", _last_boxed(text)))
    candidates += [(kind, _last_marked(text, kind)) for kind in ("answer_is", "answer_colon", "a_colon")]
    for kind, segment in candidates:
        if segment is not None:
            # "A:" often opens a whole worked solution, so only an answer right after it counts
            # (otherwise the last-number fallback below reads the solution's end).
            answer = _answer_from_segment(segment, boxed=kind == "boxed", search=kind != "a_colon")
            if answer is not None:
                return answer
    numbers = _NUMBER_RE.findall(_clean(text))
    for number in reversed(numbers):
        normalised = _normalise_number(number)
        if normalised is not None:
            return normalised
    return None


def label_answer(label: str) -> str | None:
    """The gold answer of a label: the part after the last ``####`` (GSM8K), or the whole label."""
    if "####" in label:
        label = label.rsplit("####", 1)[1]
    label = label.strip()
    if not label:
        return None
    return _answer_from_segment(label, boxed=True)


def answers_match(gold: str, pred: str) -> bool:
    """Numeric comparison when both are numbers, else math-verify's symbolic comparison."""
    gold_number, pred_number = _as_fraction(gold), _as_fraction(pred)
    if gold_number is not None and pred_number is not None:
        return abs(gold_number - pred_number) <= NUMERIC_TOLERANCE
    if gold.strip() == pred.strip():
        return True
    if len(gold) > MAX_SYMBOLIC_CHARS or len(pred) > MAX_SYMBOLIC_CHARS:
        return False
    return _symbolic_match(gold, pred)


def math_reward(response: str, label: str | None) -> float:
    """1.0 if the response's final answer equals the label's, else 0.0."""
    if label is None:
        raise ValueError("the math reward needs a label; set data.label_key to the answer field")
    gold = label_answer(label)
    if gold is None:
        raise ValueError(f"label {label[-80:]!r} has no answer after '####'")
    pred = extract_answer(response)
    return 1.0 if pred is not None and answers_match(gold, pred) else 0.0


# ------------------------------------------------------------------------------------ helpers


def _last_marked(text: str, kind: str) -> str | None:
    segments = [s for s in _MARKERS[kind].findall(text) if s.strip()]
    return segments[-1] if segments else None


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), with nested braces balanced."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                if text[start:i].strip():
                    return text[start:i]
                break
    return None


def _clean(text: str) -> str:
    """Drop LaTeX and currency noise around numbers; keep words (they may be units)."""
    text = _TEXT_CMD_RE.sub(r" \1 ", text)
    text = _FRAC_RE.sub(r"\1/\2", text)
    text = text.replace("{,}", ",")
    for noise in ("\\$", "\\%", "\\!", "\\,", "\\;", "\\ ", "$", "%"):
        text = text.replace(noise, " " if noise in ("\\,", "\\;", "\\ ") else "")
    return text


def _answer_from_segment(segment: str, boxed: bool, search: bool = True) -> str | None:
    """The answer in the text after a marker (or inside a box, or a whole label): a leading number;
    else a box's whole content; else (with ``search``) the first inline math or number in it."""
    leading = _leading_number(_clean(segment))
    if leading is not None:
        return leading
    if boxed:
        return segment.strip()
    if not search:
        return None
    math = _INLINE_MATH_RE.search(segment)
    if math is not None:
        chunk = next(g for g in math.groups() if g is not None)
        return _leading_number(_clean(chunk)) or chunk.strip()
    for number in _NUMBER_RE.findall(_clean(segment)):
        normalised = _normalise_number(number)
        if normalised is not None:
            return normalised
    return None


def _leading_number(text: str) -> str | None:
    """The number ``text`` starts with, if the rest is only punctuation or unit words."""
    m = _LEADING_NUMBER_RE.match(text)
    if m is None or not _AFTER_NUMBER_RE.match(text, m.end()):
        return None
    return _normalise_number(m.group(1))


def _normalise_number(number: str) -> str | None:
    compact = re.sub(r"[\s,]", "", number)
    try:
        value = Fraction(compact)
    except (ValueError, ZeroDivisionError):
        return None
    return str(value.numerator) if value.denominator == 1 else compact


def _as_fraction(answer: str) -> Fraction | None:
    try:
        return Fraction(answer.strip())
    except (ValueError, ZeroDivisionError):
        return None


# ---------------------------------------------------------------------------------- math-verify

_SYMBOLIC_LOCK = threading.Lock()


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its timeouts are off; here that is deliberate (see above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


def _symbolic_match(gold: str, pred: str) -> bool:
    from math_verify import parse, verify

    with _SYMBOLIC_LOCK:
        gold_parsed = parse(f"${gold}$", parsing_timeout=None)
        pred_parsed = parse(f"${pred}$", parsing_timeout=None)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
