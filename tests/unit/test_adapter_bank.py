"""AdapterBank: many LoRA adapters on one base, their steps fused. Each adapter's fused step is its
own TorchTrainer + PEFT step (same weights, same metrics); its export loads in PEFT and gives the
bank's logits for it; merge() is PEFT's merge; an adapter that leaves releases the others; a
failing adapter fails alone; checkpoints round-trip."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from test_trainer import REWARDS_A, REWARDS_B, make_batch, make_groups
from test_trainer_lora import FolderWeightStore, load_base, logits

from miles_core.config import LoraConfig, TrainConfig
from miles_core.train.adapter_bank import AdapterBank
from miles_core.train.torch_trainer import TorchTrainer

torch.set_num_threads(1)

# adapters that differ in everything the bank lets them: rank, alpha, targets, learning rate, loss
ADAPTERS = {
    "d": (LoraConfig(rank=4, target_modules=["q_proj", "v_proj"], adapter_name="d"), TrainConfig(lr=3e-3)),
    "b": (LoraConfig(rank=8, alpha=4.0, target_modules=["q_proj", "down_proj"], adapter_name="b"),
          TrainConfig(lr=1e-3, micro_batch_size=3)),
    "c": (LoraConfig(rank=2, target_modules=["o_proj"], adapter_name="c"),
          TrainConfig(lr=2e-3, global_batch_size=4, kl_loss_coef=0.1)),
}


# The fused pass batches rows of several adapters together, so every matmul and reduction sums in
# another order than the separate trainer's: fp32 rounds each sum of k terms to within ~k * 1.2e-7
# (k up to a few hundred here: hidden size, sequence, vocabulary), and the loss, a mean of
# advantage-weighted terms of either sign, loses a further factor ~10-100 to cancellation. 2e-4
# relative is what that arithmetic allows (a machine measured 1.03e-5 on the loss); a real bug
# (another adapter's prompts, a dropped token, a wrong scale) moves these metrics by percent.
METRIC_RTOL = 2e-4
# Two AdamW steps move a weight by ~lr (1e-3..3e-3) each; a gradient component near zero can round
# to another Adam direction, so weights may differ by a small fraction of one step, never by a step.
WEIGHT_ATOL = 1e-5


def bank_of(model_dir, tmp_path, adapters=ADAPTERS, **kw):
    bank = AdapterBank(str(model_dir), **kw)
    trainers = {n: bank.add(n, lora, cfg, FolderWeightStore(tmp_path / n)) for n, (lora, cfg) in adapters.items()}
    return bank, trainers


def step_in_threads(trainers, batches):
    """Every trainer's step on its own thread, as a multi-LoRA run's adapter subflows call it."""
    results, errors = {}, {}

    def one(name):
        try:
            results[name] = trainers[name].step(batches[name])
        except Exception as e:  # noqa: BLE001
            errors[name] = e

    threads = [threading.Thread(target=one, args=(n,)) for n in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a fused step hung"
    return results, errors


@pytest.mark.parametrize("peft_shares_prompts", [True, False])
def test_each_adapters_fused_step_is_its_own_peft_step(tiny_model_dir, tmp_path, peft_shares_prompts):
    """The bank's fused pass runs each adapter's prompts once (never one adapter's for another's):
    the same step as a PEFT trainer of that adapter alone, with or without sharing prompts."""
    separate = {n: TorchTrainer(str(tiny_model_dir), cfg.model_copy(update={"share_prompt_forward": peft_shares_prompts}),
                                FolderWeightStore(tmp_path / f"sep-{n}"), lora=lora)
                for n, (lora, cfg) in ADAPTERS.items()}
    bank, fused = bank_of(tiny_model_dir, tmp_path)
    for n in ADAPTERS:  # the same starting A (B is zero in both)
        fused[n].load_model_state(separate[n].weights())
    for rewards in (REWARDS_A, REWARDS_B):
        want = {n: t.step(make_batch(rewards)) for n, t in separate.items()}
        got, errors = step_in_threads(fused, {n: make_batch(rewards) for n in ADAPTERS})
        assert not errors
        for n in ADAPTERS:
            assert got[n]["num_optimizer_steps"] == want[n]["num_optimizer_steps"] >= 1
            assert got[n]["train_tokens"] == want[n]["train_tokens"]
            for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
                assert got[n][k] == pytest.approx(want[n][k], rel=METRIC_RTOL, abs=1e-7), (n, k)
            assert fused[n].version == separate[n].version
    assert bank.adapters_per_step == [3, 3]  # one step for all three, each time
    for n in ADAPTERS:
        w, s = fused[n].weights(), separate[n].weights()
        assert set(w) == set(s)
        moved = [k for k in w if not torch.equal(w[k], torch.zeros_like(w[k])) and ".lora_B." in k]
        assert moved, f"adapter {n} did not train"
        for k in w:
            torch.testing.assert_close(w[k], s[k], atol=WEIGHT_ATOL, rtol=1e-4, msg=lambda m, k=k: f"{n} {k}: {m}")


def test_export_loads_in_peft_with_the_banks_logits_and_merge_is_peft_merge(tiny_model_dir, tmp_path):
    from peft import PeftModel

    bank, trainers = bank_of(tiny_model_dir, tmp_path)
    step_in_threads(trainers, {n: make_batch(REWARDS_A) for n in ADAPTERS})
    step_in_threads(trainers, {n: make_batch(REWARDS_B) for n in ADAPTERS})
    samples = make_groups(REWARDS_A)[1].samples
    bank.model.eval()
    for name, trainer in trainers.items():
        loaded = PeftModel.from_pretrained(load_base(tiny_model_dir), trainer.export(trainer.version)).eval()
        with bank.route([(name, 0, len(samples))]):
            mine = logits(bank.model, samples)
        torch.testing.assert_close(logits(loaded, samples), mine, atol=1e-5, rtol=1e-5)
        merged_peft = loaded.merge_and_unload().state_dict()
        merged = trainer.merge()
        assert set(merged) == set(merged_peft)
        for k, v in merged_peft.items():
            torch.testing.assert_close(merged[k], v, atol=1e-6, rtol=0, msg=lambda m, k=k: f"{name} {k}: {m}")
    with bank.route([]):  # no adapter: the base, exactly
        torch.testing.assert_close(logits(bank.model, samples), logits(load_base(tiny_model_dir), samples), atol=0, rtol=0)


def test_an_adapter_that_leaves_releases_the_others(tiny_model_dir, tmp_path):
    bank, trainers = bank_of(tiny_model_dir, tmp_path, gather_timeout_s=3600)  # only leave() can release them
    done = threading.Event()
    out = {}

    def d_alone():
        out["d"] = trainers["d"].step(make_batch(REWARDS_A))
        done.set()

    thread = threading.Thread(target=d_alone)
    thread.start()
    bank.leave("b")
    assert not done.wait(0.2), "stepped while c was still training"
    bank.leave("c")
    assert done.wait(60), "d stayed waiting after every other adapter left"
    thread.join()
    assert out["d"]["num_optimizer_steps"] == 1 and bank.adapters_per_step == [1]


def test_a_failing_batch_fails_its_adapter_alone(tiny_model_dir, tmp_path):
    bank, trainers = bank_of(tiny_model_dir, tmp_path, gather_timeout_s=3600)
    empty = make_batch(REWARDS_A)
    empty.samples.clear()
    got, errors = step_in_threads(trainers, {"d": make_batch(REWARDS_B), "b": make_batch(REWARDS_B), "c": empty})
    assert set(got) == {"d", "b"} and set(errors) == {"c"} and "no samples" in str(errors["c"])
    assert trainers["d"].version == 1 and trainers["b"].version == 1 and trainers["c"].version == 0
    assert bank.adapters_per_step == [2]  # one step for d and b together; c failed before it


def test_a_late_adapter_is_stepped_without_after_the_gather_timeout(tiny_model_dir, tmp_path):
    bank, trainers = bank_of(tiny_model_dir, tmp_path, gather_timeout_s=0.3)
    metrics = trainers["d"].step(make_batch(REWARDS_A))  # b and c never hand in a batch
    assert metrics["num_optimizer_steps"] == 1 and bank.adapters_per_step == [1]


def test_checkpoint_round_trip_and_a_mismatched_checkpoint_is_named(tiny_model_dir, tmp_path):
    bank, trainers = bank_of(tiny_model_dir, tmp_path)
    step_in_threads(trainers, {n: make_batch(REWARDS_A) for n in ADAPTERS})
    state = trainers["d"].state_dict()
    again, fresh = bank_of(tiny_model_dir, tmp_path / "again")
    fresh["d"].load_state_dict(state)
    assert fresh["d"].version == 1
    for k, v in trainers["d"].weights().items():
        torch.testing.assert_close(fresh["d"].weights()[k], v, atol=0, rtol=0)
    with pytest.raises(ValueError, match="adapter 'b' of the bank: missing"):
        fresh["b"].load_state_dict(state)


def test_a_checkpoint_of_a_peft_trainer_resumes_on_the_bank(tiny_model_dir, tmp_path):
    """A run checkpointed with a trainer per adapter (PEFT's parameter names) resumes on one base:
    the same adapter weights, and AdamW's moments on the same tensors (both in module order)."""
    lora, cfg = ADAPTERS["b"]
    peft_trainer = TorchTrainer(str(tiny_model_dir), cfg, FolderWeightStore(tmp_path / "peft"), lora=lora)
    peft_trainer.step(make_batch(REWARDS_A))
    bank, trainers = bank_of(tiny_model_dir, tmp_path)
    trainers["b"].load_state_dict(copy.deepcopy(peft_trainer.state_dict()))  # as saved: no tensor shared
    assert trainers["b"].version == 1
    for k, v in peft_trainer.weights().items():
        torch.testing.assert_close(trainers["b"].weights()[k], v, atol=0, rtol=0)
    want = peft_trainer.step(make_batch(REWARDS_B))
    got, errors = step_in_threads({"b": trainers["b"]}, {"b": make_batch(REWARDS_B)})
    assert not errors
    assert got["b"]["loss"] == pytest.approx(want["loss"], rel=1e-5) and got["b"]["grad_norm"] == pytest.approx(
        want["grad_norm"], rel=1e-5)
    for k, v in peft_trainer.weights().items():
        torch.testing.assert_close(trainers["b"].weights()[k], v, atol=1e-6, rtol=1e-5)
