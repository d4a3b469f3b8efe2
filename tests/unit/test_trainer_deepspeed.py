"""DeepSpeedTrainer on the tiny model: it takes TorchTrainer's steps (ZeRO-2, fp32, with micro-batching,
accumulation and clipping at work), ZeRO-3 export gathers the unsharded weights, every ZeRO stage and
bf16 train, a resumed run continues exactly (optimizer state restored), LoRA trains only the adapter
and exports a PEFT folder; launched over 2 processes it gives the 1-process losses, and a failing
or vanished rank gives an error naming it.

Every in-process trainer here shares this process's one-rank gloo group (a process has one)."""

from __future__ import annotations

import math
import os
import signal
import tempfile

import pytest
import torch
from test_trainer import REWARDS_A, REWARDS_B, FakeWeightStore, assert_same_params, make_batch, make_groups, params
from test_trainer_lora import LORA, FolderWeightStore, load_base, logits

from miles_core import processes
from miles_core.config import DeepSpeedTrainerConfig, TrainConfig
from miles_core.train import setup_trainer
from miles_core.train.torch_trainer import TorchTrainer

pytest.importorskip("deepspeed")
torch.set_num_threads(1)

# 8 samples in minibatches of 4 (2 optimizer steps per batch), micro-batches of 3 and 1 (gradient
# accumulation with a ragged last micro-batch); clip 0.05 is far below the gradient norms (~2-3),
# so clipping acts on every step
STEP_CFG = dict(global_batch_size=4, micro_batch_size=3, clip_grad=0.05, lr=1e-3)
# ZeRO-3 keeps parameters under this many elements whole on every rank; 0 shards all of them
SHARD_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def ds_cfg(zero_stage=2, precision="fp32", num_processes=1, overrides=None, **cfg) -> TrainConfig:
    backend = DeepSpeedTrainerConfig(zero_stage=zero_stage, precision=precision, num_processes=num_processes,
                                     config_overrides=overrides or {})
    return TrainConfig(backend=backend, **cfg)


def ds_trainer(model_dir, store, lora=None, **kwargs):
    from miles_core.train.deepspeed_trainer import DeepSpeedTrainer

    cfg_keys = ("zero_stage", "precision", "overrides")
    backend = {k: kwargs.pop(k) for k in cfg_keys if k in kwargs}
    return DeepSpeedTrainer(str(model_dir), ds_cfg(**backend, **kwargs), store, lora=lora)


def batches(n):
    return [make_batch(REWARDS_A if i % 2 == 0 else REWARDS_B) for i in range(n)]


# ------------------------------------------------------------------------------- same as torch


@pytest.mark.parametrize("schedule", [{}, {"lr_decay_style": "cosine", "lr_warmup_steps": 2, "lr_decay_steps": 8,
                                           "min_lr": 1e-5}], ids=["constant", "cosine"])
def test_zero2_takes_the_torch_trainers_steps(tiny_model_dir, tmp_path, schedule):
    cfg = {**STEP_CFG, **schedule}  # with a schedule: the rate set before each step reaches DeepSpeed's optimizer
    torch_trainer = TorchTrainer(str(tiny_model_dir), TrainConfig(**cfg), FakeWeightStore(tmp_path))
    ds = setup_trainer(ds_cfg(zero_stage=2, **cfg), str(tiny_model_dir), FakeWeightStore(tmp_path))
    assert type(ds).__name__ == "DeepSpeedTrainer" and ds.engine.zero_optimization_stage() == 2
    diffs = []
    for batch in batches(5):
        want, got = torch_trainer.step(batch), ds.step(batch)
        assert got["num_optimizer_steps"] == want["num_optimizer_steps"] == 2
        assert want["grad_norm"] > 10 * STEP_CFG["clip_grad"]  # clipping is active
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        for key in ("pg_loss", "entropy", "clipfrac", "ratio_dev", "train_tokens", "lr"):
            assert got[key] == pytest.approx(want[key], abs=1e-4), key
        diffs.append(abs(got["loss"] - want["loss"]))
    assert max(diffs) < 1e-4, diffs
    assert ds.version == torch_trainer.version == 10
    assert_same_params(torch_trainer, ds, atol=1e-5)


@pytest.mark.parametrize(("zero_stage", "precision"), [(0, "fp32"), (0, "bf16"), (2, "fp32"), (3, "fp32")])
def test_a_non_finite_loss_is_never_applied_and_leaves_no_gradient_behind(tiny_model_dir, tmp_path, zero_stage,
                                                                           precision):
    """NaN advantages make every minibatch's loss NaN: no optimizer step is taken (each counted,
    the version and the weights stay), and the next batch trains exactly as on a trainer that never
    saw the poisoned one (no gradient left in DeepSpeed's buffers)."""
    poisoned = make_batch(REWARDS_A)
    poisoned.advantages = [float("nan")] * len(poisoned.advantages)
    seen = ds_trainer(tiny_model_dir, FakeWeightStore(tmp_path), zero_stage=zero_stage, precision=precision, **STEP_CFG)
    before = seen.weights()  # gathered (ZeRO-3 parameters are partitions)
    metrics = seen.step(poisoned)
    assert (metrics["num_optimizer_steps"], metrics["num_nonfinite_steps"]) == (0, 2), metrics
    assert seen.version == 0 and all(torch.equal(before[k], v) for k, v in seen.weights().items())
    fresh = ds_trainer(tiny_model_dir, FakeWeightStore(tmp_path), zero_stage=zero_stage, precision=precision, **STEP_CFG)
    fresh._generator.set_state(seen._generator.get_state())  # the same minibatches from here on
    for batch in batches(2):
        want, got = fresh.step(batch), seen.step(batch)
        assert got["loss"] == want["loss"] and got["num_optimizer_steps"] == 2
    assert seen.version == fresh.version == 4
    want, got = fresh.weights(), seen.weights()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# ------------------------------------------------------------------------------------- ZeRO-3


def test_zero3_export_equals_the_unsharded_weights(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    reference = TorchTrainer(str(tiny_model_dir), TrainConfig(**STEP_CFG), FakeWeightStore(tmp_path / "ref"))
    (tmp_path / "z3").mkdir()
    z3 = ds_trainer(tiny_model_dir, FakeWeightStore(tmp_path / "z3"), zero_stage=3, overrides=SHARD_ALL, **STEP_CFG)
    for batch in batches(2):
        reference.step(batch)
        z3.step(batch)
    # sharded: outside a gather, every parameter holds no data
    assert all(p.numel() == 0 and p.ds_numel > 0 for p in z3.model.parameters())
    exported = load_file(z3.export(z3.version))
    want = reference.weights()
    assert set(exported) == set(want)
    diff = max(float((exported[k] - want[k]).abs().max()) for k in want)
    assert diff < 1e-5, diff
    fresh = load_base(tiny_model_dir)
    fresh.load_state_dict(exported, strict=True)  # whole tensors, the model's names


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_every_zero_stage_trains(tiny_model_dir, tmp_path, zero_stage):
    trainer = ds_trainer(tiny_model_dir, FakeWeightStore(tmp_path), zero_stage=zero_stage, overrides=SHARD_ALL
                         if zero_stage == 3 else None, global_batch_size=8)
    before = trainer.weights()
    metrics = trainer.step(make_batch(REWARDS_A))
    after = trainer.weights()
    assert metrics["version"] == 1 and math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged, unchanged


def test_bf16_trains_and_exports_in_the_model_dtype(tiny_model_dir, tmp_path):
    trainer = ds_trainer(tiny_model_dir, FakeWeightStore(tmp_path), precision="bf16", global_batch_size=8)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    before = trainer.weights()
    metrics = trainer.step(make_batch(REWARDS_A))
    after = trainer.weights()
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert {v.dtype for v in after.values()} == {torch.float32}  # the run's model dtype
    assert any(not torch.equal(before[k], after[k]) for k in before)


# -------------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_resumed_run_equals_uninterrupted_run(tiny_model_dir, tmp_path, zero_stage):
    # 2 optimizer steps per batch on shuffled minibatches: the shuffle RNG and Adam state both matter
    cfg = dict(zero_stage=zero_stage, global_batch_size=4, micro_batch_size=2)
    ckpt = str(tmp_path / "ckpt" / "trainer.pt")
    straight = ds_trainer(tiny_model_dir, FakeWeightStore(tmp_path), **cfg)
    straight.step(make_batch(REWARDS_A))
    straight.save(ckpt)
    assert any("optim_states" in p.name for p in (tmp_path / "ckpt" / "trainer.deepspeed").iterdir())
    m_straight = straight.step(make_batch(REWARDS_B))

    resumed = ds_trainer(tiny_model_dir, FakeWeightStore(tmp_path), **cfg)
    resumed.load(ckpt)
    assert resumed.version == 2
    m_resumed = resumed.step(make_batch(REWARDS_B))
    assert resumed.version == straight.version == 4
    # exactly equal: with Adam's moments or the shuffle RNG not restored, the steps would differ
    assert m_resumed["loss"] == m_straight["loss"] and m_resumed["grad_norm"] == m_straight["grad_norm"]
    want, got = straight.weights(), resumed.weights()
    assert all(torch.equal(want[k], got[k]) for k in want)



def test_checkpoint_of_another_layout_is_refused(tiny_model_dir, tmp_path):
    ckpt = str(tmp_path / "trainer.pt")
    ds_trainer(tiny_model_dir, FakeWeightStore(tmp_path), zero_stage=2).save(ckpt)
    other = ds_trainer(tiny_model_dir, FakeWeightStore(tmp_path), zero_stage=1)
    with pytest.raises(ValueError, match="zero_stage=2.*this trainer has num_processes=1, zero_stage=1"):
        other.load(ckpt)
    with pytest.raises(FileNotFoundError, match="trainer checkpoint not found"):
        other.load(str(tmp_path / "nope.pt"))
    with pytest.raises(NotImplementedError, match="use save"):
        other.state_dict()


# --------------------------------------------------------------------------------------- LoRA


def test_lora_trains_only_the_adapter_like_torch_and_exports_a_peft_folder(tiny_model_dir, tmp_path):
    from peft import PeftModel

    cfg = dict(global_batch_size=4, micro_batch_size=3)
    torch_lora = TorchTrainer(str(tiny_model_dir), TrainConfig(**cfg), FolderWeightStore(tmp_path / "t"), lora=LORA)
    (tmp_path / "t").mkdir()
    (tmp_path / "d").mkdir()
    ds = ds_trainer(tiny_model_dir, FolderWeightStore(tmp_path / "d"), lora=LORA, zero_stage=2, **cfg)
    trainable = {k for k, p in ds.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in k for k in trainable)
    start = params(ds)
    for batch in batches(2):
        assert ds.step(batch)["loss"] == pytest.approx(torch_lora.step(batch)["loss"], abs=1e-6)
    end = params(ds)
    assert all(torch.equal(start[k], end[k]) for k in start if k not in trainable)  # base bit-identical
    assert all(not torch.equal(start[k], end[k]) for k in trainable)

    folder = ds.export(ds.version)
    loaded = PeftModel.from_pretrained(load_base(tiny_model_dir), folder).eval()
    samples = make_groups(REWARDS_A)[1].samples
    ds.model.eval()
    torch.testing.assert_close(logits(loaded, samples), logits(ds.model, samples), atol=1e-6, rtol=0)
    torch.testing.assert_close(logits(loaded, samples), logits(torch_lora.model, samples), atol=1e-5, rtol=0)


# -------------------------------------------------------------------------------- 2 processes


def weight_store(folder):
    """The real store: the ranks unpickle it (this test module is not importable there)."""
    from miles_core.storage.weights import WeightStore

    return WeightStore(str(folder / "weights"))


@pytest.fixture(scope="module")
def launched(tiny_model_dir, tmp_path_factory):
    """A ZeRO-2 trainer over 2 ranks (torchrun, gloo), started once for this module (~8 s)."""
    store = weight_store(tmp_path_factory.mktemp("launched"))
    trainer = setup_trainer(ds_cfg(zero_stage=2, num_processes=2, **STEP_CFG), str(tiny_model_dir), store)
    yield trainer
    trainer.close()


def test_two_processes_take_the_one_process_steps(launched, tiny_model_dir, tmp_path):
    from miles_core.storage.weights import load_snapshot

    assert type(launched).__name__ == "LaunchedTrainer" and len(launched.pids) == 2
    one = TorchTrainer(str(tiny_model_dir), TrainConfig(**STEP_CFG), FakeWeightStore(tmp_path))
    for batch in batches(3):
        want, got = one.step(batch), launched.step(batch)
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        assert got["train_tokens"] == want["train_tokens"] and got["num_samples"] == 8
    assert launched.version == one.version == 6
    exported = load_snapshot(launched.export(launched.version))
    want = one.weights()
    assert max(float((exported[k] - want[k]).abs().max()) for k in want) < 1e-5

    # save, train on, load: the step after the load repeats the step after the save
    ckpt = str(tmp_path / "ckpt" / "trainer.pt")
    launched.save(ckpt)
    first = launched.step(make_batch(REWARDS_B))
    launched.load(ckpt)
    assert launched.version == 6
    assert launched.step(make_batch(REWARDS_B))["loss"] == first["loss"]


def test_a_rank_that_exits_is_named_with_its_exit_code(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the logs a failure keeps
    from miles_core.train.launch import TrainerProcessError

    trainer = setup_trainer(ds_cfg(num_processes=2, global_batch_size=8), str(tiny_model_dir), weight_store(tmp_path))
    try:
        os.kill(trainer.pids[1], signal.SIGKILL)
        with pytest.raises(TrainerProcessError, match=r"trainer rank 1 exited during 'step'") as info:
            trainer.step(make_batch(REWARDS_A))
        message = str(info.value)
        assert "launcher exit code: 1" in message and "--- rank 1 log" in message
        assert "exitcode" in message and "SIGKILL" in message  # torchrun's report of each rank
        with pytest.raises(TrainerProcessError, match="failed earlier"):
            trainer.step(make_batch(REWARDS_A))
    finally:
        trainer.close()
    assert not processes.alive(trainer.pids[0]), "no rank is left behind (a zombie not reaped yet counts as gone)"


def test_a_rank_that_fails_to_start_reports_its_traceback(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the logs a failure keeps
    from miles_core.train.launch import TrainerProcessError

    with pytest.raises(TrainerProcessError, match=r"(?s)trainer rank \d failed during 'ready'.*no-such-model"):
        setup_trainer(ds_cfg(num_processes=2), str(tmp_path / "no-such-model"), weight_store(tmp_path))


def test_startup_timeout_names_the_missing_ranks(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the logs a failure keeps
    from miles_core.train.launch import TrainerProcessError

    cfg = ds_cfg(num_processes=2)
    cfg = cfg.model_copy(update={"backend": cfg.backend.model_copy(update={"startup_timeout_s": 0.5})})
    # Which ranks are missing depends on the machine's speed: none may have connected yet, one, or
    # both (then the deadline ends while they build their trainers).
    expected = r"timed out after 0.5 s waiting for trainer ranks \[(0, 1|0|1)\] of 2 to (start and connect|build)"
    with pytest.raises(TrainerProcessError, match=expected) as info:
        setup_trainer(cfg, str(tiny_model_dir), weight_store(tmp_path))
    assert "launcher exit code: none: it was still running, and was stopped" in str(info.value)
