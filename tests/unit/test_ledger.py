"""The prompt ledger's audit over a fully-async run folder built from its real parts (prompt log,
producer streams, the trainer's cursor and ledger entries): every prompt accounted for, and each
way of losing one or training one twice is named."""

from __future__ import annotations

from miles_core.ledger import audit, format_audit, write_step
from miles_core.rollout.fleet import PromptLog, stream_name
from miles_core.storage import SampleStream
from miles_core.storage.layout import RunLayout
from test_fleet import _group, counter_draw


def _run(tmp_path):
    layout = RunLayout(str(tmp_path / "runs"), "toy", "r1")
    layout.write_json("config.json", {})
    log = PromptLog(layout.run_dir, draw=counter_draw(100))
    stream = SampleStream(layout.run_dir).sibling(stream_name("p0"))
    return layout, log, stream


def test_every_prompt_is_accounted_for_and_the_tokens_balance(tmp_path):
    layout, log, stream = _run(tmp_path)
    claim = log.claim("p0", 4)  # groups 0..3
    groups = [_group(claim.group_index(i)) for i in range(3)]
    stream.append(groups)
    log.release_own({claim.group_index(3): 3}, reason="producer p0 stopped", producer="p0")
    write_step(layout, 1, 1, groups[:2])
    stream.reader("trainer").commit(-1)  # group 2 not yet read
    result = audit(layout.run_dir, finished=True)
    assert result.ok, format_audit(result)
    assert result.counts["trained"] == 2 and result.counts["written, not read by the end"] == 1
    assert result.counts["in the pool at the end (given back, not claimed again)"] == 1
    assert result.tokens["generated"] == 3 * 4 and result.tokens["trained"] == 2 * 4


def test_a_prompt_trained_twice_or_lost_is_a_problem(tmp_path):
    layout, log, stream = _run(tmp_path)
    claim = log.claim("p0", 3)
    groups = [_group(claim.group_index(i)) for i in range(2)]
    stream.append(groups)
    write_step(layout, 1, 1, groups[:1])
    write_step(layout, 2, 2, groups[:1])  # the same group again
    stream.reader("trainer").commit(0)  # ... and the cursor passed group 1 without using it
    result = audit(layout.run_dir, finished=True)  # group 2 was claimed, never written nor given back
    assert not result.ok
    text = "\n".join(result.problems)
    assert f"group {claim.group_index(0)} trained twice: at steps 1 and 2" in text
    assert f"group {claim.group_index(1)}" in text and "neither trained nor rejected" in text
    assert "neither wrote it nor gave it back, in a run that finished" in text
    assert result.to_json()["token_balance"] == -4  # group 0 counted twice, group 1 abandoned


def test_a_folder_that_is_not_a_run_or_has_no_ledger_is_refused_not_passed(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match="no run here"):
        audit(str(tmp_path / "nothing"))
    layout, _, _ = _run(tmp_path)
    layout.write_jsonl("metrics.jsonl", [{"step": 1}])
    with pytest.raises(ValueError, match="has training steps but no prompt ledger"):
        audit(layout.run_dir)
