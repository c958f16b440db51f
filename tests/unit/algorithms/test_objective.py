"""hybridrl.algorithms.objective: `compute_advantages` and `policy_loss` give each algorithm's numbers (hand-computed),
with the KL where `algorithm.kl_in` puts it, and the GRPO path bit-identical to the functions it composes."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms import (
    AlgorithmConfig,
    apply_kl_to_rewards,
    broadcast_to_tokens,
    compute_advantages,
    grpo_advantages,
    kl_penalty,
    policy_loss,
    ppo_clip_loss,
)
from tests.unit.algorithms.reference import assert_close

# ---------------------------------------------------------------- compute_advantages

MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0])
# per-token KL of the rollout (padding 9 must not count): sequence sums [0.5, 1.0, 0.6, -0.2]
TOKEN_KL = torch.tensor([[0.2, 0.3, 9.0], [1.0, 9.0, 9.0], [0.1, 0.2, 0.3], [-0.4, 0.2, 9.0]])


def test_grpo_dispatch_is_bit_identical_to_the_grpo_functions():
    for kl_in in ("loss", "reward"):
        cfg = AlgorithmConfig(group_size=2, kl_in=kl_in, kl_coef=0.1, kl_estimator="k1")
        g = torch.Generator().manual_seed(0)
        old, ref = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
        rewards = SCORES
        if kl_in == "reward":
            rewards, _ = apply_kl_to_rewards(SCORES, old, ref, MASK, 0.1, "k1")
        expected = broadcast_to_tokens(grpo_advantages(rewards, 2, norm_by_std=True), MASK.float())
        adv, ret = compute_advantages(cfg, SCORES, MASK.float(), token_kl=kl_penalty(old, ref, "k1"))
        assert ret is None and torch.equal(adv, expected)


def test_outcome_estimators_subtract_the_sequence_kl_from_the_score():
    # kl_coef 0.1: scores - 0.1 * [0.5, 1.0, 0.6, -0.2] = [0.95, -0.1, -0.06, 1.02]
    # rloo, groups of 2: [0.95 - (-0.1), -0.1 - 0.95] = [1.05, -1.05];  [-0.06 - 1.02, 1.02 + 0.06]
    cfg = AlgorithmConfig(name="rloo", group_size=2, kl_in="reward", kl_coef=0.1, kl_estimator="k1")
    adv, _ = compute_advantages(cfg, SCORES, MASK, token_kl=TOKEN_KL)
    assert_close(adv, [[1.05, 1.05, 0], [-1.05, 0, 0], [-1.08, -1.08, -1.08], [1.08, 1.08, 0]])
    # dr_grpo: r - mean, no KL in the reward: [0.5, -0.5, -0.5, 0.5]
    cfg = AlgorithmConfig(name="dr_grpo", group_size=2, norm_adv_by_std=False)
    assert_close(
        compute_advantages(cfg, SCORES, MASK)[0], [[0.5, 0.5, 0], [-0.5, 0, 0], [-0.5, -0.5, -0.5], [0.5, 0.5, 0]]
    )
    # grpo with std: [1, 0] -> +-1/sqrt(2) (unbiased std sqrt(0.5), eps 1e-6)
    h = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert_close(
        compute_advantages(AlgorithmConfig(group_size=2, kl_in="none"), SCORES, MASK)[0],
        [[h, h, 0], [-h, 0, 0], [-h, -h, -h], [h, h, 0]],
    )


def test_reinforce_pp_puts_the_kl_on_every_token():
    # gamma 0.5, kl_coef 0.1, one sequence per row (group_size 1)
    # row 0 tokens: rewards [-0.02, 1 - 0.03] -> returns [-0.02 + 0.485, 0.97] = [0.465, 0.97]
    # row 1: [0 - 0.1] -> [-0.1]
    cfg = AlgorithmConfig(name="reinforce_pp", group_size=1, gamma=0.5, kl_in="reward", kl_coef=0.1, kl_estimator="k1")
    adv, ret = compute_advantages(cfg, SCORES[:2], MASK[:2], token_kl=TOKEN_KL[:2])
    assert ret is None
    xs = [0.465, 0.97, -0.1]
    mean = sum(xs) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / 2 + 1e-8)
    assert_close(adv, [[(0.465 - mean) / std, (0.97 - mean) / std, 0], [(-0.1 - mean) / std, 0, 0]])


def test_ppo_gae_through_the_dispatcher():
    # one sequence, score 1, values [0.5, 0.6, 0.8], gamma 1, lam 0.95, token KL [0.1, 0.2, 0.3] x 0.5:
    # rewards [-0.05, -0.1, 0.85]; d2 = 0.85 - 0.8 = 0.05; d1 = -0.1 + 0.8 - 0.6 = 0.1; d0 = -0.05 + 0.1 = 0.05
    # A2 = 0.05, A1 = 0.1 + 0.0475 = 0.1475, A0 = 0.05 + 0.140125 = 0.190125; returns = A + V
    cfg = AlgorithmConfig(name="ppo", group_size=1, lam=0.95, kl_in="reward", kl_coef=0.5, kl_estimator="k1")
    values = torch.tensor([[0.5, 0.6, 0.8]])
    adv, ret = compute_advantages(
        cfg, torch.tensor([1.0]), torch.ones(1, 3), token_kl=torch.tensor([[0.1, 0.2, 0.3]]), values=values
    )
    assert_close(ret, [[0.690125, 0.7475, 0.85]])
    xs = [0.190125, 0.1475, 0.05]
    mean = sum(xs) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / 2 + 1e-8)
    assert_close(adv, [[(x - mean) / std for x in xs]])
    with pytest.raises(ValueError, match="critic's values"):
        compute_advantages(cfg, torch.tensor([1.0]), torch.ones(1, 3), token_kl=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="token_kl"):
        compute_advantages(cfg, torch.tensor([1.0]), torch.ones(1, 3), values=values)


def test_reinforce_pp_baseline_through_the_dispatcher():
    cfg = AlgorithmConfig(name="reinforce_pp_baseline", group_size=2, kl_in="none")
    adv, _ = compute_advantages(cfg, SCORES, MASK)
    # centered [0.5, -0.5, -0.5, 0.5] on 2 + 1 + 3 + 2 tokens, whitened over the 8 tokens
    # (mean 0: four tokens at +0.5, four at -0.5; unbiased var = 8 * 0.25 / 7)
    std = math.sqrt(8 * 0.25 / 7 + 1e-8)
    assert_close(adv, [[0.5 / std, 0.5 / std, 0], [-0.5 / std, 0, 0], [-0.5 / std] * 3, [0.5 / std, 0.5 / std, 0]])


# ---------------------------------------------------------------- policy_loss


def test_policy_loss_dispatch():
    logp = torch.tensor([[0.1, 0.3, 0.0], [-0.2, 0.0, -0.1]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    grpo = AlgorithmConfig(clip_ratio_high=0.28)
    loss, m = policy_loss(grpo, logp, old, adv, mask, normalizer=4.0)
    ref, ref_m = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.28, 3.0, "token-mean", normalizer=4.0)
    assert torch.equal(loss, ref) and m.keys() == ref_m.keys()
    gspo = AlgorithmConfig(name="gspo", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=0.3, clip_ratio_high=0.3)
    assert_close(policy_loss(gspo, logp, old, adv, mask)[0], (-math.exp(0.2) + math.exp(-0.1)) / 2)
    cispo = AlgorithmConfig(name="cispo", clip_ratio_low=10.0)
    # weights exp(logp), e^0.3 = 1.35 capped at 1.2, no lower bound: loss = sum(-w*A*logp) / 5 tokens
    expected = -(math.exp(0.1) * 0.1 + 1.2 * 0.3 + math.exp(-0.2) * 0.2 + math.exp(-0.1) * 0.1) / 5
    assert_close(policy_loss(cispo, logp, old, adv, mask)[0], expected)
