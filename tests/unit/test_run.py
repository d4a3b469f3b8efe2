"""RunSession (the work of one run, without Prefect): phases, references, and resuming in a new process."""

from __future__ import annotations

import uuid

from miles_core.config import RunConfig
from miles_core.run import RunSession, prepare_run


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
    return [s.prompt for s in session.stream.read_segment(offset).samples()]


def test_rollout_train_push_hand_back_references(tiny_model_dir):
    cfg = _cfg(tiny_model_dir, f"memory://runs-{uuid.uuid4().hex}")
    refs = prepare_run(cfg, log=lambda *_: None)
    session = RunSession(cfg, refs)
    try:
        r = session.rollout(0)
        assert (r.offset, r.num_samples) == (0, 8)
        t = session.train(r)
        assert t.version == 1 and t.weights_uri == session.weights.uri(1)
        session.push_weights(t.weights_uri, t.version)
        assert session.engine.weight_version == 1
        assert session.stream.reader("trainer").cursor == 0  # the trainer committed what it consumed
    finally:
        session.close()


def test_a_rebuilt_session_continues_the_prompt_order(tiny_model_dir):
    root = f"memory://runs-{uuid.uuid4().hex}"
    cfg = _cfg(tiny_model_dir, root)
    straight = RunSession(cfg, prepare_run(cfg, log=lambda *_: None))
    first = RunSession(cfg, refs := prepare_run(cfg, log=lambda *_: None))
    try:
        expected = [_prompts(straight, straight.rollout(k).offset) for k in range(2)]
        assert _prompts(first, first.rollout(0).offset) == expected[0]
        first.close()
        again = RunSession(cfg, refs)  # e.g. a retried task in a fresh process
        assert _prompts(again, again.rollout(1).offset) == expected[1]
        again.close()
    finally:
        straight.close()
