"""The math / GSM8K answer reward, the reward registry, and the score_groups driver."""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import operator
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from waiting import wait_for

from miles_core import processes
from miles_core.rewards import get_reward, group_reward, register_reward, score_groups
from miles_core.rewards.math import final_answer, label_answer, math_reward
from miles_core.types import Group, Sample, SampleStatus

REPO = Path(__file__).resolve().parents[2]
GSM8K_DIR = Path(os.environ.get("MILES_GSM8K_DIR", REPO / "datasets" / "gsm8k"))

# ------------------------------------------------------------------------------- math reward

# (response, label, expected reward)
CASES = [
    ("#### 18", "18", 1.0),
    ("She pays 9 * 2 = 18 dollars.\n#### 18", "Janet pays 9*2=<<9*2=18>>18\n#### 18", 1.0),
    ("so the total is \\boxed{18}.", "18", 1.0),
    ("The answer is 18", "18", 1.0),
    ("The answer is: $18", "18", 1.0),
    ("Q: how many?\nA: 18", "18", 1.0),
    ("Answer: 18", "18", 1.0),
    ("The final answer is 1,234.", "1234", 1.0),
    ("#### 1234", "1,234", 1.0),
    ("The answer is 18 dollars.", "18", 1.0),
    ("The answer is 18 apples", "18", 1.0),
    ("The answer is $18.00.", "18", 1.0),
    ("The answer is 25%.", "25", 1.0),  # percent signs are dropped: GSM8K labels percentages plainly
    ("\\boxed{18\\text{ dollars}}", "18", 1.0),
    ("The temperature fell to -7 degrees. The answer is -7.", "-7", 1.0),
    ("\\boxed{-1{,}000}", "-1000", 1.0),
    ("The answer is 0.5", "1/2", 1.0),
    ("The answer is $\\frac{1}{2}$", "0.5", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),  # symbolic, through math-verify
    ("\\boxed{1 + x^2}", "x^2+1", 1.0),
    ("First 3 * 6 = 18, then 18 + 2 = 20 marbles in total.", "20", 1.0),  # last number fallback
    ("He has 48/2 = <<48/2=24>>24 clips", "24", 1.0),
    ("I think it is 3.5 hours", "3.5", 1.0),
    # wrong answers
    ("#### 17", "18", 0.0),
    ("The answer is 18", "19", 0.0),
    ("\\boxed{18}", "1.8", 0.0),
    ("The answer is -7.", "7", 0.0),
    ("The answer is 1,234.", "1243", 0.0),
    ("\\boxed{\\frac{\\sqrt{3}}{3}}", "\\frac{\\sqrt3}{2}", 0.0),
    ("I don't know.", "18", 0.0),
    ("", "18", 0.0),
    # the marked answer wins over numbers written after it, and the last marker wins
    ("The answer is 18. Check: 20 - 2 = 18, and 5 more gives 23", "18", 1.0),
    ("The answer is 17.\nWait, recomputing.\nThe answer is 18.", "18", 1.0),
    ("#### 18\nThe answer is 17", "18", 1.0),
]


@pytest.mark.parametrize(("response", "label", "expected"), CASES)
def test_math_reward(response, label, expected):
    assert math_reward(response, label) == expected


# Where the hand-written answer layer this reward replaced went wrong (issue cases): a markdown
# heading read as GSM8K's marker, LaTeX thin spaces, mixed numbers, lists, bases, pi, display math.
GRADER_CASES = [
    ("#### Step 2\nAdding gives \\boxed{3}.", "3", 1.0),
    ("#### Case 3\nSo the count is \\boxed{5}.", "3", 0.0),
    ("\\boxed{11111111100}", "11,\\! 111,\\! 111,\\! 100", 1.0),
    ("\\boxed{11}", "11,\\! 111,\\! 111,\\! 100", 0.0),
    ("\\boxed{137.5}", "137\\frac{1}{2}", 1.0),
    ("\\boxed{1371/2}", "137\\frac{1}{2}", 0.0),
    ("\\boxed{\\frac{9}{5}}", "1\\frac{4}{5}", 1.0),
    ("\\boxed{14/5}", "1\\frac{4}{5}", 0.0),
    ("\\boxed{-2, 1}", "1,-2", 1.0),
    ("\\boxed{1, 5}", "1,-2", 0.0),
    ("\\boxed{1}", "1,-2", 0.0),
    ("\\boxed{40_9}", "40_9", 1.0),
    ("\\boxed{409}", "40_9", 0.0),
    ("\\boxed{12 \\pi}", "12\\pi", 1.0),
    ("\\boxed{12}", "12\\pi", 0.0),
    ("\\boxed{\\[-50\\]}", "-50", 1.0),
    ("The angle measures $30^\\circ$.", "30", 1.0),
    ("\\boxed{\\begin{pmatrix} \\dfrac{1}{2} \\\\ 3 \\end{pmatrix}}", "\\begin{pmatrix} \\frac12 \\\\ 3 \\end{pmatrix}", 1.0),
    ("\\boxed{\\begin{pmatrix} \\dfrac{1}{3} \\\\ 3 \\end{pmatrix}}", "\\begin{pmatrix} \\frac12 \\\\ 3 \\end{pmatrix}", 0.0),
]


@pytest.mark.parametrize(("response", "label", "expected"), GRADER_CASES)
def test_math_reward_where_hand_written_rules_went_wrong(response, label, expected):
    assert math_reward(response, label) == expected


def test_final_answer_picks_box_then_gsm8k_marker_then_answer_is_then_the_whole_text():
    assert final_answer("#### 18\nThe answer is 17. \\boxed{16}") == "\\boxed{16}"
    assert final_answer("#### 18\nThe answer is 17") == "18"
    assert final_answer("#### Step 1\nThe answer is 17. Check: 3 + 4 = 7") == "17"
    assert final_answer("The answer is \u22125") == "-5"  # unicode minus
    assert final_answer("no marker, 3 + 4 = 7") == "no marker, 3 + 4 = 7"  # math-verify reads it
    long = "Let me think. " * 200 + "So 3 + 4 = 7"
    assert final_answer(long) == long[-1000:] and math_reward(long, "7") == 1.0  # the end of a long answer
    assert label_answer("Some steps.\n#### 72") == "72"
    assert label_answer("11,\\! 111") == "11,\\! 111"


# The same answers written in other ways: a formatting change never changes a verdict.
def _spellings(answer: str) -> list[str]:
    return [answer, f" {answer} ", f"${answer}$", f"\\left( {answer} \\right)" if answer.startswith("(") else answer,
            answer.replace("\\frac", "\\dfrac"), answer.replace(",", ",\\!"), answer.replace(" ", "")]


@pytest.mark.parametrize(("label", "right", "wrong"), [
    ("\\frac{3}{4}", "\\frac{3}{4}", "\\frac{4}{3}"),
    ("1,234", "1,234", "1,243"),
    ("2\\sqrt{2}", "2 \\sqrt{2}", "2 \\sqrt{3}"),
    ("(1, 2)", "(1, 2)", "(2, 1)"),
])
def test_formatting_never_changes_a_verdict(label, right, wrong):
    for spelled in _spellings(right):
        assert math_reward(f"So \\boxed{{{spelled}}}.", label) == 1.0, spelled
    for spelled in _spellings(wrong):
        assert math_reward(f"So \\boxed{{{spelled}}}.", label) == 0.0, spelled


def test_math_reward_needs_a_label():
    with pytest.raises(ValueError, match="needs a label"):
        math_reward("#### 1", None)
    with pytest.raises(ValueError, match="no answer after '####'"):
        math_reward("#### 1", "steps\n####   ")
    with pytest.raises(ValueError, match="the label is empty"):
        math_reward("#### 1", "  ")


def _gsm8k_rows(n: int) -> list[dict]:
    with (GSM8K_DIR / "train.jsonl").open() as f:
        return [json.loads(next(f)) for _ in range(n)]


def test_the_gsm8k_test_split_scores_against_its_own_labels():
    """Every gold solution of the test split (1,319; about 3 s) scores 1 against its own label, and
    its neighbour's solution scores 0 unless the two answers are the same."""
    rows = [json.loads(line) for line in (GSM8K_DIR / "test.jsonl").read_text().splitlines()]
    assert len(rows) == 1319
    wrong = []
    for i, row in enumerate(rows):
        other = rows[(i + 1) % len(rows)]
        same = label_answer(row["answer"]) == label_answer(other["answer"])
        if (math_reward(row["answer"], row["answer"]), math_reward(other["answer"], row["answer"])) != (1.0, float(same)):
            wrong.append(i)
    assert not wrong, f"rows {wrong[:10]} ({len(wrong)} in all)"


def test_gsm8k_first_labels_with_typical_responses():
    labels = [r["answer"] for r in _gsm8k_rows(3)]  # answers 72, 10, 5
    assert math_reward("Natalia sold 72 clips in total. The answer is 72.", labels[0]) == 1.0
    assert math_reward("She earned $10.00.\n#### $10", labels[1]) == 1.0
    assert math_reward("Betty needs \\boxed{5} more dollars.", labels[2]) == 1.0
    assert math_reward("Betty needs \\boxed{15} more dollars.", labels[2]) == 0.0


def test_math_reward_runs_in_a_worker_thread():
    # math-verify's signal-based time limits work only in a main thread: it runs in a worker process's
    assert asyncio.run(asyncio.to_thread(math_reward, "\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}")) == 1.0


# ---------------------------------------------------------------------------------- registry


def sample(response: str, label: str | None = "18", status=SampleStatus.COMPLETED, g: int = 0, i: int = 0) -> Sample:
    return Sample(
        prompt="q", prompt_ids=[1], response=response, label=label, status=status, group_index=g, sample_index=i
    )


def groups_of(*responses_per_group: list[str]) -> list[Group]:
    return [Group([sample(r, g=g, i=i) for i, r in enumerate(rs)]) for g, rs in enumerate(responses_per_group)]


def test_builtin_names():
    assert get_reward("math") is get_reward("gsm8k")
    assert get_reward("math")(sample("#### 18")) == 1.0
    assert callable(get_reward("toy"))


def test_toy_builtin_scores_exact_match():
    toy = get_reward("toy")
    assert toy(sample(" 82 ", label="82")) == 1.0
    assert toy(sample("81", label="82")) == 0.0


def test_unknown_name_lists_registered_rewards():
    with pytest.raises(ValueError, match=r"unknown reward 'gsm9k'.*format, gsm8k, math, remote, toy.*'package.module:function'"):
        get_reward("gsm9k")


def test_custom_module_function_spec(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text("def length(sample):\n    return float(len(sample.response))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward("my_rewards_mod:length")
    assert fn(sample("abc")) == 3.0
    with pytest.raises(ValueError, match=r"'my_rewards_mod:nope': module 'my_rewards_mod' has no attribute 'nope'"):
        get_reward("my_rewards_mod:nope")


def test_custom_spec_import_error_names_spec_and_fix():
    with pytest.raises(ValueError, match=r"'no_such_pkg\.mod:fn': cannot import module 'no_such_pkg\.mod'.*PYTHONPATH"):
        get_reward("no_such_pkg.mod:fn")


def test_register_reward_decorator():
    @register_reward("test-always-half")
    def half(sample: Sample) -> float:
        return 0.5

    assert get_reward("test-always-half") is half


# ------------------------------------------------------------------------------------ driver


def test_sync_reward_runs_off_the_event_loop_thread():
    seen = set()

    def fn(s: Sample) -> float:
        seen.add(threading.get_ident())
        return 1.0 if s.response == "#### 18" else 0.0

    groups = groups_of(["#### 18", "#### 3"], ["#### 18"])
    stats = asyncio.run(score_groups(fn, groups))
    assert (stats.scored, stats.failed, stats.skipped, stats.errors) == (3, 0, 0, [])
    assert len(stats.call_seconds) == 3 and set(stats.seconds_metrics()) == {
        "reward_seconds_p50", "reward_seconds_p99", "reward_seconds_max"}
    assert [g.rewards for g in groups] == [[1.0, 0.0], [1.0]]
    assert threading.get_ident() not in seen


def test_async_reward():
    async def fn(s: Sample) -> float:
        return float(await asyncio.to_thread(len, s.response))

    groups = groups_of(["ab", "abc"])
    stats = asyncio.run(score_groups(fn, groups))
    assert stats.scored == 2 and groups[0].rewards == [2.0, 3.0]


def test_per_group_reward_sync_and_async():
    @group_reward
    def rank(samples: list[Sample]) -> list[float]:
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].response))
        return [float(order.index(i)) for i in range(len(samples))]

    @group_reward
    async def count(samples: list[Sample]) -> list[float]:
        return [float(len(samples))] * len(samples)

    groups = groups_of(["ccc", "a", "bb"])
    assert asyncio.run(score_groups(rank, groups)).scored == 3
    assert groups[0].rewards == [2.0, 0.0, 1.0]
    assert asyncio.run(score_groups(count, groups)).scored == 3
    assert groups[0].rewards == [3.0, 3.0, 3.0]


def test_raising_reward_fails_only_that_sample_and_is_counted():
    def fn(s: Sample) -> float:
        if s.response == "bad":
            raise ZeroDivisionError("division by zero")
        return 1.0

    groups = groups_of(["ok", "bad"], ["bad", "ok"])
    stats = asyncio.run(score_groups(fn, groups))  # does not raise
    assert (stats.scored, stats.failed) == (2, 2)
    bad = groups[0].samples[1]
    assert (bad.status, bad.reward) == (SampleStatus.FAILED, None)
    assert bad.error == "reward: ZeroDivisionError: division by zero"
    assert stats.errors == [
        "group 0 sample 1: reward: ZeroDivisionError: division by zero",
        "group 1 sample 0: reward: ZeroDivisionError: division by zero",
    ]
    assert groups[0].samples[0].status is SampleStatus.COMPLETED


def test_bad_return_values_fail_the_sample():
    values = iter(["1.0", float("nan"), 1, True])
    stats = asyncio.run(score_groups(lambda s: next(values), groups_of(["a", "b", "c", "d"])))
    assert (stats.scored, stats.failed) == (2, 2)
    assert "reward: TypeError: reward function returned '1.0' (str); expected a float" in stats.errors[0]
    assert "reward: ValueError: reward function returned nan" in stats.errors[1]


def test_raising_or_short_group_reward_fails_the_whole_group():
    @group_reward
    def boom(samples):
        raise RuntimeError("judge unreachable")

    @group_reward
    def short(samples):
        return [1.0]

    groups = groups_of(["a", "b"], ["c", "d"])
    stats = asyncio.run(score_groups(boom, groups[:1]))
    assert stats.failed == 2 and all(s.error == "reward: RuntimeError: judge unreachable" for s in groups[0].samples)
    stats = asyncio.run(score_groups(short, groups[1:]))
    assert stats.failed == 2 and "returned 1 scores for 2 samples" in stats.errors[0]


def test_aborted_and_failed_samples_are_skipped():
    groups = [Group([sample("#### 18"), sample("#### 18", status=SampleStatus.ABORTED, i=1)])]
    stats = asyncio.run(score_groups(get_reward("gsm8k"), groups))
    assert (stats.scored, stats.skipped) == (1, 1)
    assert groups[0].rewards == [1.0, None]


def test_error_list_is_capped():
    def fn(s):
        raise ValueError("nope")

    stats = asyncio.run(score_groups(fn, groups_of([str(i) for i in range(8)])))
    assert stats.failed == 8 and len(stats.errors) == 5


def test_a_reward_call_past_its_deadline_fails_its_sample_and_scoring_goes_on():
    """A sync reward that hangs on one sample: that sample fails with the timeout, the samples after
    it in the same group (and the other groups) are still scored, and what the hung call returns
    once it is released is ignored."""
    release, returned = threading.Event(), threading.Event()

    def fn(s: Sample) -> float:
        if s.response == "hang":
            release.wait(30)
            returned.set()
            return 1.0
        return 0.5

    groups = groups_of(["ok", "hang", "after"], ["other"])
    stats = asyncio.run(score_groups(fn, groups, timeout_s=0.2))
    assert (stats.scored, stats.failed) == (3, 1)
    hung = groups[0].samples[1]
    assert (hung.status, hung.reward) == (SampleStatus.FAILED, None)
    assert hung.error == "reward: RewardTimeout: timed out after 0.2 s (rollout.reward_timeout_s)"
    assert groups[0].rewards == [0.5, None, 0.5] and groups[1].rewards == [0.5]
    release.set()
    assert returned.wait(10)
    assert hung.status is SampleStatus.FAILED and hung.reward is None, "a late result is ignored"


def test_async_and_per_group_rewards_have_the_deadline_too():
    never = asyncio.Event

    async def hangs(s: Sample) -> float:
        if s.response == "hang":
            await never().wait()
        return 1.0

    release = threading.Event()

    @group_reward
    def judge(samples):
        release.wait(30)
        return [1.0] * len(samples)

    groups = groups_of(["hang", "ok"])
    stats = asyncio.run(score_groups(hangs, groups, timeout_s=0.1))
    assert (stats.scored, stats.failed) == (1, 1) and "timed out after 0.1 s" in stats.errors[0]
    groups = groups_of(["a", "b"])
    try:
        stats = asyncio.run(score_groups(judge, groups, timeout_s=0.1))
    finally:
        release.set()
    assert stats.failed == 2 and all("timed out after 0.1 s" in s.error for s in groups[0].samples)


# ------------------------------------------------------------------------------ post-processing


def length_penalty(groups):
    """A reward post-process: 0.1 off per response token beyond 2 (documented example)."""
    for g in groups:
        for s in g.samples:
            if s.reward is not None:
                s.reward -= 0.1 * max(0, len(s.response_ids) - 2)


async def async_bonus(groups):
    for g in groups:
        for s in g.samples:
            s.reward = (s.reward or 0.0) + 1.0


def to_text(groups):
    groups[0].samples[0].reward = "high"


def test_reward_post_process_changes_rewards_in_place_sync_and_async():
    import asyncio

    from miles_core.rewards import load_post_process, post_process_rewards
    from miles_core.types import Group, Sample

    groups = [Group([Sample("p", [1], [1, 2, 3, 4], reward=1.0), Sample("p", [1], [1], reward=0.0)])]
    asyncio.run(post_process_rewards(load_post_process(f"{__name__}:length_penalty"), groups))
    assert [s.reward for s in groups[0].samples] == pytest.approx([0.8, 0.0])
    asyncio.run(post_process_rewards(load_post_process(f"{__name__}:async_bonus"), groups))
    assert [s.reward for s in groups[0].samples] == pytest.approx([1.8, 1.0])
    asyncio.run(post_process_rewards(None, groups))  # no post-process: nothing changes
    assert [s.reward for s in groups[0].samples] == pytest.approx([1.8, 1.0])
    with pytest.raises(TypeError, match="non-numeric rewards on \\['group 0 sample 0'\\]"):
        asyncio.run(post_process_rewards(load_post_process(f"{__name__}:to_text"), groups))


def test_a_groups_samples_are_scored_side_by_side():
    """Eight samples of one group are in their reward calls at the same time (scored one after
    another, the first would wait at the barrier until it broke)."""
    barrier = threading.Barrier(8, timeout=30)

    def fn(s: Sample) -> float:
        barrier.wait()
        return 1.0

    groups = groups_of([f"#### {i}" for i in range(8)])
    stats = asyncio.run(score_groups(fn, groups, timeout_s=60))
    assert (stats.scored, stats.failed) == (8, 0)


def test_slow_scoring_says_how_many_calls_still_run(monkeypatch):
    """While calls run past ``SLOW_SCORING_LOG_S``, the wait is logged (a sync run shows no other
    sign of life until the deadline); the slow call returns once it has been logged."""
    import miles_core.rewards as rewards

    monkeypatch.setattr(rewards, "SLOW_SCORING_LOG_S", 0.05)
    messages: list[str] = []
    logged = threading.Event()

    def fn(s: Sample) -> float:
        if s.sample_index == 0:
            assert logged.wait(30), "the slow call was never logged"
        return 1.0

    handler = logging.Handler()
    handler.emit = lambda record: (messages.append(record.getMessage()), logged.set())
    logging.getLogger("miles_core.rewards").addHandler(handler)
    try:
        stats = asyncio.run(score_groups(fn, groups_of(["a", "b", "c"]), timeout_s=60))
    finally:
        logging.getLogger("miles_core.rewards").removeHandler(handler)
    assert (stats.scored, stats.failed) == (3, 0)
    # the other two may or may not be done yet on a busy machine; the slow one is still running
    assert re.match(r"reward .*fn: [0-2] of 3 calls done after \d+ s, [1-3] running, 0 waiting for a slot \(each "
                    r"has 60 s", messages[0]), messages


def test_work_past_its_deadline_in_a_worker_process_is_killed_and_the_next_call_gets_a_new_worker():
    from miles_core.rewards.isolated import WorkerTimeout, call
    from miles_core.rewards.math import verify_answers

    with pytest.raises(WorkerTimeout, match=r"time\.sleep did not return within 0\.5 s; its worker process was killed"):
        call(time.sleep, 60, deadline_s=0.5)
    assert call(verify_answers, "\\frac12", "0.5", deadline_s=30) is True
    with pytest.raises(ZeroDivisionError):  # the function's own error comes back as it is
        call(operator.truediv, 1, 0, deadline_s=30)


_ORPHANED_CALL = """
import os, sys, threading, time
from miles_core.rewards import isolated
print(isolated.call(os.getpid, deadline_s=120), flush=True)  # the idle worker the next call reuses
sys.stdin.readline()
threading.Thread(target=isolated.call, args=(time.sleep, 600), kwargs={"deadline_s": 600}, daemon=True).start()
threading.Event().wait()
"""


def _syscall(pid: int) -> str:
    """What process ``pid`` waits in (the number of its system call), from /proc."""
    return Path(f"/proc/{pid}/syscall").read_text().split()[0]


@pytest.mark.skipif(not Path("/proc/self/syscall").exists(), reason="needs /proc/<pid>/syscall")
def test_a_worker_whose_parent_is_killed_mid_call_ends_itself():
    """SIGKILL closes no pipe the worker would notice while its call runs: it watches its parent.
    The witness that the call runs: the worker waits in another system call than when it was idle."""
    parent = subprocess.Popen([sys.executable, "-c", _ORPHANED_CALL], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        worker = int(parent.stdout.readline())
        idle = _syscall(worker)
        parent.stdin.write("go\n")
        parent.stdin.flush()
        wait_for(lambda: _syscall(worker) != idle, 30, "the call to reach the worker", poll=0.05)
    finally:
        parent.kill()
        parent.wait()
    wait_for(lambda: not processes.alive(worker), 30, "the orphaned worker to end its call", poll=0.1)


def test_one_pathological_answer_beside_63_easy_ones_leaves_the_63_scored():
    from miles_core.rewards.isolated import call

    def fn(s: Sample) -> float:
        if s.response == "pathological":  # symbolic work that never ends, in its worker process
            return call(time.sleep, 60, deadline_s=2)
        return math_reward(s.response, s.label)

    groups = [Group([Sample("p", [1], [2], "pathological" if g == i == 0 else f"So \\boxed{{{g + i}}}.",
                            label=str(g + i), group_index=g, sample_index=i) for i in range(8)]) for g in range(8)]
    stats = asyncio.run(score_groups(fn, groups, timeout_s=120))  # a busy machine starts the workers slowly
    assert (stats.scored, stats.failed) == (63, 1)
    assert "WorkerTimeout" in groups[0].samples[0].error
    assert all(s.reward == 1.0 for g in groups for s in g.samples if s.response != "pathological")


@pytest.mark.parametrize(("response", "expected"), [
    ("So \\boxed{12}.", 1.0),
    ("Adding them.\n#### 12", 1.0),
    ("The answer is 12.", 1.0),
    ("Answer: 12", 1.0),
    ("12", 0.0),                         # a bare number: the reader has to guess
    ("5 + 7 = 12", 0.0),
    ("#### Step 1\nAdd 5 and 7.", 0.0),  # a markdown heading is no answer
    ("\\boxed{12}", 1.0),
])
def test_format_reward_scores_a_stated_answer(response, expected):
    assert get_reward("format")(sample(response)) == expected


class _Scorer(http.server.BaseHTTPRequestHandler):
    """A reward service: 1.0 when the response contains the label; /flaky fails twice with 503 first;
    /bad refuses with 400; /text answers something that is not a number."""

    calls: dict[str, int] = {}

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = self.calls[self.path] = self.calls.get(self.path, 0) + 1
        if self.path == "/flaky" and n <= 2:
            return self._send(503, b"busy")
        if self.path == "/bad":
            return self._send(400, b"no such task")
        if self.path == "/text":
            return self._send(200, b"great answer")
        score = 1.0 if body["label"] in body["response"] else 0.0
        self._send(200, json.dumps({"reward": score} if self.path == "/obj" else score).encode())

    def _send(self, status, data):
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def scorer():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scorer)
    _Scorer.calls = {}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_remote_reward_posts_each_sample_and_reads_a_number(scorer, monkeypatch):
    from miles_core.rewards import remote

    monkeypatch.setattr(remote, "BACKOFF_S", (0.0, 0.0))
    for path in ("/plain", "/obj", "/flaky"):
        fn = get_reward("remote_rm", scorer + path)
        groups = groups_of(["#### 18", "#### 3"])
        stats = asyncio.run(score_groups(fn, groups))
        assert (stats.scored, groups[0].rewards) == (2, [1.0, 0.0]), path
    assert _Scorer.calls["/flaky"] == 4  # two 503s, then one answer each
    for path, expected in (("/bad", "answered HTTP 400: 'no such task'"), ("/text", "expected a number")):
        groups = groups_of(["#### 18"])
        stats = asyncio.run(score_groups(get_reward("remote", scorer + path), groups))
        assert stats.failed == 1 and expected in groups[0].samples[0].error, path
    closed = f"http://127.0.0.1:{processes.free_port()}/score"
    groups = groups_of(["#### 18"])
    asyncio.run(score_groups(get_reward("remote", closed), groups))
    assert "failed 3 times; the last: ConnectError" in groups[0].samples[0].error




def test_the_remote_reward_needs_its_endpoint_and_no_credentials_in_it():
    from pydantic import ValidationError

    from miles_core.config import RunConfig

    with pytest.raises(ValidationError, match=r"set rollout.rm_url \(--rm-url URL\)"):
        RunConfig.model_validate({"rollout": {"reward": "remote"}})
    with pytest.raises(ValidationError, match=r"set rollout.reward = 'remote' \(--rm-type remote_rm\)"):
        RunConfig.model_validate({"rollout": {"rm_url": "http://127.0.0.1:1/score"}})
    with pytest.raises(ValidationError, match="MILES_RM_AUTHORIZATION") as refused:
        RunConfig.model_validate({"rollout": {"reward": "remote", "rm_url": "https://u:s3cr3t-t0k@rm.example/s"}})
    assert "s3cr3t-t0k" not in str(refused.value)  # the error does not echo the URL


def test_the_remote_reward_sends_the_authorization_from_the_environment(scorer, monkeypatch):
    seen = []

    class Auth(_Scorer):
        def do_POST(self):  # noqa: N802
            seen.append(self.headers.get("Authorization"))
            super().do_POST()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Auth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("MILES_RM_AUTHORIZATION", "Bearer t0k3n")
    try:
        groups = groups_of(["#### 18"])
        asyncio.run(score_groups(get_reward("remote", f"http://127.0.0.1:{server.server_address[1]}/plain"), groups))
    finally:
        server.shutdown()
    assert seen == ["Bearer t0k3n"] and groups[0].rewards == [1.0]
