"""hybridrl.algorithms.advantages: the group-relative estimators (GRPO, RLOO, REINFORCE++-baseline) against
hand-computed values (arithmetic in the comments) and plain-Python loops over each group."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms import (
    broadcast_to_tokens,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from tests.unit.algorithms.reference import assert_close, scatter, whiten_ref

# ---------------------------------------------------------------- GRPO


def test_grpo_advantages_hand_computed():
    # group 1 = [1, 0, 0, 1]: mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 1/sqrt(3)
    #   adv = +-0.5 * sqrt(3) = +-0.8660254
    # group 2 = [1, 1, 1, 1]: all equal -> 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    h = math.sqrt(3) / 2
    assert_close(grpo_advantages(rewards, 4, eps=0.0), [h, -h, -h, h, 0, 0, 0, 0])
    # with eps: 0.5 / (0.5773503 + 1e-6) = 0.8660239
    assert_close(grpo_advantages(rewards, 4)[0], 0.5 / (1 / math.sqrt(3) + 1e-6))
    # no std (Dr. GRPO): r - mean
    assert_close(grpo_advantages(rewards, 4, norm_by_std=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_grpo_advantages_group_of_two():
    # [3, 1]: mean 2, unbiased std = sqrt((1 + 1) / 1) = sqrt(2) -> +-1/sqrt(2)
    assert_close(grpo_advantages(torch.tensor([3.0, 1.0]), 2, eps=0.0), [1 / math.sqrt(2), -1 / math.sqrt(2)])


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
    assert_close(broadcast_to_tokens(adv, mask), [[2, 2, 0], [-1, 0, 0]])


# ---------------------------------------------------------------- RLOO


def test_rloo_hand_computed():
    # [3, 1, 2]: 3 - (1+2)/2 = 1.5; 1 - (3+2)/2 = -1.5; 2 - (3+1)/2 = 0.  [0.5]*3: all equal -> exactly 0
    rewards = torch.tensor([3.0, 1.0, 2.0, 0.5, 0.5, 0.5])
    assert_close(rloo_advantages(rewards, 3), [1.5, -1.5, 0.0, 0.0, 0.0, 0.0])
    assert torch.equal(rloo_advantages(torch.full((4,), 0.1), 2), torch.zeros(4))


def test_rloo_matches_leave_one_out_loop():
    rewards = [0.3, 1.0, 0.0, 0.7, 0.2, 0.9, 0.9, 0.4]
    g = 4
    expected = []
    for i, r in enumerate(rewards):
        start = (i // g) * g
        others = [rewards[j] for j in range(start, start + g) if j != i]
        expected.append(r - sum(others) / len(others))
    assert_close(rloo_advantages(torch.tensor(rewards), g), expected)


# ---------------------------------------------------------------- REINFORCE++-baseline


def test_reinforce_pp_baseline_group_mean_then_batch_whitening():
    # groups of 2: [1, 0] -> [0.5, -0.5];  [2, 2] -> [0, 0]
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]])
    # tokens: 0.5 x3 (row 0), -0.5 (row 1), 0 x2 (row 2), 0 (row 3) -> whitened over all 7 tokens
    tokens = [0.5, 0.5, 0.5, -0.5, 0.0, 0.0, 0.0]
    m = [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]]
    assert_close(reinforce_pp_baseline_advantages(rewards, mask, 2), scatter(m, whiten_ref(tokens)))
    # mean 1/7: the all-equal group's tokens are not 0 after batch whitening (token-weighted, as verl)
    assert reinforce_pp_baseline_advantages(rewards, mask, 2)[2, 0] < 0
