"""Advantage and loss math on hand-computed numbers (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from miles_core.config import (
    DrGRPOLossConfig,
    GRPOLossConfig,
    GSPOLossConfig,
    ReinforcePPBaselineLossConfig,
    ReinforcePPLossConfig,
)
from miles_core.train.advantages import (
    compute_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    sample_advantages,
)
from miles_core.train.losses import (
    clipped_surrogate,
    dr_grpo_loss,
    entropy_from_logits,
    gspo_loss,
    kl_penalty,
    masked_is_weights,
    mismatch_metrics,
    ppo_clip_loss,
    reduce_tokens,
    reducer_denominator,
    rollout_correction,
    sequence_log_ratio,
    setup_policy_loss,
    token_logprobs,
    truncated_is_weights,
)
from miles_core.types import Group, Sample

torch.set_num_threads(1)
E = math.e
approx = pytest.approx


# ------------------------------------------------------------------------------------ advantages


def test_grpo_advantages_with_std_by_hand():
    # group 0: [1, 0, 0]: mean 1/3, deviations [2/3, -1/3, -1/3],
    #   population var = (4/9 + 1/9 + 1/9) / 3 = 2/9, std = sqrt(2)/3
    #   A = [(2/3) / (sqrt(2)/3), ...] = [2/sqrt(2), -1/sqrt(2), -1/sqrt(2)] = [1.41421, -0.70711, -0.70711]
    # group 1: [2, 4, 6]: mean 4, deviations [-2, 0, 2], population var = 8/3, std = 1.63299
    #   A = [-2/1.63299, 0, 2/1.63299] = [-1.22474, 0, 1.22474]
    #   (the unbiased std, 2, would give [-1, 0, 1]: the population std is the documented choice)
    rewards = torch.tensor([[1.0, 0.0, 0.0], [2.0, 4.0, 6.0]])
    adv = grpo_advantages(rewards)
    expected = torch.tensor([[1.41421, -0.70711, -0.70711], [-1.22474, 0.0, 1.22474]])
    torch.testing.assert_close(adv, expected, atol=2e-5, rtol=0)
    # the list form gives the same numbers
    assert grpo_advantages(rewards.tolist()) == [approx(r, abs=2e-5) for r in expected.tolist()]


def test_grpo_advantages_without_std_by_hand():
    # only centred: [1, 0, 0] - 1/3 = [2/3, -1/3, -1/3]; [2, 4, 6] - 4 = [-2, 0, 2]
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0], [2.0, 4.0, 6.0]]), normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([[2 / 3, -1 / 3, -1 / 3], [-2.0, 0.0, 2.0]]))


def test_all_equal_group_gives_zero_advantages():
    # deviations are all 0, and 0 / (0 + eps) = 0 exactly
    assert grpo_advantages(torch.tensor([[0.7, 0.7, 0.7]])).tolist() == [[0.0, 0.0, 0.0]]
    assert grpo_advantages([[1.0, 1.0]]) == [[0.0, 0.0]]
    assert grpo_advantages([[1.0, 1.0]], normalize_std=False) == [[0.0, 0.0]]


def test_none_rewards_are_left_out_and_get_zero():
    # scored rewards [1, 0]: mean 0.5, population std 0.5 -> A = [0.5/0.5, -, -0.5/0.5] = [1, 0, -1]
    assert grpo_advantages([[1.0, None, 0.0]]) == [[approx(1.0, abs=1e-5), 0.0, approx(-1.0, abs=1e-5)]]
    # without std: [1 - 0.5, 0, 0 - 0.5]
    assert grpo_advantages([[1.0, None, 0.0]], normalize_std=False) == [[0.5, 0.0, -0.5]]
    # nothing scored, or a single scored sample (std 0): all zeros, never NaN
    assert grpo_advantages([[None, None], [1.0, None]]) == [[0.0, 0.0], [0.0, 0.0]]
    # ragged groups are fine in the list form
    assert grpo_advantages([[1.0, 0.0], [3.0]], normalize_std=False) == [[0.5, -0.5], [0.0]]


def test_sample_advantages_flatten_groups_in_order():
    def group(index, rewards):
        return Group([Sample("p", [2], reward=r, group_index=index, sample_index=i) for i, r in enumerate(rewards)])

    # group 0: [1, 0] -> [0.5, -0.5]; group 1: [None, 2, 4] -> mean 3 -> [0, -1, 1]
    adv = sample_advantages([group(0, [1.0, 0.0]), group(1, [None, 2.0, 4.0])], normalize_std=False)
    assert adv == [0.5, -0.5, 0.0, -1.0, 1.0]


def _group(index, rewards, lengths=None):
    lengths = lengths or [1] * len(rewards)
    return Group([
        Sample("p", [2], [5] * n, reward=r, loss_mask=[1] * n, group_index=index, sample_index=i)
        for i, (r, n) in enumerate(zip(rewards, lengths))
    ])


def test_reinforce_pp_advantages_whiten_over_the_batch_tokens_by_hand():
    # scored samples with tokens: reward 1 x 1 token, reward 0 x 3 tokens (the 0-token one and the
    # None one stay out of the statistics): mean = (1 + 0 + 0 + 0) / 4 = 0.25
    # var = (1 (1 - 0.25)^2 + 3 (0 - 0.25)^2) / 4 = (0.5625 + 0.1875) / 4 = 0.1875, std = 0.4330127
    # A = [0.75 / 0.4330127, -0.25 / 0.4330127, 0 (None), 0.75 / 0.4330127] = [1.7320508, -0.5773503, 0, 1.7320508]
    adv = reinforce_pp_advantages([1.0, 0.0, None, 1.0], [1, 3, 2, 0])
    assert adv == [approx(1.7320508, abs=1e-5), approx(-0.5773503, abs=1e-5), 0.0, approx(1.7320508, abs=1e-5)]
    assert reinforce_pp_advantages([None, 1.0], [2, 0]) == [0.0, 0.0]  # no scored token: all zero


def test_reinforce_pp_baseline_centres_each_group_then_whitens_over_the_batch_tokens_by_hand():
    # group 0: rewards [1, 0, None] -> mean 0.5 -> centred [0.5, -0.5, None]
    # group 1: rewards [3, 3]       -> mean 3   -> centred [0, 0]
    # tokens [1, 3, 2 | 2, 2]; the None sample stays out: token-weighted over 1 + 3 + 2 + 2 = 8 tokens
    # mean = (0.5 * 1 - 0.5 * 3 + 0 + 0) / 8 = -0.125
    # var = (1 (0.625)^2 + 3 (-0.375)^2 + 4 (0.125)^2) / 8 = (0.390625 + 0.421875 + 0.0625) / 8 = 0.109375
    # std = 0.3307189; A = [0.625, -0.375, 0 (None) | 0.125, 0.125] / 0.3307189
    std = math.sqrt(0.109375)
    adv = reinforce_pp_baseline_advantages([[1.0, 0.0, None], [3.0, 3.0]], [[1, 3, 2], [2, 2]])
    assert adv == [[approx(0.625 / std, abs=1e-5), approx(-0.375 / std, abs=1e-5), 0.0],
                   [approx(0.125 / std, abs=1e-5), approx(0.125 / std, abs=1e-5)]]
    # unlike plain REINFORCE++, a group whose samples all score the same reward contributes no
    # signal of its own: with only such groups every advantage is 0
    assert reinforce_pp_baseline_advantages([[3.0, 3.0], [1.0, 1.0]], [[1, 2], [3, 4]]) == [[0.0, 0.0], [0.0, 0.0]]


def test_compute_advantages_picks_the_estimator_of_the_loss_type():
    groups = [_group(0, [1.0, 0.0]), _group(1, [3.0, 3.0], lengths=[1, 3])]
    # grpo and gspo: group 0 [1, 0] -> mean 0.5, std 0.5 -> [1, -1]; group 1 all equal -> [0, 0]
    for cfg in (GRPOLossConfig(), GSPOLossConfig()):
        assert compute_advantages(cfg, groups) == [approx(1.0, abs=1e-5), approx(-1.0, abs=1e-5), 0.0, 0.0]
    # grpo without std and dr_grpo: only centred -> [0.5, -0.5, 0, 0]
    assert compute_advantages(GRPOLossConfig(advantage_std_normalize=False), groups) == [0.5, -0.5, 0.0, 0.0]
    assert compute_advantages(DrGRPOLossConfig(), groups) == [0.5, -0.5, 0.0, 0.0]
    # reinforce++: token-weighted over the whole batch: rewards 1, 0, 3 x 1 token, 3 x 3 tokens
    # mean = (1 + 0 + 3 + 9) / 6 = 13/6; var = ((1-13/6)^2 + (13/6)^2 + 4 (3-13/6)^2) / 6
    #     = (49/36 + 169/36 + 100/36) / 6 = 318/216 = 1.4722222, std = 1.2133516
    mean, std = 13 / 6, math.sqrt(318 / 216)
    expected = [(r - mean) / std for r in (1.0, 0.0, 3.0, 3.0)]
    assert compute_advantages(ReinforcePPLossConfig(), groups) == [approx(a, abs=1e-5) for a in expected]
    # reinforce++ with baseline: centred [0.5, -0.5 | 0, 0] over 1 + 1 + 1 + 3 tokens: mean 0,
    # var = (0.25 + 0.25) / 6 = 1/12 -> A = [0.5 sqrt(12), -0.5 sqrt(12), 0, 0] = [1.7320508, -1.7320508, 0, 0]
    assert compute_advantages(ReinforcePPBaselineLossConfig(), groups) == [
        approx(1.7320508, abs=1e-5), approx(-1.7320508, abs=1e-5), 0.0, 0.0]


# ------------------------------------------------------------------------------------- logprobs


def test_token_logprobs_and_temperature_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    label = torch.tensor([[1]])
    # softmax([0, ln 3]) = [1/4, 3/4] -> log(3/4) = -0.287682
    assert token_logprobs(logits, label, 1.0).item() == approx(math.log(0.75), abs=1e-6)
    # T = 2: logits / 2 = [0, ln(3)/2] -> p = sqrt(3) / (1 + sqrt(3)) = 0.633975 -> log = -0.455696
    assert token_logprobs(logits, label, 2.0).item() == approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))), abs=1e-6)
    # T = 0 (greedy) means the raw logits, as the engines report
    assert token_logprobs(logits, label, 0.0).item() == approx(math.log(0.75), abs=1e-6)


def test_entropy_by_hand():
    # uniform over 2: ln 2 = 0.693147; p = [1/4, 3/4]: 0.25 ln 4 + 0.75 ln(4/3) = 0.346574 + 0.215762 = 0.562335
    h = entropy_from_logits(torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]]))
    torch.testing.assert_close(h, torch.tensor([0.693147, 0.562335]), atol=1e-6, rtol=0)


def _plain_logprobs_and_entropy(logits, labels, temperature):
    """The textbook formulas (what the trainer computed before the chunked function)."""
    z = logits.float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_and_entropy_equal_the_plain_ones_with_their_gradients(dtype, monkeypatch):
    """A real model's vocabulary (49,152, SmolLM2's), a batch of 2 x 40 tokens cut into chunks of 7
    tokens (so chunk edges fall mid-row): values and gradients (through logp and H together, and
    through logp alone as when the entropy is only a metric) equal the plain formulas'. bf16 logits
    are upcast the same way in both, and the gradient is rounded once to bf16 (2^-8 relative)."""
    from miles_core.train import losses

    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", 7 * 49152)
    torch.manual_seed(0)
    logits = (torch.randn(2, 40, 49152) * 4).to(dtype)
    labels = torch.randint(0, 49152, (2, 40))
    w_lp, w_h = torch.randn(2, 40), torch.randn(2, 40)
    # both sum 49,152 fp32 terms whose log-probabilities reach ~40 in size, in different orders: each
    # term rounds by ~40 x 6e-8, and the sums differ by ~1e-5 (measured 0.6-1.2e-5 for values, up to 2e-5
    # for gradients over three seeds); 1e-4 leaves room for other kernels, and a wrong formula is off
    # by a probability (1e-2 and more)
    value_tol = {"atol": 1e-4, "rtol": 1e-5}
    grad_tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-3, "rtol": 1e-2}
    for through_entropy in (True, False):
        mine = logits.clone().requires_grad_()
        lp, h = losses.token_logprobs_and_entropy(mine, labels, 0.7)
        ((lp * w_lp).sum() + ((h * w_h).sum() if through_entropy else 0)).backward()
        plain = logits.clone().requires_grad_()
        lp0, h0 = _plain_logprobs_and_entropy(plain, labels, 0.7)
        ((lp0 * w_lp).sum() + ((h0 * w_h).sum() if through_entropy else 0)).backward()
        torch.testing.assert_close(lp, lp0, **value_tol)
        torch.testing.assert_close(h, h0, **value_tol)
        assert mine.grad.dtype == dtype
        torch.testing.assert_close(mine.grad.float(), plain.grad.float(), **grad_tol)
    assert torch.equal(mine.detach(), logits), "the caller's logits are left as they were"


def test_chunked_logprobs_keep_only_the_logits_for_backward():
    """What autograd keeps between forward and backward: the caller's logits (not a copy) and a few
    numbers per token; the plain formulas keep full-vocabulary fp32 tensors several times over."""
    from miles_core.train.losses import token_logprobs_and_entropy

    logits = torch.randn(4, 30, 5000, requires_grad=True)
    labels = torch.randint(0, 5000, (4, 30))

    def saved_bytes(fn) -> int:
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, h = fn(logits, labels, 0.7)
            (lp.sum() + h.sum()).backward()
        return sum(seen.values())

    full = logits.numel() * 4
    assert saved_bytes(token_logprobs_and_entropy) <= full * 1.05
    assert saved_bytes(_plain_logprobs_and_entropy) >= 2 * full


# -------------------------------------------------------------------------------------- reducers

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_token_mean_on_ragged_mask_by_hand():
    # masked tokens 1, 2 | 4 | (none): (1 + 2 + 4) / 3 = 7/3
    assert reduce_tokens(VALUES, MASK, "token_mean").item() == approx(7 / 3)
    assert reducer_denominator(MASK, "token_mean") == 3.0


def test_seq_mean_on_ragged_mask_by_hand():
    # row means (1 + 2)/2 = 1.5 and 4/1 = 4; the empty row is not a sequence: (1.5 + 4) / 2 = 2.75
    assert reduce_tokens(VALUES, MASK, "seq_mean").item() == approx(2.75)
    assert reducer_denominator(MASK, "seq_mean") == 2.0


@pytest.mark.parametrize("reducer", ["token_mean", "seq_mean"])
def test_pieces_with_the_whole_denominator_add_up(reducer):
    # token_mean: 3/3 + 4/3 + 0/3 = 7/3; seq_mean: 1.5/2 + 4/2 + 0/2 = 2.75
    denom = reducer_denominator(MASK, reducer)
    pieces = sum(reduce_tokens(VALUES[i : i + 1], MASK[i : i + 1], reducer, denom) for i in range(3))
    assert pieces.item() == approx(reduce_tokens(VALUES, MASK, reducer).item())


def test_empty_mask_reduces_to_zero():
    assert reduce_tokens(VALUES, torch.zeros_like(MASK), "token_mean").item() == 0.0
    assert reduce_tokens(VALUES, torch.zeros_like(MASK), "seq_mean").item() == 0.0


def test_unknown_reducer_is_named():
    with pytest.raises(ValueError, match="'sum'"):
        reduce_tokens(VALUES, MASK, "sum")


# --------------------------------------------------------------------------------------- PPO loss


def _four_cases():
    # one token per sequence; log ratio +1 (ratio e = 2.71828) or -1 (ratio 1/e = 0.36788)
    logprobs = torch.tensor([[1.0], [1.0], [-1.0], [-1.0]])
    return logprobs, torch.zeros_like(logprobs), torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.ones_like(logprobs)


def test_ppo_clip_loss_by_hand():
    logprobs, old, adv, mask = _four_cases()
    loss, metrics = ppo_clip_loss(logprobs, old, adv, mask, eps_clip=0.2)
    # row 0: ratio e, A = +1: max(-e, -1.2) = -1.2          (clipped at 1.2)
    # row 1: ratio e, A = -1: max(e, 1.2) = e = 2.71828       (pessimistic: not clipped)
    # row 2: ratio 1/e, A = +1: max(-0.36788, -0.8) = -0.36788 (not clipped)
    # row 3: ratio 1/e, A = -1: max(0.36788, 0.8) = 0.8        (clipped at 0.8)
    # token_mean = (-1.2 + 2.71828 - 0.36788 + 0.8) / 4 = 1.95040 / 4 = 0.48760
    assert loss.item() == approx((-1.2 + E - 1 / E + 0.8) / 4, abs=1e-6)
    assert loss.item() == approx(0.48760, abs=1e-5)
    assert metrics["clipfrac"].item() == approx(0.5)  # rows 0 and 3
    assert metrics["ratio_mean"].item() == approx((2 * E + 2 / E) / 4, abs=1e-6)  # 1.54308
    # |e - 1| = 1.71828 twice, |1/e - 1| = 0.63212 twice: (3.43656 + 1.26424) / 4 = 1.17520
    assert metrics["ratio_dev"].item() == approx((2 * (E - 1) + 2 * (1 - 1 / E)) / 4, abs=1e-6)
    assert metrics["approx_kl"].item() == approx(0.5)  # 0.5 * (+-1)^2


def test_single_token_clip_to_1_2():
    # ratio = e, advantage 1, eps 0.2: clipped to 1.2, so loss = -1.2
    loss, _ = ppo_clip_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([1.0]), torch.tensor([[1.0]]))
    assert loss.item() == approx(-1.2)


def test_asymmetric_clip_high():
    # ratio e, A = +1, eps_clip_high 0.28: clipped to 1.28 -> loss -1.28; the low side still clips at 0.8
    loss, _ = ppo_clip_loss(
        torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([1.0]), torch.tensor([[1.0]]), 0.2, 0.28
    )
    assert loss.item() == approx(-1.28)
    loss, _ = ppo_clip_loss(
        torch.tensor([[-1.0]]), torch.tensor([[0.0]]), torch.tensor([-1.0]), torch.tensor([[1.0]]), 0.2, 0.28
    )
    assert loss.item() == approx(0.8)


def test_seq_mean_ppo_on_ragged_mask():
    # old = logp -> ratio 1 everywhere -> token loss = -A: row 0 (A = 2) -2 on 2 tokens, row 1 (A = -1) +1 on 1 token
    logprobs = torch.zeros(2, 3)
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    token, _ = ppo_clip_loss(logprobs, logprobs, adv, mask, reducer="token_mean")
    seq, _ = ppo_clip_loss(logprobs, logprobs, adv, mask, reducer="seq_mean")
    assert token.item() == approx((-2 - 2 + 1) / 3)  # = -1
    assert seq.item() == approx((-2 + 1) / 2)  # row means -2 and 1 -> -0.5


def test_zero_advantage_gives_zero_policy_gradient():
    logprobs = torch.tensor([[0.3, -0.2, 0.1]], requires_grad=True)
    loss, _ = ppo_clip_loss(logprobs, torch.zeros(1, 3), torch.zeros(1), torch.ones(1, 3))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logprobs.grad, torch.zeros(1, 3))


@pytest.mark.parametrize(
    ("log_ratio", "advantage", "grad"),
    [
        (1.0, 1.0, 0.0),  # ratio e > 1.2 with A > 0: clipped, no gradient
        (-1.0, -1.0, 0.0),  # ratio 1/e < 0.8 with A < 0: clipped, no gradient
        (1.0, -1.0, E),  # ratio e, A < 0: loss = -A r = r, d/dlogp = r = e
        (-1.0, 1.0, -1 / E),  # ratio 1/e, A > 0: loss = -r, d/dlogp = -r = -0.36788
        (math.log(1.1), 1.0, -1.1),  # inside the clip range: loss = -r, gradient -1.1
    ],
)
def test_gradient_is_zero_only_beyond_the_clip_in_the_advantage_direction(log_ratio, advantage, grad):
    logprobs = torch.tensor([[log_ratio]], requires_grad=True)
    loss, _ = ppo_clip_loss(logprobs, torch.zeros(1, 1), torch.tensor([advantage]), torch.ones(1, 1))
    loss.backward()
    assert logprobs.grad.item() == approx(grad, abs=1e-6)


def test_masked_tokens_get_no_gradient():
    logprobs = torch.zeros(1, 3, requires_grad=True)
    loss, _ = ppo_clip_loss(logprobs, torch.zeros(1, 3), torch.ones(1), torch.tensor([[1.0, 0.0, 1.0]]))
    loss.backward()
    # loss = (-r0 - r2) / 2 -> d/dlogp = [-0.5, 0, -0.5]
    assert logprobs.grad.tolist() == [[-0.5, 0.0, -0.5]]


# -------------------------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    ln2 = math.log(2.0)
    # token 0: logp = 0, ref = ln 2 -> log r = ln 2 = 0.693147, r = 2
    #   k1 = -log r = -0.693147; k2 = 0.5 * 0.480453 = 0.240227; k3 = (2 - 1) - 0.693147 = 0.306853
    # token 1: logp = ln 2, ref = 0 -> log r = -ln 2, r = 1/2
    #   k1 = 0.693147; k2 = 0.240227; k3 = (0.5 - 1) + 0.693147 = 0.193147
    # token 2: logp = ref -> all three are 0
    logp = torch.tensor([[0.0, ln2, -1.0]])
    ref = torch.tensor([[ln2, 0.0, -1.0]])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[-0.693147, 0.693147, 0.0]]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([[0.240227, 0.240227, 0.0]]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([[0.306853, 0.193147, 0.0]]))


def test_k3_is_guarded_against_overflow_by_hand():
    # log r = ref - logp, clamped to [-20, 20]; k3 = e^log r - 1 - log r, clamped to at most 10:
    #   log r = 25 -> 20 -> e^20 - 21 = 4.85e8 -> 10;  log r = -25 -> -20 -> e^-20 + 19 = 19.000000002 -> 10
    #   log r = 3 -> e^3 - 4 = 16.0855 -> 10;  log r = 2 -> e^2 - 3 = 4.389056 (below the cap: unchanged)
    logp = torch.zeros(1, 4, requires_grad=True)
    ref = torch.tensor([[25.0, -25.0, 3.0, 2.0]])
    k3 = kl_penalty(logp, ref, "k3")
    torch.testing.assert_close(k3, torch.tensor([[10.0, 10.0, 10.0, 4.389056]]))
    k3.sum().backward()
    # clamped tokens train nothing; token 3: d/dlogp (e^(ref - logp) - 1 - (ref - logp)) = -e^2 + 1 = -6.389056
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0, -6.389056]]))


def test_gspo_sequence_log_ratio_is_capped_by_hand():
    # two trained tokens with logp - old = 25 each: the sequence log-ratio 25 is capped at 10, so
    # s = e^10 = 22026.4658 (not e^25 = 7.2e10); with A = -1 and no dual clip the surrogate is
    # -min(s * -1, clip(s, 0.8, 1.2) * -1) = s; a log-ratio of 100 (e^100 is inf in fp32) gives the same
    for delta in (25.0, 100.0):
        logp = torch.full((1, 2), delta, requires_grad=True)
        loss, metrics = gspo_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2), eps_clip=0.2,
                                  eps_clip_high=0.2, denom=1.0)
        assert loss.item() == pytest.approx(math.exp(10.0), rel=1e-5)
        assert metrics["ratio_mean"].item() == pytest.approx(math.exp(10.0), rel=1e-5)
        loss.backward()
        assert torch.isfinite(logp.grad).all() and (logp.grad == 0).all(), "capped: the ratio trains nothing"


def test_unknown_kl_kind_is_named():
    with pytest.raises(ValueError, match="'k4'"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ---------------------------------------------------------------------------- rollout correction

# old - rollout = [ln 0.5, 0, ln 1.5, ln 3]: importance ratios rho = [0.5, 1, 1.5, 3]
RHO = [0.5, 1.0, 1.5, 3.0]
ROLLOUT = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
OLD = ROLLOUT + torch.tensor([[math.log(r) for r in RHO]])


def test_truncated_is_weights_by_hand():
    # C = 2: min(rho, 2) = [0.5, 1, 1.5, 2] (only the last is truncated)
    torch.testing.assert_close(truncated_is_weights(OLD, ROLLOUT, 2.0), torch.tensor([[0.5, 1.0, 1.5, 2.0]]))
    # lower clip 0.8 too: clamp(rho, 0.8, 2) = [0.8, 1, 1.5, 2]
    torch.testing.assert_close(truncated_is_weights(OLD, ROLLOUT, 2.0, 0.8), torch.tensor([[0.8, 1.0, 1.5, 2.0]]))
    # the weights are constants: no gradient flows into either logprob
    assert not truncated_is_weights(OLD.clone().requires_grad_(), ROLLOUT, 2.0).requires_grad


def test_masked_is_weights_by_hand():
    # band [0.8, 2]: 0.5 and 3 fall outside -> rejected (weight 0); 1 and 1.5 keep their ratio
    weights, keep = masked_is_weights(OLD, ROLLOUT, 0.8, 2.0)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.0, 1.5, 0.0]]))
    assert keep.tolist() == [[0.0, 1.0, 1.0, 0.0]]


def test_rollout_correction_modes_by_hand():
    truncate = rollout_correction(OLD, ROLLOUT, "truncate", 2.0, 0.8)
    torch.testing.assert_close(truncate.weights, torch.tensor([[0.8, 1.0, 1.5, 2.0]]))
    assert truncate.keep.tolist() == [[1.0, 1.0, 1.0, 1.0]]  # truncation trains every token
    assert truncate.corrected.tolist() == [[1.0, 0.0, 0.0, 1.0]]  # 0.5 -> 0.8 and 3 -> 2
    mask = rollout_correction(OLD, ROLLOUT, "mask", 2.0, 0.8)
    torch.testing.assert_close(mask.weights, torch.tensor([[0.0, 1.0, 1.5, 0.0]]))
    assert mask.keep.tolist() == [[0.0, 1.0, 1.0, 0.0]]
    assert mask.corrected.tolist() == [[1.0, 0.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match="'sequence'"):
        rollout_correction(OLD, ROLLOUT, "sequence", 2.0)


def test_tis_weights_scale_the_token_losses_by_hand():
    # logp = old: PPO ratio 1, A = 1 -> token loss -1, times w = [0.5, 1, 1.5, 2]
    # token_mean = -(0.5 + 1 + 1.5 + 2) / 4 = -1.25; d loss / d logp_t = -w_t r_t / 4 = [-0.125, -0.25, -0.375, -0.5]
    logprobs = OLD.clone().requires_grad_()
    w = truncated_is_weights(OLD, ROLLOUT, 2.0)
    loss, metrics = ppo_clip_loss(logprobs, OLD, torch.ones(1), torch.ones(1, 4), weights=w)
    loss.backward()
    assert loss.item() == approx(-1.25)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.125, -0.25, -0.375, -0.5]]))
    assert metrics["ratio_mean"].item() == approx(1.0) and metrics["ratio_dev"].item() == 0.0  # unweighted


def test_mask_mode_rejected_tokens_leave_the_loss_and_its_denominator():
    # band [0.8, 2] keeps tokens 1 and 2 (weights 1 and 1.5); logp = old, A = 1 -> token losses -1, -1.5
    # the loss mask loses tokens 0 and 3: token_mean = (-1 - 1.5) / 2 = -1.25 (not / 4)
    c = rollout_correction(OLD, ROLLOUT, "mask", 2.0, 0.8)
    logprobs = OLD.clone().requires_grad_()
    loss, _ = ppo_clip_loss(logprobs, OLD, torch.ones(1), torch.ones(1, 4) * c.keep, weights=c.weights)
    loss.backward()
    assert loss.item() == approx(-1.25)
    # d/dlogp = -w / 2 on the kept tokens, nothing on the rejected ones
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.5, -0.75, 0.0]]))


def test_tis_with_rollout_equal_to_old_is_plain_ppo_exactly():
    logprobs, old, adv, mask = _four_cases()
    # rollout = old: rho = exp(0) = 1 exactly, so w = 1 and w * x = x bit for bit
    w = truncated_is_weights(old, old, 2.0)
    assert torch.equal(w, torch.ones_like(w))
    plain_lp, tis_lp = logprobs.clone().requires_grad_(), logprobs.clone().requires_grad_()
    plain, _ = ppo_clip_loss(plain_lp, old, adv, mask)
    tis, _ = ppo_clip_loss(tis_lp, old, adv, mask, weights=w)
    plain.backward()
    tis.backward()
    assert tis.item() == plain.item()
    assert torch.equal(tis_lp.grad, plain_lp.grad)


def test_zero_advantage_with_tis_gives_zero_gradient():
    # A = 0: every token loss is 0 whatever its weight (here 0.5, 1, 1.5, 2)
    logprobs = torch.tensor([[0.3, -0.2, 0.1, 0.0]], requires_grad=True)
    loss, _ = ppo_clip_loss(logprobs, torch.zeros(1, 4), torch.zeros(1), torch.ones(1, 4),
                            weights=truncated_is_weights(OLD, ROLLOUT, 2.0))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logprobs.grad, torch.zeros(1, 4))


@pytest.mark.parametrize("reducer", ["token_mean", "seq_mean"])
def test_weighted_pieces_with_the_whole_denominator_add_up(reducer):
    # 3 rows, weights differ per token; each row's loss / whole denominator sums to the whole loss
    logprobs = torch.tensor([[0.1, -0.3, 0.2], [0.0, 0.4, -0.1], [0.2, 0.2, 0.2]])
    old = torch.zeros(3, 3)
    weights = torch.tensor([[0.5, 1.0, 2.0], [1.5, 1.0, 0.8], [1.0, 1.0, 1.0]])
    adv, mask = torch.tensor([1.0, -1.0, 0.5]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    whole, _ = ppo_clip_loss(logprobs, old, adv, mask, reducer=reducer, weights=weights)
    denom = reducer_denominator(mask, reducer)
    pieces = sum(
        ppo_clip_loss(logprobs[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], reducer=reducer,
                      denom=denom, weights=weights[i : i + 1])[0]
        for i in range(3)
    )
    assert pieces.item() == approx(whole.item(), abs=1e-7)


def test_mismatch_metrics_by_hand():
    ln2 = math.log(2.0)
    # d = old - rollout = [ln 2, -ln 2, 0] on the trained tokens; the 4th token is masked and its
    # d = 200 would overflow exp to inf: it must not enter
    rollout = torch.tensor([[-1.0, -1.0, -1.0, -200.0]])
    old = rollout + torch.tensor([[ln2, -ln2, 0.0, 200.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    m = mismatch_metrics(old, rollout, mask)
    # k3 = e^d - 1 - d: (2 - 1 - 0.693147) + (0.5 - 1 + 0.693147) + 0 = 0.306853 + 0.193147 = 0.5; / 3 = 0.166667
    assert m["mismatch_kl"].item() == approx(0.5 / 3, abs=1e-6)
    # |d|: (0.693147 + 0.693147 + 0) / 3 = 0.462098
    assert m["train_rollout_logprob_abs_diff"].item() == approx(2 * ln2 / 3, abs=1e-6)
    assert set(m) == {"mismatch_kl", "train_rollout_logprob_abs_diff"}
    # TIS at C = 1.5: rho = [2, 0.5, 1] -> w = [1.5, 0.5, 1], mean 1.0; one of three truncated
    m = mismatch_metrics(old, rollout, mask, rollout_correction(old, rollout, "truncate", 1.5))
    assert m["tis_weight_mean"].item() == approx(1.0, abs=1e-6)
    assert m["tis_clipfrac"].item() == approx(1 / 3)
    # mask mode, band [0.75, 1.5]: 2 and 0.5 rejected -> weights [0, 0, 1]: mean 1/3, 2/3 rejected
    m = mismatch_metrics(old, rollout, mask, rollout_correction(old, rollout, "mask", 1.5, 0.75))
    assert m["tis_weight_mean"].item() == approx(1 / 3, abs=1e-6)
    assert m["tis_clipfrac"].item() == approx(2 / 3)


def test_mismatch_kl_is_zero_when_logprobs_agree_and_positive_otherwise():
    lp = torch.tensor([[-0.5, -2.0, -0.1]])
    mask = torch.ones(1, 3)
    m = mismatch_metrics(lp, lp, mask)
    assert m["mismatch_kl"].item() == 0.0 and m["train_rollout_logprob_abs_diff"].item() == 0.0
    # one token off by 0.1 either way: e^0.1 - 1 - 0.1 = 0.005171, e^-0.1 - 1 + 0.1 = 0.004837
    for delta, k3 in ((0.1, 0.005171), (-0.1, 0.004837)):
        m = mismatch_metrics(lp + torch.tensor([[delta, 0.0, 0.0]]), lp, mask)
        assert m["mismatch_kl"].item() == approx(k3 / 3, abs=1e-6) and m["mismatch_kl"].item() > 0


# ----------------------------------------------------------------------------- loss variants

LOSS_CONFIGS = {
    "grpo": GRPOLossConfig(),
    "grpo_seq_mean": GRPOLossConfig(reducer="seq_mean"),
    "grpo_dual_clip": GRPOLossConfig(eps_clip_c=3.0),
    "dr_grpo": DrGRPOLossConfig(max_len=4),
    "gspo": GSPOLossConfig(eps_clip=0.2, eps_clip_high=0.2),
    "gspo_dual_clip": GSPOLossConfig(eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=3.0),
    "reinforce_plus_plus": ReinforcePPLossConfig(),
    "reinforce_plus_plus_baseline": ReinforcePPBaselineLossConfig(),
}
RAGGED = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])


def _run(cfg, log_ratio, advantages, mask=RAGGED, denom=None):
    """(loss, metrics, d loss / d logprobs) of the variant ``cfg`` at the given log ratios."""
    logprobs = log_ratio.clone().requires_grad_(True)
    loss_fn = setup_policy_loss(cfg)
    loss, metrics = loss_fn.fn(logprobs, torch.zeros_like(log_ratio), advantages, mask, denom=denom)
    loss.backward()
    return loss, metrics, logprobs.grad


def test_clipped_surrogate_and_dual_clip_by_hand():
    ratio = torch.tensor([E, E, E, 0.5])
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0])
    # A = +1, r = e: max(-e, -1.2) = -1.2 (clipped); A = -1, r = e: max(e, 1.2) = e (unbounded, not clipped);
    # A = -1, r = 0.5: max(0.5, 0.8) = 0.8 (clipped)
    loss, clipped = clipped_surrogate(ratio, adv, 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([-1.2, E, E, 0.8]))
    assert clipped.tolist() == [1.0, 0.0, 0.0, 1.0]
    # dual clip c = 2: where A < 0, min(l, 2 |A|): e -> 2 (in force), 0.8 stays; A > 0 untouched
    loss, clipped = clipped_surrogate(ratio, adv, 0.2, 0.2, eps_clip_c=2.0)
    torch.testing.assert_close(loss, torch.tensor([-1.2, 2.0, 2.0, 0.8]))
    assert clipped.tolist() == [1.0, 1.0, 1.0, 1.0]
    # c = 3 > e: the dual clip is not in force
    loss, _ = clipped_surrogate(ratio, adv, 0.2, 0.2, eps_clip_c=3.0)
    torch.testing.assert_close(loss, torch.tensor([-1.2, E, E, 0.8]))


def test_dr_grpo_loss_by_hand():
    # ratio 1 everywhere, so each token's loss is -A: row 0 (A = 1) two tokens -> -2; row 1 (A = -0.5)
    # one token -> 0.5; row 2 (A = 0) -> 0. Token sums -1.5 over S = 3 sequences and max_len 4:
    # -1.5 / (3 * 4) = -0.125 (token_mean would be -1.5 / 6 = -0.25: the 1/|o| normalisation is gone)
    adv = torch.tensor([1.0, -0.5, 0.0])
    zeros = torch.zeros(3, 3)
    loss, metrics = dr_grpo_loss(zeros, zeros, adv, RAGGED, max_len=4)
    assert loss.item() == approx(-0.125)
    assert metrics["ratio_mean"].item() == approx(6 / 12)  # 6 trained tokens of a 3 x 4 token budget
    # the sequence length counts: one more trained token in row 0 adds -1 / 12
    longer = RAGGED.clone()
    longer[0, 2] = 1.0
    assert dr_grpo_loss(zeros, zeros, adv, longer, max_len=4)[0].item() == approx(-2.5 / 12)


def test_gspo_loss_by_hand():
    # row 0: trained log ratios 0.2, 0.4 (the masked 5.0 never counts) -> mean 0.3, s = e^0.3 = 1.3498588
    #   A = 1: max(-1.3498588, -1.2) = -1.2 (clipped)
    # row 1: log ratio -0.1 -> s = e^-0.1 = 0.9048374, A = 1: -0.9048374 (not clipped)
    # loss = mean over the two sequences = (-1.2 - 0.9048374) / 2 = -1.0524187; clipfrac = 1/2
    log_ratio = torch.tensor([[0.2, 0.4, 5.0], [-0.1, 0.0, 0.0]])
    mask = RAGGED[:2]
    torch.testing.assert_close(sequence_log_ratio(log_ratio, torch.zeros(2, 3), mask), torch.tensor([0.3, -0.1]))
    logprobs = log_ratio.clone().requires_grad_(True)
    loss, metrics = gspo_loss(logprobs, torch.zeros(2, 3), torch.ones(2), mask, eps_clip=0.2, eps_clip_high=0.2)
    assert loss.item() == approx(-1.0524187, abs=1e-6)
    assert metrics["clipfrac"].item() == approx(0.5)
    loss.backward()
    # row 0 is clipped: no gradient; row 1: d/dlogp (-s / 2) = -s / (2 * 1 token) = -0.4524187
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, 0.0], [-0.4524187, 0.0, 0.0]]))


def test_gspo_ratio_is_per_sequence():
    # log ratios 0.1 and -0.1 average to 0: s = 1, loss = -A = -1 exactly, and both tokens get the
    # same gradient -s / (2 tokens) = -0.5. The token-level PPO loss of the same numbers differs:
    # mean(-e^0.1, -e^-0.1) = -(1.1051709 + 0.9048374) / 2 = -1.0050042
    log_ratio = torch.tensor([[0.1, -0.1]])
    mask = torch.ones(1, 2)
    logprobs = log_ratio.clone().requires_grad_(True)
    loss, _ = gspo_loss(logprobs, torch.zeros(1, 2), torch.ones(1), mask, eps_clip=0.2, eps_clip_high=0.2)
    loss.backward()
    assert loss.item() == approx(-1.0)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, -0.5]]))
    ppo, _ = ppo_clip_loss(log_ratio, torch.zeros(1, 2), torch.ones(1), mask)
    assert ppo.item() == approx(-1.0050042, abs=1e-6)
    # swapping the tokens' log ratios within the sequence changes nothing
    swapped, _ = gspo_loss(log_ratio.flip(-1), torch.zeros(1, 2), torch.ones(1), mask, eps_clip=0.2, eps_clip_high=0.2)
    assert swapped.item() == approx(loss.item())


@pytest.mark.parametrize("name", LOSS_CONFIGS)
def test_zero_advantage_gives_zero_policy_gradient_for_every_variant(name):
    torch.manual_seed(0)
    loss, _, grad = _run(LOSS_CONFIGS[name], 0.3 * torch.randn(3, 3), torch.zeros(3))
    assert loss.item() == 0.0
    assert torch.count_nonzero(grad) == 0


@pytest.mark.parametrize("name", LOSS_CONFIGS)
def test_clipping_bounds_the_ratio_contribution_for_every_variant(name):
    # every trained log ratio is 3 (r = 20.1), A = +1: each sequence is clipped at 1 + eps_high = 1.2,
    # so each token's / sequence's loss is -1.2 and the gradient is 0; without a clip it would be -20.1
    cfg = LOSS_CONFIGS[name]
    loss, metrics, grad = _run(cfg, torch.full((3, 3), 3.0), torch.ones(3))
    assert torch.count_nonzero(grad) == 0
    # reducers: token/seq means give -1.2; dr_grpo: token sums -1.2 * 6 tokens / (3 seqs * max_len 4) = -0.6
    expected = -1.2 * 6 / 12 if cfg.type == "dr_grpo" else -1.2
    assert loss.item() == approx(expected, abs=1e-6)


@pytest.mark.parametrize("name", [n for n, c in LOSS_CONFIGS.items() if c.eps_clip_c is not None])
def test_dual_clip_bounds_negative_advantage_losses(name):
    # A = -1 and r = e^3 = 20.1: the plain PPO loss is 20.1 per token (unbounded in r); the dual clip
    # caps it at c |A| = 3, with no gradient
    cfg = LOSS_CONFIGS[name]
    loss, metrics, grad = _run(cfg, torch.full((3, 3), 3.0), -torch.ones(3))
    assert loss.item() == approx(3.0, abs=1e-6)
    assert metrics["clipfrac"].item() == approx(1.0)
    assert torch.count_nonzero(grad) == 0
    unbounded, _, _ = _run(cfg.model_copy(update={"eps_clip_c": None}), torch.full((3, 3), 3.0), -torch.ones(3))
    assert unbounded.item() == approx(math.exp(3.0), rel=1e-5)


@pytest.mark.parametrize("name", LOSS_CONFIGS)
def test_every_variant_adds_up_over_micro_batches(name):
    # each row alone, divided by the whole minibatch's denominator, sums to the minibatch loss and metrics
    torch.manual_seed(1)
    cfg = LOSS_CONFIGS[name]
    log_ratio, adv = 0.3 * torch.randn(3, 3), torch.tensor([1.0, -0.5, 2.0])
    denom = reducer_denominator(RAGGED, setup_policy_loss(cfg).reducer)
    whole, whole_metrics, whole_grad = _run(cfg, log_ratio, adv)
    grads, total, totals = [], 0.0, dict.fromkeys(whole_metrics, 0.0)
    for i in range(3):
        loss, metrics, grad = _run(cfg, log_ratio[i : i + 1], adv[i : i + 1], RAGGED[i : i + 1], denom)
        total += loss.item()
        grads.append(grad)
        for k, v in metrics.items():
            totals[k] += v.item()
    assert total == approx(whole.item(), abs=1e-6)
    torch.testing.assert_close(torch.cat(grads), whole_grad)
    for k, v in whole_metrics.items():
        assert totals[k] == approx(v.item(), abs=1e-6), k


def test_unknown_loss_type_is_named():
    with pytest.raises(ValueError, match="'ppo'"):
        setup_policy_loss(GRPOLossConfig().model_construct(type="ppo"))


def test_dr_grpo_without_max_len_is_refused():
    with pytest.raises(ValueError, match="max_len"):
        setup_policy_loss(DrGRPOLossConfig())
