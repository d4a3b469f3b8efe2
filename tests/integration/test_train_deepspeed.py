"""The sync train flow with the DeepSpeed trainer over 2 processes (torchrun, gloo, ZeRO-2) under a
real Prefect backend: it trains, publishes every weights version from rank 0, records metrics,
checkpoints, and stops its ranks at the end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_train_flow import _tiny_run

pytestmark = pytest.mark.integration
pytest.importorskip("deepspeed")


def test_two_process_deepspeed_run_completes(prefect_backend, tiny_model_dir, tmp_path):
    from flows.train import train

    backend = {"type": "deepspeed", "zero_stage": 2, "num_processes": 2}
    cfg = _tiny_run(
        tmp_path, tiny_model_dir,
        rollout={"num_rollout": 2, "rollout_batch_size": 4, "n_samples_per_prompt": 4, "rollout_max_response_len": 4},
        # the untrained tiny model earns no reward (advantages 0): the entropy bonus gives a gradient
        train={"global_batch_size": 8, "micro_batch_size": 4, "lr": 1e-3, "entropy_coef": 0.01, "backend": backend},
        eval={"eval_interval": None, "num_prompts": 8, "skip_eval_before_train": True},
        checkpoint={"save_interval": 1, "keep_checkpoints": 1},
    )
    state = train(cfg, return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    run_dir = Path(summary["run_dir"])

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # 16 samples per rollout in minibatches of 8: two optimizer steps per rollout
    assert [r["step"] for r in rows] == [1, 2] and [r["version"] for r in rows] == [2, 4]
    for row in rows:
        assert row["grad_norm"] > 0 and row["num_samples"] == 16 and row["loss"] == row["loss"]  # not NaN
    assert summary["final_version"] == 4
    published = sorted(p.name for p in (run_dir / "weights").iterdir() if p.name.startswith("v"))
    assert published[-1] == "v000004"
    checkpoint = run_dir / "checkpoints" / "step-000002"
    assert (checkpoint / "trainer.pt").exists() and any((checkpoint / "trainer.deepspeed").iterdir())


def test_the_deepspeed_launcher_runs_the_ranks_too(tiny_model_dir, tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the unit tests' batch helpers
    from test_trainer import REWARDS_A, FakeWeightStore, make_batch

    from miles_core.config import DeepSpeedTrainerConfig, TrainConfig
    from miles_core.storage.weights import WeightStore
    from miles_core.train import setup_trainer
    from miles_core.train.torch_trainer import TorchTrainer

    cfg = dict(global_batch_size=4, micro_batch_size=3)
    backend = DeepSpeedTrainerConfig(zero_stage=2, num_processes=2, launcher="deepspeed")
    trainer = setup_trainer(TrainConfig(backend=backend, **cfg), str(tiny_model_dir), WeightStore(str(tmp_path / "w")))
    try:
        want = TorchTrainer(str(tiny_model_dir), TrainConfig(**cfg), FakeWeightStore(tmp_path)).step(make_batch(REWARDS_A))
        assert trainer.step(make_batch(REWARDS_A))["loss"] == pytest.approx(want["loss"], abs=1e-5)
        assert Path(trainer.export(trainer.version)).name == "v000002"
    finally:
        trainer.close()
