"""TorchTrainer on the tiny model: smoke, invariance (micro-batching, old-logprob source, resume),
export round trip, KL at the reference, the batch alignment it relies on, rollout correction
(mismatch metrics, TIS / mask) and several optimizer steps per rollout batch."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from miles_core.config import (
    DrGRPOLossConfig,
    GRPOLossConfig,
    GSPOLossConfig,
    ReinforcePPBaselineLossConfig,
    ReinforcePPLossConfig,
    TrainConfig,
)
from miles_core.models.tiny import build_tokenizer
from miles_core.train import setup_trainer
from miles_core.train.base import Trainer, TrainBatch
from miles_core.train.batch import collate
from miles_core.train.losses import token_logprobs
from miles_core.train.torch_trainer import TorchTrainer
from miles_core.types import Group, Sample

torch.set_num_threads(1)

# two prompts x four answers (ragged lengths), rewards giving nonzero advantages in both groups
ANSWERS = {"1+2=": ["3", "12", "4", "03"], "10+5=": ["15", "5", "105", "16"]}
REWARDS_A = [[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]
REWARDS_B = [[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]]


class FakeWeightStore:
    """The one WeightStore method the trainer calls; writes the bytes the real store writes (a tied
    head written out, as for a server engine), as one file."""

    def __init__(self, root):
        self.root = root

    def publish(self, version, state_dict, metadata=None):
        from miles_core.storage.weights import _SafetensorsLayout

        path = self.root / f"v{version:06d}.safetensors"
        with open(path, "wb") as f:
            _SafetensorsLayout(state_dict, metadata or {}, None, tied_once=False).write(f)
        return str(path)


def make_groups(rewards, logprob_model=None, temperature=1.0):
    tok = build_tokenizer()
    groups = []
    for g, (prompt, answers) in enumerate(ANSWERS.items()):
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        samples = []
        for i, answer in enumerate(answers):
            response_ids = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
            loss_mask = [1] * len(response_ids)
            if len(response_ids) == 4:
                loss_mask[1] = 0  # a masked token in the middle (like tool output)
            samples.append(
                Sample(prompt, prompt_ids, response_ids, answer, reward=rewards[g][i], loss_mask=loss_mask,
                       group_index=g, sample_index=i)
            )
        groups.append(Group(samples))
    if logprob_model is not None:
        for s in (s for g in groups for s in g.samples):
            s.rollout_logprobs = _single_sequence_logprobs(logprob_model, s, temperature)
    return groups


def _single_sequence_logprobs(model, s, temperature):
    """Logprobs of each response token, from a forward pass of this sample alone (no padding)."""
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    positions = torch.arange(len(s.response_ids)) + len(s.prompt_ids) - 1  # logits predicting response j
    return token_logprobs(logits[positions], torch.tensor(s.response_ids), temperature).tolist()


def make_batch(rewards, temperature=1.0, logprob_model=None, loss=None):
    return TrainBatch.from_groups(make_groups(rewards, logprob_model, temperature), temperature=temperature, loss=loss)


def make_trainer(model_dir, tmp_path, **cfg):
    cfg.setdefault("global_batch_size", 8)
    return TorchTrainer(str(model_dir), TrainConfig(**cfg), FakeWeightStore(tmp_path))


def params(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


def assert_same_params(a, b, atol):
    pa, pb = params(a), params(b)
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


# -------------------------------------------------------------------------------------------- batch


def test_collate_aligns_response_token_j_with_logits_position_prompt_len_plus_j_minus_1():
    groups = make_groups(REWARDS_A)
    samples = [s for g in groups for s in g.samples]
    samples[2].reward = None  # a failed sample keeps its row but trains nothing
    for s in samples:
        s.rollout_logprobs = [-0.1 * (j + 1) for j in range(len(s.response_ids))]
    tb = collate(samples)
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        assert tb.input_ids[i, : s.total_len].tolist() == s.prompt_ids + s.response_ids
        assert tb.attention_mask[i].sum() == s.total_len  # right padding: real tokens first
        for j, token in enumerate(s.response_ids):
            assert tb.labels[i, p + j - 1] == token
            assert tb.rollout_logprobs[i, p + j - 1].item() == pytest.approx(-0.1 * (j + 1))
            assert tb.loss_mask[i, p + j - 1] == (0 if s.reward is None else s.loss_mask[j])
        assert tb.loss_mask[i].sum() == (0 if s.reward is None else sum(s.loss_mask))


def test_collate_fills_every_cell_as_the_layout_says_padding_included():
    """Ragged rows, a failed sample, samples with and without rollout logprobs, a pad id of 7: every
    cell of every tensor, checked against the layout of the module docstring one cell at a time."""
    import random

    rng = random.Random(3)
    samples = []
    for i in range(9):
        prompt, response = [rng.randrange(2, 30) for _ in range(rng.randint(1, 5))], [rng.randrange(2, 30) for _ in
                                                                                      range(rng.randint(1, 6))]
        samples.append(Sample("p", prompt, response, reward=None if i == 4 else 1.0,
                              loss_mask=[rng.randrange(2) for _ in response],
                              rollout_logprobs=[-rng.random() for _ in response] if i % 2 else []))
    tb, width = collate(samples, pad_id=7), max(s.total_len for s in samples)
    for i, s in enumerate(samples):
        ids, p = s.prompt_ids + s.response_ids, len(s.prompt_ids)
        for c in range(width):
            j = c - (p - 1)  # the response token column c predicts
            response = 0 <= j < len(s.response_ids)
            assert tb.input_ids[i, c] == (ids[c] if c < len(ids) else 7)
            assert tb.attention_mask[i, c] == (c < len(ids))
            assert tb.position_ids[i, c] == c
            assert tb.labels[i, c] == (ids[c + 1] if c + 1 < len(ids) else 7)
            assert tb.loss_mask[i, c] == (s.loss_mask[j] if response and s.reward is not None else 0)
            want = s.rollout_logprobs[j] if response and s.rollout_logprobs else 0.0
            assert tb.rollout_logprobs[i, c].item() == pytest.approx(want, abs=1e-7)
        assert tb.lengths[i] == len(ids)
    assert (tb.input_ids.dtype, tb.loss_mask.dtype, tb.rollout_logprobs.dtype) == (torch.long, torch.float32,
                                                                                  torch.float32)


def test_collate_rejects_mismatched_loss_mask():
    s = Sample("1+2=", [3, 4], [5, 1], reward=1.0, loss_mask=[1])
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 response tokens"):
        collate([s])


# ------------------------------------------------------------------------------------------ trainer


def test_one_step_changes_every_parameter(tiny_model_dir, tmp_path):
    trainer = setup_trainer(TrainConfig(global_batch_size=8), str(tiny_model_dir), FakeWeightStore(tmp_path))
    assert isinstance(trainer, Trainer) and trainer.ref_model is None  # no KL term: no reference copy
    before = params(trainer)
    metrics = trainer.step(make_batch(REWARDS_A))
    after = params(trainer)
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert not unchanged, f"parameters not updated: {unchanged}"
    assert metrics["num_optimizer_steps"] == 1 and metrics["version"] == 1 and trainer.version == 1
    assert metrics["train_tokens"] == 21  # 22 response tokens (answers + eos) minus the masked one of "105"
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # recomputed old logprobs: ratio 1
    assert metrics["clipfrac"] == 0.0 and metrics["grad_norm"] > 0
    assert metrics["entropy"] > 0


LOSSES = {
    "grpo_token_mean": dict(loss=GRPOLossConfig(reducer="token_mean")),
    "grpo_seq_mean": dict(loss=GRPOLossConfig(reducer="seq_mean")),
    "grpo_dual_clip_entropy_kl": dict(loss=GRPOLossConfig(eps_clip_c=3.0), entropy_coef=0.01, kl_loss_coef=0.1),
    "dr_grpo": dict(loss=DrGRPOLossConfig(max_len=6)),
    "gspo": dict(loss=GSPOLossConfig()),
    "reinforce_plus_plus": dict(loss=ReinforcePPLossConfig(reducer="seq_mean")),
    "reinforce_plus_plus_baseline_kl_in_reward": dict(loss=ReinforcePPBaselineLossConfig(), kl_coef=0.05),
}


@pytest.mark.parametrize("variant", LOSSES)
def test_micro_batch_size_does_not_change_the_update(tiny_model_dir, tmp_path, variant):
    assert_micro_batch_invariance(make_trainer, tiny_model_dir, tmp_path, LOSSES[variant])


def assert_micro_batch_invariance(make, model_dir, tmp_path, cfg: dict) -> None:
    """Micro-batches of 1 and of 8 give the same losses, gradient norm and updated weights."""
    batch = make_batch(REWARDS_A, loss=cfg["loss"])
    one = make(model_dir, tmp_path, micro_batch_size=1, clip_grad=0.0, **cfg)
    eight = make(model_dir, tmp_path, micro_batch_size=8, clip_grad=0.0, **cfg)
    m1, m8 = one.step(batch), eight.step(batch)
    # grad_norm is scale-sensitive (Adam's first step nearly is not), so it catches a wrong normaliser
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "kl"):
        assert m1[key] == pytest.approx(m8[key], abs=1e-5), key
    assert m1["grad_norm"] > 0
    assert_same_params(one, eight, atol=1e-5)


def test_entropy_bonus_alone_trains_when_advantages_are_zero(tiny_model_dir, tmp_path):
    # every reward equal: GRPO advantages are all 0, so the policy gradient is 0 and only the
    # entropy bonus moves the weights; loss = 0 - 0.1 * H
    flat = [[1.0] * 4, [1.0] * 4]
    plain = make_trainer(tiny_model_dir, tmp_path)
    bonus = make_trainer(tiny_model_dir, tmp_path, entropy_coef=0.1)
    m_plain, m_bonus = plain.step(make_batch(flat)), bonus.step(make_batch(flat))
    assert m_plain["grad_norm"] == 0.0
    assert m_bonus["grad_norm"] > 0 and m_bonus["pg_loss"] == 0.0
    assert m_bonus["loss"] == pytest.approx(-0.1 * m_bonus["entropy"], abs=1e-6)


def test_recompute_and_rollout_old_logprobs_agree_when_weights_agree(tiny_model_dir, tmp_path):
    temperature = 0.7
    recompute = make_trainer(tiny_model_dir, tmp_path, old_logprobs="recompute", micro_batch_size=3)
    rollout = make_trainer(tiny_model_dir, tmp_path, old_logprobs="rollout", micro_batch_size=3)
    batch = make_batch(REWARDS_A, temperature, logprob_model=rollout.model)
    m_re, m_ro = recompute.step(batch), rollout.step(batch)
    assert m_ro["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m_re["loss"] == pytest.approx(m_ro["loss"], abs=1e-6)
    assert m_re["grad_norm"] == pytest.approx(m_ro["grad_norm"], abs=1e-5)
    assert_same_params(recompute, rollout, atol=1e-5)


def test_rollout_old_logprobs_must_be_present(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, old_logprobs="rollout")
    with pytest.raises(ValueError, match="needs rollout_logprobs"):
        trainer.step(make_batch(REWARDS_A))


def test_exported_weights_reproduce_the_logits(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    trainer = make_trainer(tiny_model_dir, tmp_path)
    trainer.step(make_batch(REWARDS_A))
    uri = trainer.export(trainer.version)
    fresh = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    fresh.load_state_dict(load_file(uri), strict=True)
    ids = collate(make_groups(REWARDS_A)[0].samples)
    with torch.no_grad():
        want = trainer.model(input_ids=ids.input_ids, attention_mask=ids.attention_mask).logits
        got = fresh(input_ids=ids.input_ids, attention_mask=ids.attention_mask).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("schedule", [{}, {"lr_decay_style": "cosine", "lr_warmup_steps": 1, "lr_decay_steps": 4,
                                           "min_lr": 1e-5}], ids=["constant", "cosine"])
def test_resumed_run_equals_uninterrupted_run(tiny_model_dir, tmp_path, schedule):
    # 2 optimizer steps per batch on shuffled minibatches: the shuffle RNG and Adam state both matter
    cfg = dict(global_batch_size=4, micro_batch_size=2, **schedule)
    ckpt = str(tmp_path / "ckpt" / "trainer.pt")
    straight = make_trainer(tiny_model_dir, tmp_path, **cfg)
    straight.step(make_batch(REWARDS_A))
    straight.save(ckpt)
    m_straight = straight.step(make_batch(REWARDS_B))

    resumed = make_trainer(tiny_model_dir, tmp_path, **cfg)
    resumed.load(ckpt)
    assert resumed.version == 2
    m_resumed = resumed.step(make_batch(REWARDS_B))
    assert resumed.version == straight.version == 4
    assert m_resumed["loss"] == pytest.approx(m_straight["loss"], abs=1e-7)
    assert_same_params(straight, resumed, atol=1e-7)


def test_each_optimizer_step_takes_its_scheduled_learning_rate(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, global_batch_size=4, micro_batch_size=4, lr=1e-3,
                           lr_decay_style="linear", lr_warmup_steps=2, lr_decay_steps=4, min_lr=1e-4)
    rates = []
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):  # the rate each optimizer step is taken with
        rates.append(trainer.optimizer.param_groups[0]["lr"])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    first = trainer.step(make_batch(REWARDS_A))  # 8 samples, 4 a step: versions 1 and 2 (warmup)
    trainer.step(make_batch(REWARDS_B))  # versions 3 and 4 (decay)
    trainer.step(make_batch(REWARDS_A))  # versions 5 and 6 (past the decay: min_lr)
    assert rates == pytest.approx([5e-4, 1e-3, 5.5e-4, 1e-4, 1e-4, 1e-4])
    assert first["lr"] == pytest.approx(7.5e-4)  # the batch's steps, averaged, in its metrics


def test_the_schedule_follows_megatron():
    from miles_core.config import TrainConfig

    linear = TrainConfig(lr=1.0, lr_decay_style="linear", lr_warmup_steps=2, lr_decay_steps=6, min_lr=0.1)
    assert [round(linear.lr_at(k), 4) for k in range(1, 9)] == [0.5, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1, 0.1]
    cosine = linear.model_copy(update={"lr_decay_style": "cosine"})
    assert cosine.lr_at(4) == pytest.approx(0.55) and cosine.lr_at(3) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + 2 ** -0.5))
    assert TrainConfig(lr=0.5).lr_at(1000) == 0.5  # constant: the default
    assert TrainConfig(lr=1.0, lr_warmup_steps=4).lr_at(1) == 0.25  # warmup, then constant
    with pytest.raises(ValueError, match="lr_decay_steps is None"):
        TrainConfig(lr_decay_style="cosine").lr_at(1)  # the run fills it in (RunConfig.trainer_config)


def test_kl_is_zero_while_the_policy_is_the_reference(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, kl_loss_coef=0.1, kl_type="k3", global_batch_size=None)
    assert trainer.ref_model is not None
    first = trainer.step(make_batch(REWARDS_A))
    assert abs(first["kl"]) < 1e-6
    second = trainer.step(make_batch(REWARDS_A))
    assert second["kl"] > 0  # the policy has moved away from the reference


def test_kl_penalty_in_the_reward_changes_the_advantages_by_hand(tiny_model_dir, tmp_path):
    """kl_coef: R' = R - kl_coef * sum_t KL_t(pi_old || pi_ref); the advantages are the loss's of R'."""
    from miles_core.train.advantages import sample_advantages

    trainer = make_trainer(tiny_model_dir, tmp_path, kl_coef=0.5, kl_type="k1", global_batch_size=None)
    assert trainer.ref_model is not None
    # at the start pi_old == pi_ref: no penalty, the plain GRPO advantages
    batch = make_batch(REWARDS_A)
    tokens, metrics = trainer._prepare(batch)
    assert metrics["kl_reward_penalty"] == pytest.approx(0.0, abs=1e-6)
    torch.testing.assert_close(tokens.advantages, torch.tensor(batch.advantages), atol=1e-5, rtol=0)
    trainer.step(make_batch(REWARDS_A))  # the policy moves away from the reference
    batch = make_batch(REWARDS_A)
    tokens, metrics = trainer._prepare(batch)
    # by hand: k1 = old - ref per trained token, summed per sample, times 0.5, off each reward
    seq_kl = ((tokens.old_logprobs - tokens.ref_logprobs) * tokens.loss_mask).sum(-1).tolist()
    shaped = [s.reward - 0.5 * k for s, k in zip(batch.samples, seq_kl)]
    expected = sample_advantages(batch.regrouped(shaped))
    assert tokens.advantages.tolist() == [pytest.approx(a, abs=1e-5) for a in expected]
    assert metrics["kl_reward_penalty"] == pytest.approx(0.5 * sum(seq_kl) / len(seq_kl), abs=1e-6)
    assert any(abs(a - b) > 1e-4 for a, b in zip(expected, batch.advantages)), "the penalty changed something"
    # the KL penalty in the reward adds no KL term to the loss
    assert trainer.cfg.kl_loss_coef == 0


def test_kl_penalty_needs_the_group_structure(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, kl_coef=0.1, global_batch_size=None)
    batch = make_batch(REWARDS_A)
    flat = TrainBatch(batch.samples, batch.advantages, batch.temperature)  # no group_sizes
    with pytest.raises(ValueError, match="no group structure"):
        trainer.step(flat)


def test_failed_samples_train_nothing(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path)
    all_failed = [[None] * 4, [None] * 4]
    before = params(trainer)
    metrics = trainer.step(make_batch(all_failed))
    assert metrics["num_optimizer_steps"] == 0 and metrics["num_excluded_samples"] == 8
    assert trainer.version == 0
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items())


def test_a_non_finite_loss_is_never_applied_to_the_weights(tiny_model_dir, tmp_path):
    """An advantage of NaN (any non-finite loss or gradient) skips the optimizer step: the weights,
    the version and AdamW's state stay as they were, and the step says so."""
    trainer = make_trainer(tiny_model_dir, tmp_path)
    batch = make_batch([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0]])
    batch.advantages[0] = float("nan")
    before = params(trainer)
    metrics = trainer.step(batch)
    assert (metrics["num_optimizer_steps"], metrics["num_nonfinite_steps"]) == (0, 1)
    assert trainer.version == 0 and not trainer.optimizer.state
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items())
    assert all(p.grad is None for p in trainer.model.parameters()), "no gradient left over for the next step"


def test_export_through_the_real_weight_store(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from miles_core.storage.weights import WeightStore, load_snapshot

    store = WeightStore(str(tmp_path / "weights"))
    trainer = TorchTrainer(str(tiny_model_dir), TrainConfig(), store)
    trainer.step(make_batch(REWARDS_A))
    uri = trainer.export(trainer.version)
    assert store.latest() == 1
    fresh = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    fresh.load_state_dict(load_snapshot(uri), strict=True)
    ids = collate(make_groups(REWARDS_A)[1].samples)
    with torch.no_grad():
        want = trainer.model(input_ids=ids.input_ids, attention_mask=ids.attention_mask).logits
        got = fresh(input_ids=ids.input_ids, attention_mask=ids.attention_mask).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# ------------------------------------------------------------------------------ rollout correction

# Rollout logprobs = the trainer's own logprobs + OFFSETS[j % 3] on response token j, as if the
# engine's weights differed: old - rollout = -offset, so the importance ratio is exp(-offset):
# e^-0.3 = 0.74082, 1, e^0.3 = 1.34986.
OFFSETS = (0.3, 0.0, -0.3)


def offset_batch(trainer, rewards=REWARDS_A):
    batch = make_batch(rewards, logprob_model=trainer.model)
    for s in batch.samples:
        s.rollout_logprobs = [lp + OFFSETS[j % 3] for j, lp in enumerate(s.rollout_logprobs)]
    return batch


def trained_tokens(batch):
    """(advantage, offset) of every trained response token (loss mask 1, reward not None)."""
    return [
        (a, OFFSETS[j % 3])
        for s, a in zip(batch.samples, batch.advantages)
        if s.reward is not None
        for j, m in enumerate(s.loss_mask)
        if m
    ]


def trained_offsets(batch):
    return [o for _, o in trained_tokens(batch)]


def test_mismatch_metrics_are_reported_when_samples_carry_rollout_logprobs(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path)
    batch = offset_batch(trainer)
    offsets = trained_offsets(batch)
    metrics = trainer.step(batch)
    # d = old - rollout = -offset (old equals the single-sequence logprobs to ~1e-6):
    # |d| = 0.3 on the tokens with j % 3 != 1; k3 = e^d - 1 - d = 0.040818 (d = -0.3) or 0.049859 (d = 0.3)
    abs_diff = sum(abs(o) for o in offsets) / len(offsets)
    k3 = sum(math.exp(-o) - 1 + o for o in offsets) / len(offsets)
    assert metrics["train_rollout_logprob_abs_diff"] == pytest.approx(abs_diff, abs=1e-5)
    assert metrics["mismatch_kl"] == pytest.approx(k3, abs=1e-5)
    assert "tis_weight_mean" not in metrics  # use_tis off: measured, not corrected
    # without rollout logprobs there is nothing to compare
    assert "mismatch_kl" not in make_trainer(tiny_model_dir, tmp_path).step(make_batch(REWARDS_A))


def test_tis_truncates_the_weights_it_applies(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, use_tis=True, tis_clip=1.2)
    batch = offset_batch(trainer)
    offsets = trained_offsets(batch)
    tokens = trained_tokens(batch)
    metrics = trainer.step(batch)
    # rho = exp(-offset) = 0.74082 | 1 | 1.34986 -> min(rho, 1.2) = 0.74082 | 1 | 1.2; only 1.34986 is truncated
    weights = [min(math.exp(-o), 1.2) for o in offsets]
    # one step, PPO ratio 1 (recomputed old logprobs): pg_loss = token mean of -A w
    assert metrics["pg_loss"] == pytest.approx(-sum(a * min(math.exp(-o), 1.2) for a, o in tokens) / len(tokens), abs=1e-5)
    assert metrics["tis_weight_mean"] == pytest.approx(sum(weights) / len(weights), abs=1e-5)
    assert metrics["tis_clipfrac"] == pytest.approx(offsets.count(-0.3) / len(offsets))
    assert metrics["train_tokens"] == len(offsets)  # truncation trains every token


def test_mask_mode_drops_the_tokens_outside_the_band(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, use_tis=True, tis_mode="mask", tis_clip=1.2, tis_clip_low=0.9)
    batch = offset_batch(trainer)
    offsets = trained_offsets(batch)
    kept_advantages = [a for a, o in trained_tokens(batch) if o == 0.0]
    metrics = trainer.step(batch)
    # band [0.9, 1.2]: 0.74082 and 1.34986 are rejected, only the offset-0 tokens (rho = 1) train
    kept = offsets.count(0.0)
    # PPO ratio 1, weight 1: pg_loss = -sum(A) / kept, the rejected tokens out of the denominator too
    assert metrics["pg_loss"] == pytest.approx(-sum(kept_advantages) / kept, abs=1e-5)
    assert metrics["train_tokens"] == kept
    assert metrics["tis_clipfrac"] == pytest.approx(1 - kept / len(offsets))
    assert metrics["tis_weight_mean"] == pytest.approx(kept / len(offsets), abs=1e-5)  # weight 1 kept, 0 rejected


@pytest.mark.parametrize(("mode", "low"), [("truncate", 0.0), ("mask", 0.5)])
def test_micro_batch_size_does_not_change_the_update_with_tis(tiny_model_dir, tmp_path, mode, low):
    cfg = dict(use_tis=True, tis_mode=mode, tis_clip=1.2, tis_clip_low=low, clip_grad=0.0)
    one = make_trainer(tiny_model_dir, tmp_path, micro_batch_size=1, **cfg)
    eight = make_trainer(tiny_model_dir, tmp_path, micro_batch_size=8, **cfg)
    batch = offset_batch(one)
    m1, m8 = one.step(batch), eight.step(batch)
    for key in ("loss", "pg_loss", "grad_norm", "tis_weight_mean", "tis_clipfrac"):
        assert m1[key] == pytest.approx(m8[key], abs=1e-5), key
    assert m1["tis_clipfrac"] > 0  # the correction did act
    assert_same_params(one, eight, atol=1e-5)


def test_tis_changes_nothing_when_the_engine_agrees_with_the_trainer(tiny_model_dir, tmp_path):
    plain = make_trainer(tiny_model_dir, tmp_path, clip_grad=0.0)
    tis = make_trainer(tiny_model_dir, tmp_path, clip_grad=0.0, use_tis=True, tis_clip=1.5)
    batch = make_batch(REWARDS_A, logprob_model=plain.model)  # same weights: rho = 1 up to float noise
    m_plain, m_tis = plain.step(batch), tis.step(batch)
    assert m_tis["mismatch_kl"] == pytest.approx(0.0, abs=1e-10) and m_tis["tis_clipfrac"] == 0.0
    assert m_tis["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m_tis["loss"] == pytest.approx(m_plain["loss"], abs=1e-6)
    assert_same_params(plain, tis, atol=1e-5)


def test_use_tis_without_rollout_logprobs_names_the_samples(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, use_tis=True)
    batch = offset_batch(trainer)
    batch.samples[1].rollout_logprobs = []
    batch.samples[5].rollout_logprobs = []
    with pytest.raises(ValueError, match=r"train\.use_tis needs rollout_logprobs .* samples \[1, 5\] lack them"):
        trainer.step(batch)
    # a failed sample (reward None) trains nothing, so it needs none
    batch.samples[1].reward = batch.samples[5].reward = None
    assert trainer.step(batch)["num_optimizer_steps"] == 1


def test_rollout_correction_config_is_validated():
    with pytest.raises(ValidationError, match="tis_clip_low=2.0 must be below train.tis_clip=2.0"):
        TrainConfig(tis_clip_low=2.0)
    with pytest.raises(ValidationError, match="use_tis needs train.old_logprobs='recompute'"):
        TrainConfig(use_tis=True, old_logprobs="rollout")
    with pytest.raises(ValidationError, match="tis_clip"):
        TrainConfig(tis_clip=0.0)
    with pytest.raises(ValidationError, match="tis_mode"):
        TrainConfig(tis_mode="sequence")


# ------------------------------------------------------------------------- steps per rollout batch


def record_steps(trainer):
    """Wrap the trainer's optimizer step to keep each step's metrics."""
    steps, original = [], trainer._optimizer_step

    def recorded(minibatch, temperature):
        metrics = original(minibatch, temperature)
        steps.append(metrics)
        return metrics

    trainer._optimizer_step = recorded
    return steps


def test_num_steps_per_rollout_takes_k_steps_and_reports_their_drift(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, global_batch_size=None, num_steps_per_rollout=4, micro_batch_size=3)
    steps = record_steps(trainer)
    metrics = trainer.step(make_batch(REWARDS_A))
    assert metrics["num_optimizer_steps"] == 4 and trainer.version == 4 and len(steps) == 4
    # step 1 runs the weights that recomputed the old logprobs: every ratio is exactly 1
    assert steps[0]["ratio_dev"] == 0.0 and steps[0]["clipfrac"] == 0.0
    # steps 2..4 run weights already moved by the earlier steps
    assert all(s["ratio_dev"] > 0 for s in steps[1:])
    assert metrics["offpolicy_ratio_dev"] == pytest.approx(sum(s["ratio_dev"] for s in steps[1:]) / 3)
    assert metrics["offpolicy_clipfrac"] == pytest.approx(sum(s["clipfrac"] for s in steps[1:]) / 3)
    # the all-steps mean includes the on-policy first step: (0 + 3 * offpolicy) / 4
    assert metrics["ratio_dev"] == pytest.approx(3 * metrics["offpolicy_ratio_dev"] / 4)
    # one step per batch: nothing is off-policy, so no offpolicy_* metrics
    single = make_trainer(tiny_model_dir, tmp_path, global_batch_size=None).step(make_batch(REWARDS_A))
    assert "offpolicy_ratio_dev" not in single and single["ratio_dev"] == 0.0


def test_num_steps_per_rollout_and_global_batch_size_resolve_to_minibatch_sizes():
    assert TrainConfig().minibatch_sizes(8) == [8]
    assert TrainConfig(global_batch_size=3).minibatch_sizes(8) == [3, 3, 2]
    assert TrainConfig(num_steps_per_rollout=4).minibatch_sizes(8) == [2, 2, 2, 2]
    assert TrainConfig(num_steps_per_rollout=3).minibatch_sizes(10) == [4, 3, 3]  # 10 = 4 + 3 + 3
    assert TrainConfig(global_batch_size=2, num_steps_per_rollout=4).minibatch_sizes(8) == [2, 2, 2, 2]
    with pytest.raises(ValueError, match=r"global_batch_size=4 and train.num_steps_per_rollout=3 disagree"):
        TrainConfig(global_batch_size=4, num_steps_per_rollout=3).minibatch_sizes(8)
    with pytest.raises(ValueError, match="num_steps_per_rollout=9 exceeds the batch's 8 samples"):
        TrainConfig(num_steps_per_rollout=9).minibatch_sizes(8)
    with pytest.raises(ValidationError, match="num_steps_per_rollout"):
        TrainConfig(num_steps_per_rollout=0)


def test_trainer_refuses_disagreeing_batch_settings(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, global_batch_size=4, num_steps_per_rollout=3)
    with pytest.raises(ValueError, match="disagree: a batch of 8 samples"):
        trainer.step(make_batch(REWARDS_A))
    assert trainer.version == 0


def test_trainer_state_saves_and_loads_through_a_storage_outage(tiny_model_dir, tmp_path, monkeypatch):
    """A checkpoint's trainer state is retried like every other run file: an endpoint that fails
    twice (connection refused) and then answers loses nothing."""
    from miles_core.storage.fs import RetryPolicy
    from miles_core.train import torch_trainer

    store = FakeWeightStore(tmp_path)
    store.retry = RetryPolicy(attempts=5, initial_delay=0.0, deadline=30.0)
    trainer = TorchTrainer(str(tiny_model_dir), TrainConfig(global_batch_size=8), store)
    trainer.step(make_batch([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0]]))
    real_save, failures = torch_trainer.save_torch, []

    def flaky_save(fs, path, state):
        if len(failures) < 2:
            failures.append(path)
            raise ConnectionRefusedError("endpoint down")
        real_save(fs, path, state)

    monkeypatch.setattr(torch_trainer, "save_torch", flaky_save)
    uri = str(tmp_path / "ckpt" / "trainer.pt")
    trainer.save(uri)
    assert len(failures) == 2
    again = TorchTrainer(str(tiny_model_dir), TrainConfig(global_batch_size=8), store)
    again.load(uri)
    assert again.version == trainer.version == 1
    assert_same_params(again, trainer, atol=0)


def count_forwards(trainer):
    """The passes of the policy over a micro-batch (a shared-prompt pass is one, in two model calls)."""
    calls, logits = [], trainer.logits

    def counted(model, *args, **kwargs):
        if model is trainer.model:
            calls.append(1)
        return logits(model, *args, **kwargs)

    trainer.logits = counted
    return calls


@pytest.mark.parametrize("micro,tis", [(8, False), (3, False), (3, True)])
def test_one_pass_old_logprobs_give_the_same_update_bit_for_bit_at_one_forward_less(tiny_model_dir, tmp_path,
                                                                                      micro, tis):
    """A batch trained in one optimizer step: the loss pass's detached logprobs stand for the
    no-grad recompute pass (and, with truncated TIS, give the same importance weights); the
    weights after the step are equal to the last bit."""
    extra = {"use_tis": True, "tis_clip": 1.05} if tis else {}  # a low clip: some weights truncated
    one, two = (make_trainer(tiny_model_dir, tmp_path, micro_batch_size=micro, **extra) for _ in range(2))
    two._one_pass = lambda num_rows: False  # the separate no-grad pass, as before
    groups = make_groups(REWARDS_A, one.model)
    for s in (s for g in groups for s in g.samples):  # the engine's logprobs differ: the mismatch metrics are not 0
        s.rollout_logprobs = [lp - 0.1 * (j % 3) for j, lp in enumerate(s.rollout_logprobs)]
    batch = TrainBatch.from_groups(groups, temperature=1.0)
    forwards_one, forwards_two = count_forwards(one), count_forwards(two)
    m_one, m_two = one.step(batch), two.step(batch)
    a, b = params(one), params(two)
    before = params(make_trainer(tiny_model_dir, tmp_path))
    assert any(not torch.equal(a[k], before[k]) for k in a), "the step changed no weight: nothing was compared"
    assert m_one["mismatch_kl"] > 1e-3 and m_one["train_rollout_logprob_abs_diff"] > 1e-2, m_one
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    micro_batches = -(-8 // micro)
    assert (len(forwards_one), len(forwards_two)) == (micro_batches, 2 * micro_batches)
    keys = ["loss", "pg_loss", "grad_norm", "mismatch_kl", "train_rollout_logprob_abs_diff"]
    if tis:
        assert 0 < m_one["tis_clipfrac"] < 1 and m_one["tis_weight_mean"] != pytest.approx(1.0), m_one
        keys += ["tis_weight_mean", "tis_clipfrac"]
    for k in keys:
        assert m_one[k] == pytest.approx(m_two[k], abs=1e-7), k
    assert m_one["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m_one["clipfrac"] == 0.0


@pytest.mark.parametrize("cfg", [{"num_steps_per_rollout": 2, "global_batch_size": None},
                                 {"use_tis": True, "tis_mode": "mask"}, {"kl_coef": 0.1}])
def test_the_old_logprob_pass_stays_where_the_denominator_is_needed_first(tiny_model_dir, tmp_path, cfg):
    """Several optimizer steps (the later ones are off-policy), masked importance sampling (its
    rejected tokens leave the loss denominator), or a KL penalty in the reward all need the old
    logprobs before the loss pass: the trainer still computes them."""
    trainer = make_trainer(tiny_model_dir, tmp_path, micro_batch_size=8, **cfg)
    batch = make_batch(REWARDS_A, logprob_model=trainer.model)
    forwards = count_forwards(trainer)  # the policy's passes (a KL reference is a frozen copy of its own)
    trainer.step(batch)
    assert len(forwards) == 1 + cfg.get("num_steps_per_rollout", 1) and not trainer._one_pass(8)


def test_a_random_training_forward_keeps_the_separate_old_logprob_pass(tiny_model_dir, tmp_path):
    """Dropout anywhere (a module, the attention's, a nested config's) or a router's jitter makes
    the loss pass differ from an eval pass: the trainer keeps the separate pass."""
    from miles_core.train.torch_trainer import has_dropout

    trainer = make_trainer(tiny_model_dir, tmp_path)
    assert trainer._one_pass(8)
    for setting in ({"attention_dropout": 0.1}, {"router_jitter_noise": 0.01},
                    {"text_config": {"hidden_dropout": 0.1}}):
        fresh = make_trainer(tiny_model_dir, tmp_path)
        for key, value in setting.items():
            setattr(fresh.model.config, key, value)
        assert has_dropout(fresh.model), setting
    trainer.model.model.layers[0].self_attn.o_proj = torch.nn.Sequential(trainer.model.model.layers[0].self_attn.o_proj,
                                                                          torch.nn.Dropout(0.1))
    assert has_dropout(trainer.model)


# ---------------------------------------------------------------------------------- shared prompt


def mixed_samples():
    """Both groups' samples interleaved (so a micro-batch holds both prompts, of 4 and 5 tokens), a
    prompt of its own that occurs once, and a sample with an empty response."""
    tok = build_tokenizer()
    a, b = (g.samples for g in make_groups(REWARDS_A))
    lone_ids = tok.encode("99+99=", add_special_tokens=False)
    lone = Sample("99+99=", lone_ids, tok.encode("198", add_special_tokens=False), "198", reward=1.0,
                  loss_mask=[1, 1, 1])
    empty = Sample(a[0].prompt, a[0].prompt_ids, [], "", reward=0.0, loss_mask=[])
    return [x for pair in zip(a, b) for x in pair] + [lone, empty]


def test_shared_prompt_pass_gives_the_plain_pass_logprobs_and_gradients(tiny_model_dir, tmp_path):
    """Each prompt once, its responses on its cached keys and values: every trained token's logprob
    and the gradient of a loss over them equal the plain pass's (up to rounding), in two model calls."""
    from miles_core.train.shared_prompt import forward_logits

    trainer = make_trainer(tiny_model_dir, tmp_path)
    tb = collate(mixed_samples())
    assert tb.prompt_index.tolist() == [0, 1] * 4 + [2, 0]
    weights = torch.linspace(-1, 1, tb.loss_mask.numel()).view_as(tb.loss_mask) * tb.loss_mask
    results = {}
    for share in (False, True):
        calls = []
        hook = trainer.model.register_forward_hook(lambda *_: calls.append(1))
        trainer.model.zero_grad()
        logprobs = token_logprobs(forward_logits(trainer.model, tb, share).float(), tb.labels)
        (logprobs * weights).sum().backward()
        hook.remove()
        results[share] = (logprobs.detach(), {k: p.grad.clone() for k, p in trainer.model.named_parameters()}, calls)
    (plain, plain_grads, plain_calls), (shared, shared_grads, shared_calls) = results[False], results[True]
    assert (len(plain_calls), len(shared_calls)) == (1, 2)
    trained = tb.loss_mask.bool()
    assert trained.sum() > 20
    torch.testing.assert_close(shared[trained], plain[trained], atol=1e-5, rtol=0)
    assert (shared[trained] - plain[trained]).abs().max() < 1e-5
    for k, g in plain_grads.items():
        assert g.abs().max() > 0, k
        torch.testing.assert_close(shared_grads[k], g, atol=1e-6, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def test_rows_without_a_shared_prompt_take_the_plain_pass(tiny_model_dir, tmp_path):
    from miles_core.train.shared_prompt import forward_logits

    trainer = make_trainer(tiny_model_dir, tmp_path)
    tb = collate([g.samples[0] for g in make_groups(REWARDS_A)])  # two rows, two prompts: nothing to share
    calls = []
    trainer.model.register_forward_hook(lambda *_: calls.append(1))
    forward_logits(trainer.model, tb, share=True)
    assert len(calls) == 1


@pytest.mark.parametrize("setting", ["share_prompt_forward", "gradient_checkpointing"])
@pytest.mark.parametrize("micro", [3, 8])
def test_a_step_with_shared_prompts_or_checkpointing_equals_the_plain_step(tiny_model_dir, tmp_path, micro, setting):
    """Each prompt run once per micro-batch (micro-batches cut with a prompt's samples side by side),
    or each layer recomputed in the backward pass (the shared prompt pass then kept out of gradient
    passes): the same metrics and weights as the plain step, over two steps."""
    on, plain = (make_trainer(tiny_model_dir, tmp_path, micro_batch_size=micro, **{setting: value})
                 for value in (True, False))  # checkpointing on or off, with the default shared prompt pass
    checkpointed = [any(getattr(m, "gradient_checkpointing", False) for m in t.model.modules()) for t in (on, plain)]
    assert checkpointed == [setting == "gradient_checkpointing", False]
    for rewards in (REWARDS_A, REWARDS_B):
        m_on, m_plain = on.step(make_batch(rewards)), plain.step(make_batch(rewards))
        for k in ("loss", "pg_loss", "entropy", "grad_norm", "train_tokens"):
            assert m_on[k] == pytest.approx(m_plain[k], rel=1e-5, abs=1e-7), k
    before = params(make_trainer(tiny_model_dir, tmp_path))
    assert any(not torch.equal(v, before[k]) for k, v in params(on).items())
    assert_same_params(on, plain, atol=1e-6)


def test_the_cache_argument_follows_the_installed_transformers(tiny_model_dir, tmp_path):
    import inspect

    from miles_core.models.hf_cache import cache_kwarg

    model = make_trainer(tiny_model_dir, tmp_path).model
    assert cache_kwarg(model) in inspect.signature(type(model).forward).parameters
    with pytest.raises(TypeError, match="share_prompt_forward = false"):
        cache_kwarg(torch.nn.Linear(2, 2))



def test_micro_batches_by_samples_or_by_padded_tokens():
    from miles_core.train.batch import micro_batch_rows

    lengths = torch.tensor([10, 12, 30, 8, 8, 8, 50, 9])
    assert [r.tolist() for r in micro_batch_rows(lengths, 3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    # 64 tokens: [10, 12] pads to 2 x 12 = 24 (+30 would be 3 x 30 = 90); [30] alone (+8: 2 x 30 = 60, +8: 90);
    # so [30, 8] = 60, then [8, 8] = 16 (+50: 150); [50] alone is over 64 and still goes; [9]
    assert [r.tolist() for r in micro_batch_rows(lengths, 3, max_tokens=64)] == [[0, 1], [2, 3], [4, 5], [6], [7]]
    assert [r.tolist() for r in micro_batch_rows(lengths, 3, max_tokens=1000)] == [list(range(8))]
    assert micro_batch_rows(torch.tensor([], dtype=torch.long), 3, max_tokens=64) == []


def test_a_step_with_dynamic_micro_batches_is_the_step_with_fixed_ones(tiny_model_dir, tmp_path):
    """Gradient accumulation over micro-batches cut by tokens gives the step that fixed micro-batches
    give (the losses are divided by the minibatch's denominator either way)."""
    fixed = make_trainer(tiny_model_dir, tmp_path / "a", micro_batch_size=8)
    dynamic = make_trainer(tiny_model_dir, tmp_path / "b", use_dynamic_batch_size=True, max_tokens_per_gpu=16)
    assert len(list(dynamic._micro_batches(collate([s for g in make_groups(REWARDS_A) for s in g.samples])))) > 1
    a, b = fixed.step(make_batch(REWARDS_A)), dynamic.step(make_batch(REWARDS_A))
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert_same_params(fixed, dynamic, atol=1e-5)

