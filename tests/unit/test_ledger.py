"""The prompt ledger's audit over a fully-async run folder built from its real parts (prompt log,
producer streams, the trainer's cursor and ledger entries): every prompt accounted for, and each
way of losing one or training one twice is named."""

from __future__ import annotations

import pytest
from test_fleet import _group, counter_draw

from miles_core.audit import audit, format_audit
from miles_core.ledger import write_step
from miles_core.rollout.fleet import PromptLog, stream_name
from miles_core.storage import SampleStream
from miles_core.storage.layout import RunLayout


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


def test_a_multi_lora_run_is_audited_per_adapter_over_its_own_groups(tmp_path):
    """Per-adapter rollouts: each group is the adapter's that generated it; each adapter's ledger and
    cursor account for its own groups, the other's are "another adapter's", and a group one adapter
    passed without training is named with that adapter."""
    layout = RunLayout(str(tmp_path / "runs"), "toy", "ml")
    layout.write_json("config.json", {"multi_lora": {"n_adapters": 2, "rollout_source": "per_adapter"}})
    log = PromptLog(layout.run_dir, draw=counter_draw(100))
    stream = SampleStream(layout.run_dir).sibling(stream_name("m0"))
    from dataclasses import replace

    from miles_core.types import Group

    claim = log.claim("m0", 4)  # groups 0..3: adapter-0 generated 0 and 2, adapter-1 1 and 3
    groups = [Group([replace(s, adapter=f"adapter-{i % 2}") for s in _group(claim.group_index(i)).samples])
              for i in range(4)]
    stream.append(groups)
    a0 = RunLayout(layout.run_dir, "adapters", "adapter-0")
    a1 = RunLayout(layout.run_dir, "adapters", "adapter-1")
    write_step(a0, 1, 1, [groups[0], groups[2]])
    write_step(a1, 1, 1, [groups[1]])
    from miles_core.multi_lora import adapter_reader

    stream.reader(adapter_reader("adapter-0")).commit(0)
    stream.reader(adapter_reader("adapter-1")).commit(0)  # passed group 3 without training it
    result = audit(layout.run_dir, finished=True)
    assert result.mode == "multi_lora" and result.adapters["adapter-0"].ok
    assert result.adapters["adapter-0"].counts["trained"] == 2
    assert result.adapters["adapter-0"].counts["another adapter's"] == 2
    assert result.adapters["adapter-0"].tokens["generated"] == 2 * 4  # only its own groups' tokens
    assert not result.ok and len(result.problems) == 1
    assert result.problems[0].startswith(f"adapter adapter-1: group {claim.group_index(3)}")
    assert "adapter-0 1, adapter-1 1" in format_audit(result)


def test_a_shared_rollout_is_counted_once_per_adapter_not_summed(tmp_path):
    """Shared rollout: both adapters train the same 2 groups (8 response tokens). Each adapter's
    balance holds; the run's totals are not the sum over adapters (that counted the groups twice)."""
    layout = RunLayout(str(tmp_path / "runs"), "toy", "ml")
    layout.write_json("config.json", {"multi_lora": {"n_adapters": 2, "rollout_source": "shared"}})
    log = PromptLog(layout.run_dir, draw=counter_draw(100))
    stream = SampleStream(layout.run_dir).sibling(stream_name("m0"))
    claim = log.claim("m0", 2)
    groups = [_group(claim.group_index(i)) for i in range(2)]
    stream.append(groups)
    from miles_core.audit import audit_line
    from miles_core.multi_lora import adapter_reader

    for name in ("adapter-0", "adapter-1"):
        write_step(RunLayout(layout.run_dir, "adapters", name), 1, 1, groups)
        stream.reader(adapter_reader(name)).commit(0)
    result = audit(layout.run_dir, finished=True)
    assert result.ok, format_audit(result)
    for name in ("adapter-0", "adapter-1"):
        assert result.adapters[name].tokens["generated"] == result.adapters[name].tokens["trained"] == 8
    assert not {"steps", "tokens", "token_balance"} & set(result.to_json())  # no run-wide sum over adapters
    text = format_audit(result)
    assert "tokens of adapter-0: generated 8 = trained 8" in text and "tokens of adapter-1: generated 8" in text
    line = audit_line(result.to_json())
    assert "adapter-0: generated 8 = trained 8" in line and "adapter-1: generated 8 = trained 8" in line


def _sync_run(tmp_path, draws: list[list[int]], cursors: list[tuple[int, int]], num_rows: int = 4):
    """A sync run folder: step k trained groups of the prompt rows ``draws[k]``, its rollout's
    cursor after drawing was ``cursors[k]`` (epoch, position)."""
    from dataclasses import replace

    from miles_core.types import Group

    layout = RunLayout(str(tmp_path / "runs"), "toy", "sync")
    layout.write_json("config.json", {"rollout": {}})
    stream = SampleStream(layout.run_dir)
    for k, (rows, (epoch, position)) in enumerate(zip(draws, cursors)):
        groups = [Group([replace(s, prompt_index=row) for s in _group(k * 10 + i).samples]) for i, row in enumerate(rows)]
        offset = stream.append([s for g in groups for s in g.samples])
        write_step(layout, k + 1, k + 1, groups, segment=offset,
                   cursor={"epoch": epoch, "position": position, "num_rows": num_rows, "retry": []})
    return layout


def test_a_sync_run_is_audited_epoch_by_epoch_from_its_prompt_cursor(tmp_path):
    """4 prompts, 3 a step: epoch 0 is [2, 0, 3, 1], epoch 1 begins with [1, 3, ...]."""
    good = _sync_run(tmp_path / "good", [[2, 0, 3], [1, 1, 3], [0, 2, 3]], [(0, 3), (1, 2), (2, 1)])
    result = audit(good.run_dir, finished=True)
    assert result.ok, format_audit(result)
    assert result.counts["epochs completed"] == 2 and result.counts["trained"] == 9

    # a resume that put the cursor back one step too far: step 2's prompts again in the same epoch
    twice = _sync_run(tmp_path / "twice", [[2, 0, 3], [2, 0, 3]], [(0, 3), (0, 3)])
    result = audit(twice.run_dir, finished=True)
    assert "step 2: the prompt cursor moved by 0 prompts (to epoch 0 position 3) but it trained 3" in result.problems
    assert "prompt row 2 trained twice in epoch 0: at steps 1 and 2" in result.problems

    # a cursor that skipped prompts: drawn but never trained
    skipped = _sync_run(tmp_path / "skipped", [[2, 0, 3], [1]], [(0, 3), (1, 3)])
    problems = audit(skipped.run_dir, finished=True).problems
    assert problems == ["step 2: the prompt cursor moved by 4 prompts (to epoch 1 position 3) but it trained 1"]


def test_a_finished_run_whose_ledger_does_not_balance_fails_after_its_summary():
    from miles_core.audit import AuditFailed, raise_if_unbalanced

    lost = {"ok": False, "problems": ["prompt 17 (epoch 0) lost"], "num_problems": 1, "counts": {}, "tokens": {}}
    with pytest.raises(AuditFailed, match=r"does not balance: prompt 17 \(epoch 0\) lost \(1 problem\(s\); "
                                          r"`miles audit runs/x` lists them\)"):
        raise_if_unbalanced(lost, "runs/x")
    raise_if_unbalanced({"ok": True, "problems": [], "num_problems": 0}, "runs/x")
    # an audit that could not be read: logged, and the run (which trained) stands
    raise_if_unbalanced({"ok": False, "error": "OSError: gone", "problems": [], "num_problems": 0}, "runs/x")
