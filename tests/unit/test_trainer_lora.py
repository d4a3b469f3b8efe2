"""TorchTrainer with a LoRA adapter (PEFT) on the tiny model: only the adapter trains, the exported
adapter folder reproduces the policy in PEFT and in the HF engine, ``merge()``, micro-batch
invariance, checkpoint round trip, and the config and flags."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch
from pydantic import ValidationError
from test_trainer import (
    REWARDS_A,
    REWARDS_B,
    FakeWeightStore,
    assert_micro_batch_invariance,
    assert_same_params,
    make_batch,
    make_groups,
    params,
)

from miles_core.config import GRPOLossConfig, LoraConfig, RunConfig, TrainConfig
from miles_core.train import setup_trainer
from miles_core.train.batch import collate
from miles_core.train.losses import token_logprobs
from miles_core.train.torch_trainer import TorchTrainer

torch.set_num_threads(1)
# ``test_trainer`` resolves because pytest puts tests/unit (a folder without __init__.py) on sys.path.

LORA = LoraConfig(rank=4, target_modules=["q_proj", "v_proj"])


class FolderWeightStore(FakeWeightStore):
    """``FakeWeightStore`` plus the folder publishing LoRA exports use."""

    def publish_folder(self, version, local_dir):
        target = self.root / f"v{version:06d}"
        shutil.copytree(local_dir, target)
        return str(target)


def make_lora_trainer(model_dir, tmp_path, lora=LORA, **cfg):
    cfg.setdefault("global_batch_size", 8)
    return TorchTrainer(str(model_dir), TrainConfig(**cfg), FolderWeightStore(tmp_path), lora=lora)


def logits(model, samples):
    ids = collate(samples)
    with torch.no_grad():
        return model(input_ids=ids.input_ids, attention_mask=ids.attention_mask).logits


def load_base(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir))


def test_version_0_is_the_base_and_only_the_adapter_trains(tiny_model_dir, tmp_path):
    trainer = setup_trainer(TrainConfig(global_batch_size=8), str(tiny_model_dir), FolderWeightStore(tmp_path), lora=LORA)
    samples = make_groups(REWARDS_A)[0].samples
    # B starts at zero, so the adapter adds exactly nothing
    torch.testing.assert_close(logits(trainer.model, samples), logits(load_base(tiny_model_dir), samples), atol=0, rtol=0)
    trainable = {k for k, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.policy." in k or ".lora_B.policy." in k for k in trainable)
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(trainable)

    start = params(trainer)
    trainer.step(make_batch(REWARDS_A))
    one = params(trainer)
    trainer.step(make_batch(REWARDS_B))
    two = params(trainer)
    changed_base = [k for k in start if k not in trainable and not torch.equal(start[k], two[k])]
    assert not changed_base, f"base parameters changed: {changed_base}"
    # step 1: the gradient of A is B^T (...) = 0 while B = 0, so only B moves; step 2 moves A too
    assert all(not torch.equal(start[k], one[k]) for k in trainable if ".lora_B." in k)
    assert all(torch.equal(start[k], one[k]) for k in trainable if ".lora_A." in k)
    unchanged = [k for k in trainable if torch.equal(start[k], two[k])]
    assert not unchanged, f"adapter parameters not updated: {unchanged}"
    assert set(trainer.weights()) == {k.replace(".policy.", ".") for k in trainable}


def test_exported_adapter_loads_in_peft_and_reproduces_the_logits(tiny_model_dir, tmp_path):
    from peft import PeftModel

    trainer = make_lora_trainer(tiny_model_dir, tmp_path)
    trainer.step(make_batch(REWARDS_A))
    folder = trainer.export(trainer.version)
    loaded = PeftModel.from_pretrained(load_base(tiny_model_dir), folder).eval()
    samples = make_groups(REWARDS_A)[1].samples
    torch.testing.assert_close(logits(loaded, samples), logits(trainer.model, samples), atol=0, rtol=0)


def test_exported_adapter_serves_in_the_hf_engine(tiny_model_dir, tmp_path):
    from miles_core.config import HFEngineConfig
    from miles_core.engines.base import GenerateRequest, SamplingParams
    from miles_core.engines.hf import HFEngine
    from miles_core.storage import WeightStore

    store = WeightStore(str(tmp_path / "weights"))
    trainer = TorchTrainer(str(tiny_model_dir), TrainConfig(global_batch_size=8), store, lora=LORA)
    trainer.step(make_batch(REWARDS_A))
    uri = trainer.export(trainer.version)
    assert store.latest() == 1

    engine = HFEngine(str(tiny_model_dir), HFEngineConfig())
    try:
        asyncio.run(engine.load_adapter("policy", uri))
        prompt = make_groups(REWARDS_A)[0].samples[0].prompt_ids
        greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
        (result,) = asyncio.run(engine.generate([GenerateRequest(prompt, greedy, adapter="policy")]))
    finally:
        asyncio.run(engine.close())
    assert result.output_ids
    ids = torch.tensor([prompt + result.output_ids])
    trainer.model.eval()
    with torch.no_grad():
        out = trainer.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    # greedy: each output token is the trainer's argmax, with the trainer's (raw-logit) logprob
    assert out.argmax(-1).tolist() == result.output_ids
    want = token_logprobs(out, torch.tensor(result.output_ids)).tolist()
    assert result.logprobs == pytest.approx(want, abs=1e-5)


def test_merge_equals_peft_merged_weights_and_leaves_the_adapter_unmerged(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    trainer = make_lora_trainer(tiny_model_dir, tmp_path)
    trainer.step(make_batch(REWARDS_A))
    trainer.step(make_batch(REWARDS_B))
    merged = trainer.merge()
    want = PeftModel.from_pretrained(load_base(tiny_model_dir), trainer.export(trainer.version)).merge_and_unload()
    want_state = want.state_dict()
    assert set(merged) == set(want_state)
    for k, v in want_state.items():
        torch.testing.assert_close(merged[k], v, atol=0, rtol=0, msg=lambda m, n=k: f"{n}: {m}")

    layers = [m for m in trainer.model.modules() if isinstance(m, LoraLayer)]
    assert layers and not any(m.merged for m in layers)
    full = load_base(tiny_model_dir)
    full.load_state_dict(merged, strict=True)
    samples = make_groups(REWARDS_A)[0].samples
    torch.testing.assert_close(logits(full, samples), logits(trainer.model, samples), atol=1e-5, rtol=0)


VARIANTS = {
    "grpo": dict(loss=GRPOLossConfig()),
    "seq_mean_entropy_kl": dict(loss=GRPOLossConfig(reducer="seq_mean"), entropy_coef=0.01, kl_loss_coef=0.1),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_micro_batch_size_does_not_change_the_lora_update(tiny_model_dir, tmp_path, variant):
    assert_micro_batch_invariance(make_lora_trainer, tiny_model_dir, tmp_path, VARIANTS[variant])


def test_kl_reference_is_the_base_with_the_adapter_off(tiny_model_dir, tmp_path):
    trainer = make_lora_trainer(tiny_model_dir, tmp_path, kl_loss_coef=0.1, global_batch_size=None)
    assert trainer.ref_model is None  # no second copy of the model
    assert abs(trainer.step(make_batch(REWARDS_A))["kl"]) < 1e-6
    assert trainer.step(make_batch(REWARDS_A))["kl"] > 0
    # the reference is still the base after training
    samples = make_groups(REWARDS_A)[0].samples
    with trainer.model.disable_adapter():
        ref = logits(trainer.model, samples)
    torch.testing.assert_close(ref, logits(load_base(tiny_model_dir), samples), atol=0, rtol=0)


def test_lora_checkpoint_round_trip_restores_adapter_and_optimizer(tiny_model_dir, tmp_path):
    cfg = dict(global_batch_size=4, micro_batch_size=2)
    ckpt = str(tmp_path / "ckpt" / "trainer.pt")
    straight = make_lora_trainer(tiny_model_dir, tmp_path, **cfg)
    straight.step(make_batch(REWARDS_A))
    straight.save(ckpt)
    state = torch.load(ckpt, weights_only=True)
    assert state["model"] and all(".lora_" in k for k in state["model"])  # the frozen base is not saved
    assert state["optimizer"]["state"]  # Adam moments of the adapter
    m_straight = straight.step(make_batch(REWARDS_B))

    resumed = make_lora_trainer(tiny_model_dir, tmp_path, **cfg)
    resumed.load(ckpt)
    assert resumed.version == 2
    m_resumed = resumed.step(make_batch(REWARDS_B))
    assert m_resumed["loss"] == pytest.approx(m_straight["loss"], abs=1e-7)
    assert_same_params(straight, resumed, atol=1e-7)


def test_full_checkpoint_does_not_load_into_a_lora_trainer(tiny_model_dir, tmp_path):
    full = TorchTrainer(str(tiny_model_dir), TrainConfig(global_batch_size=8), FakeWeightStore(tmp_path))
    lora = make_lora_trainer(tiny_model_dir, tmp_path)
    with pytest.raises(ValueError, match="checkpoint does not match this trainer's LoRA adapter 'policy'"):
        lora.load_state_dict(full.state_dict())


# ------------------------------------------------------------------------------------------ config


def test_lora_config_is_validated():
    assert LoraConfig(rank=8).lora_alpha == 16.0  # alpha None: 2 * rank
    assert LoraConfig(rank=8, alpha=8).lora_alpha == 8.0
    assert LoraConfig(rank=1).target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    with pytest.raises(ValidationError, match="rank"):
        LoraConfig(rank=0)
    with pytest.raises(ValidationError, match="rank"):
        LoraConfig()
    for bad in ("", "lora", "a", "_", "__base__"):
        with pytest.raises(ValidationError, match="adapter_name"):
            LoraConfig(rank=4, adapter_name=bad)
    with pytest.raises(ValidationError, match="target_modules"):
        LoraConfig(rank=4, target_modules=[])
    assert RunConfig().lora is None


def test_lora_flags_set_the_lora_config():
    from miles_core.cli import build_parser, resolve_config
    from miles_core.miles_flags import FLAGS

    assert {f: FLAGS[f] for f in ("--lora-rank", "--lora-alpha", "--lora-dropout", "--target-modules")} == {
        "--lora-rank": "lora.rank", "--lora-alpha": "lora.alpha", "--lora-dropout": "lora.dropout",
        "--target-modules": "lora.target_modules"}
    argv = ["show-config", "--lora-rank", "8", "--lora-alpha", "32", "--lora-dropout", "0.05",
            "--target-modules", "q_proj", "v_proj"]
    cfg = resolve_config(build_parser().parse_args(argv))
    assert cfg.lora == LoraConfig(rank=8, alpha=32, dropout=0.05, target_modules=["q_proj", "v_proj"])
