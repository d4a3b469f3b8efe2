"""An engine in the trainer's process generating with the trainer's own weight tensors
(``HFEngine.share_weights``, chosen by ``shares_trainer_weights``): one copy of the model in memory
instead of two, and every result the same as an engine with its own copy would give."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from contract.engine_contract import greedy_params, requests

from test_trainer import REWARDS_A, REWARDS_B, FakeWeightStore, make_batch
from test_trainer_lora import LORA, FolderWeightStore

from miles_core.config import HFEngineConfig, RunConfig, TrainConfig
from miles_core.engines.hf import HFEngine
from miles_core.session.parts import trainer_weights
from miles_core.train.torch_trainer import TorchTrainer


def _generate(engine, adapter=None):
    reqs = requests(engine.tokenizer, greedy_params())
    if adapter is not None:
        reqs = [replace(r, adapter=adapter) for r in reqs]
    return asyncio.run(engine.generate(reqs))


def _same_results(a, b) -> None:
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    for ra, rb in zip(a, b):
        torch.testing.assert_close(torch.tensor(ra.logprobs), torch.tensor(rb.logprobs), atol=1e-5, rtol=0)


def _storages(module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


def test_a_sync_runs_engine_follows_the_trainers_weights_without_a_copy(tiny_model_dir, tmp_path):
    trainer = TorchTrainer(str(tiny_model_dir), TrainConfig(global_batch_size=8, lr=1e-2), FakeWeightStore(tmp_path))
    shared = HFEngine(str(tiny_model_dir), HFEngineConfig())
    shared.share_weights(trainer.model, live_version=lambda: trainer.version)
    assert _storages(shared.model) <= _storages(trainer.model)  # no weight of its own

    own = HFEngine(str(tiny_model_dir), HFEngineConfig())
    _same_results(_generate(shared), _generate(own))
    for rewards in (REWARDS_A, REWARDS_B):
        trainer.step(make_batch(rewards))
        uri = trainer.export(trainer.version)
        asyncio.run(shared.update_weights(uri, trainer.version))  # reads nothing: it has them
        asyncio.run(own.update_weights(uri, trainer.version))
        assert shared.weight_version == own.weight_version == trainer.version
        results = _generate(shared)
        assert {r.weight_version for r in results} == {trainer.version}
        _same_results(results, _generate(own))
    # any other version would overwrite the trainer's weights: refused, the weights untouched
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"trainer's weights, version 2; it cannot load version 1"):
        asyncio.run(shared.update_weights(str(tmp_path / "v000001.safetensors"), 1))
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    assert shared.weight_version == 2


def test_a_lora_runs_engines_share_the_frozen_base_and_load_adapters_by_name(tiny_model_dir, tmp_path):
    trainer = TorchTrainer(str(tiny_model_dir), TrainConfig(global_batch_size=8, lr=1e-2), FolderWeightStore(tmp_path),
                           lora=LORA)
    shared = HFEngine(str(tiny_model_dir), HFEngineConfig())
    shared.share_weights(trainer.model)  # a PEFT model lends its base
    assert _storages(shared.model) <= _storages(trainer.model)
    own = _adapter_after_a_step(tiny_model_dir, trainer, shared, "policy")
    _same_results(_generate(shared), _generate(own))  # the base itself is the starting model
    base = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(RuntimeError, match="frozen base it shares"):  # base weights would land in the trainer's
        asyncio.run(shared.update_weights(str(tiny_model_dir), 1))
    assert all(torch.equal(v, base[k]) for k, v in trainer.model.state_dict().items())


def test_a_multi_lora_runs_engines_share_the_adapter_banks_base(tiny_model_dir, tmp_path):
    from miles_core.train.adapter_bank import AdapterBank

    bank = AdapterBank(str(tiny_model_dir))
    trainer = bank.add("a0", LORA, TrainConfig(global_batch_size=8, lr=1e-2), FolderWeightStore(tmp_path))
    shared = HFEngine(str(tiny_model_dir), HFEngineConfig())
    shared.share_weights(bank.model)  # its LoRA layers keep the wrapped layer as ``base``
    assert _storages(shared.model) <= _storages(bank.model)
    _adapter_after_a_step(tiny_model_dir, trainer, shared, "a0")


def _adapter_after_a_step(model_dir, trainer, shared: HFEngine, name: str) -> HFEngine:
    """One step of ``trainer``'s adapter, loaded as ``name`` into ``shared`` and into an engine with its
    own copy of the base: both generate the same. Returns the latter."""
    own = HFEngine(str(model_dir), HFEngineConfig())
    trainer.step(make_batch(REWARDS_A))
    folder = trainer.export(trainer.version)
    for engine in (shared, own):
        asyncio.run(engine.load_adapter(name, folder, trainer.version))
    _same_results(_generate(shared, name), _generate(own, name))
    return own


def test_a_model_that_does_not_match_is_refused_naming_the_weight(tiny_model_dir, tmp_path):
    engine = HFEngine(str(tiny_model_dir), HFEngineConfig())
    other = HFEngine(str(tiny_model_dir), HFEngineConfig(), dtype="bfloat16")
    with pytest.raises(ValueError, match=r"cannot share weight model\.\S+ \(.*torch\.float32.*torch\.bfloat16"):
        engine.share_weights(other.model)


@pytest.mark.parametrize(("settings", "rollout", "evaluation"), [
    ({}, "follows", None),                                                  # sync: rollouts only between steps
    ({"mode": {"type": "async"}}, None, None),                              # async: the next rollout overlaps a step
    ({"mode": {"type": "async"}, "lora": {"rank": 8}}, "frozen", "frozen"),  # a frozen base: every engine
    ({"mode": {"type": "fully_async"}, "lora": {"rank": 8}}, "frozen", "frozen"),
    ({"engine": {"type": "hf", "share_trainer_weights": False}}, None, None),
    ({"engine": {"type": "hf", "device": "cuda"}}, None, None),             # not on the trainer's device
    ({"train": {"backend": {"type": "deepspeed"}}}, None, None),            # DeepSpeed moves weights into its buffers
    ({"engine": {"type": "sglang", "url": "http://127.0.0.1:1"}, "eval": {"engine": "shared"}}, None, None),
])
def test_which_engines_generate_with_the_trainers_weights(settings, rollout, evaluation):
    cfg = RunConfig.model_validate(settings)
    trainer = SimpleNamespace(model="the trainer's model", version=7)
    for engine_cfg, is_rollout, expected in ((cfg.engine, True, rollout),
                                             (cfg.eval.engine_config or cfg.engine, False, evaluation)):
        lent = trainer_weights(cfg, engine_cfg, lambda: trainer, rollout=is_rollout)
        if expected is None:
            assert lent is None
        else:
            assert lent.module() == "the trainer's model"
            assert (lent.version is None) == (expected == "frozen")
            assert lent.version is None or lent.version() == 7
