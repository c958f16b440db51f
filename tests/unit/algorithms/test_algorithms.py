"""hybridrl.algorithms against hand-computed values (arithmetic in the comments)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from omegaconf import OmegaConf

from hybridrl.algorithms import (
    LOSS_AGG_MODES,
    AlgorithmConfig,
    aggregate,
    aggregation_denominator,
    apply_kl_to_rewards,
    broadcast_to_tokens,
    entropy_from_logits,
    grpo_advantages,
    kl_penalty,
    masked_mean,
    mismatch_metrics,
    ppo_clip_loss,
    truncated_is_weights,
)
from hybridrl.errors import ConfigError

ATOL = 1e-6


def close(actual, expected, atol: float = ATOL) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=atol,
        rtol=0,
    )


# ---------------------------------------------------------------- advantages


def test_grpo_advantages_hand_computed():
    # group 1 = [1, 0, 0, 1]: mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 1/sqrt(3)
    #   adv = +-0.5 * sqrt(3) = +-0.8660254
    # group 2 = [1, 1, 1, 1]: all equal -> 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    h = math.sqrt(3) / 2
    close(grpo_advantages(rewards, 4, eps=0.0), [h, -h, -h, h, 0, 0, 0, 0])
    # with eps: 0.5 / (0.5773503 + 1e-6) = 0.8660239
    close(grpo_advantages(rewards, 4)[0], 0.5 / (1 / math.sqrt(3) + 1e-6))
    # no std: r - mean
    close(grpo_advantages(rewards, 4, norm_by_std=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_grpo_advantages_group_of_two():
    # [3, 1]: mean 2, unbiased std = sqrt((1 + 1) / 1) = sqrt(2) -> +-1/sqrt(2)
    close(grpo_advantages(torch.tensor([3.0, 1.0]), 2, eps=0.0), [1 / math.sqrt(2), -1 / math.sqrt(2)])


def test_grpo_advantages_equal_rewards_exactly_zero():
    # 0.1 is inexact in float32; the group mean may differ from 0.1 by rounding, and /eps would blow it up.
    rewards = torch.full((6,), 0.1)
    assert torch.equal(grpo_advantages(rewards, 3), torch.zeros(6))
    assert torch.equal(grpo_advantages(torch.tensor([0.7, 0.7]), 1), torch.zeros(2))


def test_grpo_advantages_bad_batch():
    with pytest.raises(ValueError, match="7 rewards are not divisible by group_size=4"):
        grpo_advantages(torch.zeros(7), 4)
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 4), 4)


def test_broadcast_to_tokens():
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(broadcast_to_tokens(adv, mask), [[2, 2, 0], [-1, 0, 0]])


# ---------------------------------------------------------------- KL


LOGP = torch.tensor([-1.0, -2.0])
REF = torch.tensor([-1.5, -1.0])  # logp - ref = [0.5, -1.0]


def test_kl_estimators():
    close(kl_penalty(LOGP, REF, "k1"), [0.5, -1.0])
    close(kl_penalty(LOGP, REF, "k2"), [0.125, 0.5])  # 0.5 * [0.25, 1]
    # ref - logp = [-0.5, 1]: exp(-0.5) + 0.5 - 1 = 0.1065307;  exp(1) - 1 - 1 = 0.7182818
    close(kl_penalty(LOGP, REF, "k3"), [math.exp(-0.5) - 0.5, math.e - 2])
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(LOGP, REF, "k4")


def test_k3_clamps_log_ratio():
    # ref - logp = +-100 is clamped to +-20: exp(20) - 20 - 1 and exp(-20) + 20 - 1, both finite,
    # and then each token's k3 is clamped to [-10, 10] as in verl
    kl = kl_penalty(torch.tensor([-100.0, 0.0]), torch.tensor([0.0, -100.0]), "k3")
    assert torch.isfinite(kl).all()
    close(kl, [10.0, 10.0])


def test_apply_kl_to_rewards_sequence_and_token():
    logp = LOGP.repeat(2, 1)
    ref = REF.repeat(2, 1)
    mask = torch.tensor([[1, 1], [1, 0]])
    # k1 per token = [0.5, -1.0]; seq kl = [0.5 - 1.0, 0.5] = [-0.5, 0.5]; coef 0.1
    new, seq_kl = apply_kl_to_rewards(torch.tensor([1.0, 0.0]), logp, ref, mask, 0.1, "k1")
    close(seq_kl, [-0.5, 0.5])
    close(new, [1.05, -0.05])  # 1 - 0.1 * -0.5, 0 - 0.1 * 0.5
    token_new, _ = apply_kl_to_rewards(torch.zeros(2, 2), logp, ref, mask, 0.1, "k1")
    close(token_new, [[-0.05, 0.1], [-0.05, 0.0]])  # padding gets no penalty


# ---------------------------------------------------------------- aggregation


def test_masked_mean_ignores_padding_garbage():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    close(masked_mean(x, mask), 3.25)  # (1 + 2 + 4 + 6) / 4
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 3 has no response token: ignored


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # seq sums [3, 4] -> mean over 2 sequences
        ("seq-mean-token-mean", 2.75),  # seq means [1.5, 4] -> mean
        ("seq-mean-token-sum-norm", 7 / 6),  # (3 + 4) / (2 sequences * T=3)
    ],
)
def test_aggregate_modes(mode, expected):
    close(aggregate(LOSS, MASK, mode), expected)
    close(aggregate(LOSS, torch.zeros_like(MASK), mode), 0.0)  # empty mask: 0, not NaN


def test_aggregate_normalizer_and_errors():
    close(aggregate(LOSS, MASK, "token-mean", normalizer=10.0), 0.7)  # 7 / 10
    close(aggregate(LOSS, MASK, "seq-mean-token-mean", normalizer=torch.tensor(10.0)), 0.55)  # 5.5 / 10
    close(aggregation_denominator(MASK, "token-mean"), 3)
    close(aggregation_denominator(MASK, "seq-mean-token-sum"), 2)
    close(aggregation_denominator(MASK, "seq-mean-token-sum-norm"), 6)
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'sum'"):
        aggregate(LOSS, MASK, "sum")
    with pytest.raises(ValueError, match="normalizer must be positive"):
        aggregate(LOSS, MASK, "token-mean", normalizer=0.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_accumulation_with_normalizer_equals_full_batch(mode):
    x = torch.linspace(-1.0, 2.0, 20).view(4, 5)
    # uneven lengths: micro-batch 1 = row 0 (5 tokens), micro-batch 2 = rows 1-3 (2 + 1 + 3 tokens)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]])

    full = x.clone().requires_grad_()
    aggregate(full.square(), mask, mode).backward()

    micro = [slice(0, 1), slice(1, 4)]
    norm = sum(aggregation_denominator(mask[s], mode) for s in micro)
    acc = x.clone().requires_grad_()
    naive = x.clone().requires_grad_()
    for s in micro:
        aggregate(acc[s].square(), mask[s], mode, normalizer=norm).backward()
        (aggregate(naive[s].square(), mask[s], mode) / len(micro)).backward()

    close(acc.grad, full.grad)
    # averaging per-micro-batch means is NOT the same (why the normalizer exists); the test can fail
    assert not torch.allclose(naive.grad, full.grad, atol=1e-4)


# ---------------------------------------------------------------- PPO loss

# clip_low 0.2, clip_high 0.3 (asymmetric), clip_c 3; old_logp = 0, so ratio = exp(logp)
#  tok  A   ratio  -A*r   -A*clip(r, .8, 1.3)  max    dual min(.,-3A)  active
#  1   +1   1.1   -1.1   -1.1                -1.1   -                none
#  2   +1   1.5   -1.5   -1.3                -1.3   -                clip (upper)
#  3   +1   0.5   -0.5   -0.8                -0.5   -                none (below range, A>0)
#  4   -1   0.5    0.5    0.8                 0.8   min(.8, 3)=0.8   clip (lower)
#  5   -1   1.2    1.2    1.2                 1.2   1.2              none
#  6   -1   4.0    4.0    1.3                 4.0   min(4, 3)=3.0    dual clip
#  7   +5   e^50 (padding, mask 0)
# token-mean over 6: (-1.1 - 1.3 - 0.5 + 0.8 + 1.2 + 3.0) / 6 = 2.1 / 6 = 0.35
RATIOS = [1.1, 1.5, 0.5, 0.5, 1.2, 4.0]
ADV = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 5.0]])
PPO_MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])


def _logp() -> torch.Tensor:
    return torch.tensor([[*(math.log(r) for r in RATIOS), 50.0]], requires_grad=True)


def test_ppo_clip_loss_values_metrics_and_grads():
    logp = _logp()
    loss, m = ppo_clip_loss(logp, torch.zeros(1, 7), ADV, PPO_MASK, 0.2, 0.3, 3.0, "token-mean")
    close(loss, 0.35)
    close(m["clip_frac"], 2 / 6)  # tokens 2 and 4
    close(m["dual_clip_frac"], 1 / 6)  # token 6
    close(m["ratio_mean"], sum(RATIOS) / 6)  # 8.8 / 6
    close(m["ppo_kl"], -sum(math.log(r) for r in RATIOS) / 6)  # -ln(1.98) / 6 = -0.1138495
    assert all(not v.requires_grad for v in m.values())
    loss.backward()
    # d(-A*r)/dlogp = -A*r where the unclipped term is active, else 0; divided by 6 tokens
    close(logp.grad, [[-1.1 / 6, 0, -0.5 / 6, 0, 1.2 / 6, 0, 0]])


def test_ppo_clip_loss_is_weights_and_1d_advantages():
    w = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 7.0]], requires_grad=True)
    loss, _ = ppo_clip_loss(_logp(), torch.zeros(1, 7), ADV, PPO_MASK, 0.2, 0.3, 3.0, "token-mean", is_weights=w)
    close(loss, (2.1 - 1.5) / 6)  # token 6 contributes 3.0 * 0.5 instead of 3.0
    loss.backward()
    assert w.grad is None
    # [B] advantages are broadcast: A=+1 on ratios [1.1, 1.5] -> (-1.1 - 1.3) / 2 = -1.2
    logp = torch.tensor([[math.log(1.1), math.log(1.5)]])
    adv_1d = torch.tensor([1.0])
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 2), adv_1d, torch.ones(1, 2), 0.2, 0.3, 3.0, "token-mean")
    close(loss, -1.2)


def test_ppo_clip_loss_seq_mode_with_normalizer():
    # seq-mean-token-sum over one sequence: token sum 2.1; normalizer 4 sequences -> 0.525
    loss, _ = ppo_clip_loss(
        _logp(), torch.zeros(1, 7), ADV, PPO_MASK, 0.2, 0.3, 3.0, "seq-mean-token-sum", normalizer=4.0
    )
    close(loss, 2.1 / 4)


def test_entropy_from_logits():
    # uniform over 2: ln 2;  p = [1/4, 3/4]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3)]])
    close(entropy_from_logits(logits), [math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))])
    peaked = entropy_from_logits(torch.tensor([[0.0, -1e4], [1e4, 0.0]]))
    close(peaked, [0.0, 0.0])  # finite, no 0 * log 0 = NaN


# ---------------------------------------------------------------- rollout correction


def test_truncated_is_weights():
    old = torch.zeros(4, requires_grad=True)
    engine = torch.tensor([0.0, -math.log(1.5), -math.log(4.0), -1e9])
    mask = torch.tensor([1, 1, 1, 0])
    w = truncated_is_weights(old, engine, mask, cap=2.0)
    close(w, [1.0, 1.5, 2.0, 0.0])  # exp(0), exp(ln 1.5), min(4, cap 2), padding
    assert not w.requires_grad
    w_bool = truncated_is_weights(old, engine, mask.bool(), cap=2.0)
    close(w_bool, w)


def test_mismatch_metrics():
    engine = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, 9.0, 9.0]])
    trainer = torch.tensor([[-1.05, -2.3, -0.5], [-0.15, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    m = mismatch_metrics(engine, trainer, mask, threshold=0.1)
    # Δ = engine - trainer = [0.05, 0.3, 0, -0.05]; padding Δ = 9 must not count
    close(m["mismatch/logp_abs_mean"], 0.1)  # 0.4 / 4
    close(m["mismatch/logp_abs_max"], 0.3)
    close(m["mismatch/frac_above_threshold"], 0.25)  # only 0.3 > 0.1
    # trainer ppl / engine ppl = exp(1.0) / exp(0.925) = exp(mean Δ = 0.075) = 1.0778842
    close(m["mismatch/ppl_ratio"], math.exp(0.075))


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kl_in", "kl_coef", "needed"),
    # A frozen reference is needed exactly when a KL term is both placed (in the loss or the reward) and weighted.
    [
        ("loss", 0.001, True),
        ("reward", 0.05, True),
        ("none", 0.001, False),
        ("loss", 0.0, False),
        ("reward", 0.0, False),
        ("none", 0.0, False),
    ],
)
def test_config_uses_reference(kl_in, kl_coef, needed):
    assert AlgorithmConfig(kl_in=kl_in, kl_coef=kl_coef).uses_reference is needed


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("name", "a2c"),
        ("group_size", 1),
        ("clip_ratio_low", 1.0),
        ("clip_ratio_low", -0.1),
        ("clip_ratio_high", -0.1),
        ("clip_ratio_c", 1.0),
        ("loss_agg_mode", "sum"),
        ("kl_coef", -1.0),
        ("kl_estimator", "k4"),
        ("kl_in", "ref"),
        ("entropy_coef", -0.01),
        ("rollout_correction", "is"),
        ("rollout_correction_cap", 0.5),
    ],
)
def test_config_errors_name_the_key(key, value):
    with pytest.raises(ConfigError, match=re.escape(f"algorithm.{key} ")):
        AlgorithmConfig(**{key: value})


def test_config_through_omegaconf():
    base = OmegaConf.structured(AlgorithmConfig)
    cfg = OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.from_dotlist(["clip_ratio_high=0.28"])))
    assert isinstance(cfg, AlgorithmConfig) and cfg.clip_ratio_high == 0.28
    bad = OmegaConf.merge(base, OmegaConf.from_dotlist(["clip_ratio_low=1.5"]))
    with pytest.raises(ConfigError, match=re.escape("algorithm.clip_ratio_low must be in [0, 1), got 1.5")):
        OmegaConf.to_object(bad)
