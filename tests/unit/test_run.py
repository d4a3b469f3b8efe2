"""RunSession (the work of one run, without Prefect): phases, references, and resuming in a new process."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from miles_core.config import RunConfig
from miles_core.run import RunSession, checkpoint_due, prepare_run


def _cfg(model_dir, root: str) -> RunConfig:
    return RunConfig.model_validate({
        "name": "session-test",
        "model": {"path": str(model_dir)},
        "data": {"type": "toy", "num_prompts": 32},
        "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 2, "rollout_max_response_len": 3},
        "eval": {"num_prompts": 4},
        "storage": {"root": root},
    })


def _prompts(session: RunSession, offset: int) -> list[str]:
    return [s.prompt for s in session.files.stream.read_segment(offset).samples()]


def test_rollout_train_push_hand_back_references(tiny_model_dir):
    cfg = _cfg(tiny_model_dir, f"memory://runs-{uuid.uuid4().hex}")
    refs = prepare_run(cfg, log=lambda *_: None)
    session = RunSession(cfg, refs)
    try:
        r = session.rollouts.rollout(0)
        assert (r.offset, r.num_samples) == (0, 8)
        t = session.training.train(r)
        assert t.version == 1 and t.weights_uri == session.weights.uri(1)
        session.rollouts.push_weights(t.weights_uri, t.version)
        assert session.rollouts.engine.weight_version == 1
        assert session.files.stream.reader("trainer").cursor == 0  # the trainer committed what it consumed
    finally:
        session.close()


def test_a_rebuilt_session_continues_the_prompt_order(tiny_model_dir):
    root = f"memory://runs-{uuid.uuid4().hex}"
    cfg = _cfg(tiny_model_dir, root)
    straight = RunSession(cfg, prepare_run(cfg, log=lambda *_: None))
    first = RunSession(cfg, refs := prepare_run(cfg, log=lambda *_: None))
    try:
        expected = [_prompts(straight, straight.rollouts.rollout(k).offset) for k in range(2)]
        assert _prompts(first, first.rollouts.rollout(0).offset) == expected[0]
        first.close()
        again = RunSession(cfg, refs)  # e.g. a retried task in a fresh process
        assert _prompts(again, again.rollouts.rollout(1).offset) == expected[1]
        again.close()
    finally:
        straight.close()


def test_resume_goes_back_to_the_newest_checkpoint_and_redoes_the_same_step(tiny_model_dir):
    """Checkpoint after step 1, then step 2 runs: a new session resumes at 1. The weight store,
    metrics and prompt cursor (the checkpoint's, not the newer state/data_source.json) go back, and
    the redone step 2 draws the same prompts and publishes the same weights."""
    import torch

    cfg = _cfg(tiny_model_dir, f"memory://runs-{uuid.uuid4().hex}")
    refs = prepare_run(cfg, log=lambda *_: None)
    first = RunSession(cfg, refs)
    try:
        r = first.rollouts.rollout(0)
        first.history.record(1, {"version": first.training.train(r).version})
        first.save_checkpoint(1, r.source_state)
        r = first.rollouts.rollout(1)
        first.history.record(2, {"version": first.training.train(r).version})
        prompts, weights = _prompts(first, r.offset), first.weights.load(2)
    finally:
        first.close()

    again = RunSession(cfg, refs)
    try:
        assert again.resume() == 1
        assert again.weights.versions() == [1] and again.training.trainer.version == 1
        assert [row["step"] for row in again.history.metrics_rows] == [1]
        assert again.layout.read_jsonl("metrics.jsonl") == again.history.metrics_rows
        redo = again.rollouts.rollout(1)
        assert redo.offset == 2  # the first step 2's segment stays in the stream as history
        assert _prompts(again, redo.offset) == prompts
        assert again.training.train(redo).version == 2
        assert all(torch.equal(t, weights[k]) for k, t in again.weights.load(2).items())
    finally:
        again.close()


def test_a_run_with_steps_but_no_checkpoint_refuses_to_resume(tiny_model_dir):
    cfg = _cfg(tiny_model_dir, f"memory://runs-{uuid.uuid4().hex}")
    refs = prepare_run(cfg, log=lambda *_: None)
    session = RunSession(cfg, refs)
    assert session.resume() is None  # a fresh run
    session.history.record(1, {"loss": 0.1})
    with pytest.raises(RuntimeError, match=r"already has training steps.*no checkpoint.*new run id.*--save-interval"):
        RunSession(cfg, refs).resume()


def test_checkpoint_due_every_interval_and_at_the_last_step():
    cfg = RunConfig.model_validate({"rollout": {"num_rollout": 7}, "checkpoint": {"save_interval": 3}})
    assert [k for k in range(1, 8) if checkpoint_due(cfg, k)] == [3, 6, 7]
    cfg = cfg.updated({"checkpoint.save_interval": None})
    assert not any(checkpoint_due(cfg, k) for k in range(1, 8))


def test_flows_pickle_for_deployments():
    """A served deployment's runner cloudpickles the flow function with the globals it uses; a lock
    among them (e.g. a registry's bound method) makes every deployment run crash before it starts."""
    import cloudpickle

    from flows.multi_lora import train_multi_lora
    from flows.train import train

    for flow in (train, train_multi_lora):
        assert cloudpickle.loads(cloudpickle.dumps(flow.fn)).__name__ == flow.fn.__name__


def always_fails(sample) -> float:
    raise RuntimeError("the judge is down")


def test_steps_whose_rewards_all_failed_change_nothing_and_fail_the_run_after_max_skipped_steps(tiny_model_dir):
    from miles_core.session.training import SkippedSteps

    cfg = _cfg(tiny_model_dir, f"memory://runs-{uuid.uuid4().hex}")
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"reward": f"{__name__}:always_fails"}),
                                 "train": cfg.train.model_copy(update={"max_skipped_steps": 2})})
    session = RunSession(cfg, prepare_run(cfg, log=lambda *_: None))
    try:
        first = session.training.train(session.rollouts.rollout(0))
        assert first.metrics["skipped_step"] == 1.0 and first.version == 0
        assert first.weights_uri == session.refs.model_dir, "the engine keeps the weights it has"
        with pytest.raises(SkippedSteps) as error:
            session.training.train(session.rollouts.rollout(1))
        text = str(error.value)
        assert "2 training steps in a row changed nothing" in text and "--max-skipped-steps 2" in text
        assert "step 1: 8 of 8 samples had no valid reward (reward: RuntimeError: the judge is down)" in text
        assert session.weights.latest() is None, "nothing was published"
    finally:
        session.close()


@pytest.mark.parametrize("damage", ["state.json", "trainer.pt"])
def test_a_damaged_newest_checkpoint_is_named_and_the_next_older_one_is_used(tiny_model_dir, tmp_path, damage):
    from miles_core.storage.layout import CHECKPOINT_STATE, TRAINER_STATE

    cfg = _cfg(tiny_model_dir, str(tmp_path / "runs"))
    cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"keep_checkpoints": 3})})
    refs = prepare_run(cfg, log=lambda *_: None)
    first = RunSession(cfg, refs)
    try:
        for step in (1, 2):
            r = first.rollouts.rollout(step - 1)
            first.history.record(step, {"version": first.training.train(r).version})
            first.save_checkpoint(step, r.source_state)
    finally:
        first.close()
    name = {"state.json": CHECKPOINT_STATE, "trainer.pt": TRAINER_STATE}[damage]
    newest = Path(first.layout.checkpoint(2, name))
    newest.write_bytes(newest.read_bytes()[: len(newest.read_bytes()) // 2])  # a save cut short on disk

    again = RunSession(cfg, refs)
    try:
        assert again.resume() == 1, "the older checkpoint"
        assert again.training.trainer.version == 1 and again.weights.versions() == [1]
        assert [row["step"] for row in again.history.metrics_rows] == [1]
        (skipped,) = again.checkpoints.skipped
        assert skipped.startswith(f"{first.layout.checkpoint(2)}: ")
    finally:
        again.close()

    older = Path(first.layout.checkpoint(1, name))
    older.write_bytes(b"")
    with pytest.raises(RuntimeError, match=r"(?s)none of its checkpoints can be loaded:\n.*step-000002: .*\n.*step-000001: "):
        RunSession(cfg, refs).resume()


def test_a_run_killed_in_its_first_step_starts_again_from_the_first_prompts(tiny_model_dir, tmp_path):
    """The first rollout drew its prompts (``state/data_source.json`` moved on) and the run died
    before the step's metrics row: the same run id again draws those prompts again, none skipped,
    even when the rollout side was built (it read the moved cursor) before the resume."""
    cfg = _cfg(tiny_model_dir, str(tmp_path / "runs"))
    refs = prepare_run(cfg, log=lambda *_: None)
    killed = RunSession(cfg, refs)
    try:
        first = killed.rollouts.rollout(0)
    finally:
        killed.close()
    assert first.source_state["position"] == cfg.rollout.rollout_batch_size
    again = RunSession(cfg, refs)
    try:
        again.check_data()  # builds the prompt source, as a run does before it resumes
        assert again.resume() is None
        redone = again.rollouts.rollout(0)
        assert _prompts(again, redone.offset) == _prompts(again, first.offset)
        assert redone.source_state == first.source_state
    finally:
        again.close()


def test_a_checkpoint_whose_write_fails_leaves_nothing_and_resume_uses_the_last_whole_one(tiny_model_dir, tmp_path,
                                                                                         monkeypatch):
    """A full disk in the middle of a save: no folder a resume could take for a checkpoint is left
    (it was written under a temporary name); leftovers of a killed save are named and removed."""
    import errno

    cfg = _cfg(tiny_model_dir, str(tmp_path / "runs"))
    cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"save_interval": 1})})
    refs = prepare_run(cfg, log=lambda *_: None)
    first = RunSession(cfg, refs)
    checkpoints = Path(first.layout.checkpoint(1)).parent
    try:
        for step in (1, 2):
            r = first.rollouts.rollout(step - 1)
            first.history.record(step, {"version": first.training.train(r).version})
            if step == 1:
                first.save_checkpoint(step, r.source_state)
        trainer = first.training.trainer
        real_save = trainer.save

        def disk_full(uri: str) -> None:
            real_save(uri)  # the trainer's file is written, then the disk fills
            raise OSError(errno.ENOSPC, "No space left on device", uri)

        monkeypatch.setattr(trainer, "save", disk_full)
        with pytest.raises(OSError, match="No space left"):
            first.save_checkpoint(2, r.source_state)
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000001"], "the failed save left nothing"
    finally:
        first.close()
    (checkpoints / "step-000003").mkdir()  # what a save killed mid-way on another storage leaves
    (checkpoints / ".partial-step-000003-abcdef").mkdir()  # and one killed mid-way on local files

    again = RunSession(cfg, refs)
    try:
        assert again.resume() == 1
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000001"], "leftovers removed"
    finally:
        again.close()

    for name in ("step-000001", "step-000004"):  # only incomplete ones now: the resume names them
        (checkpoints / name).mkdir(exist_ok=True)
    (checkpoints / "step-000001" / "state.json").unlink()
    with pytest.raises(RuntimeError, match=r"no checkpoint to resume from \(it saves one every 1 steps: none was "
                                           r"completed\); in \S+checkpoints only incomplete checkpoint folders \(saves "
                                           r"that did not finish\): step-000001, step-000004; use a new run id$"):
        RunSession(cfg, refs).resume()
