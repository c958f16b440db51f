"""hybridrl.algorithms.returns: token rewards, discounted returns (REINFORCE++) and GAE (PPO) against hand-computed
values and the textbook recursion run over each sequence's response tokens (tests/unit/algorithms/reference.py)."""

from __future__ import annotations

import torch

from hybridrl.algorithms import discounted_returns, gae_advantages, last_token_rewards, reinforce_pp_advantages
from tests.unit.algorithms.reference import assert_close, gae_ref, scatter, whiten_ref

# ---------------------------------------------------------------- token rewards and returns


def test_last_token_rewards_ragged():
    scores = torch.tensor([1.0, 2.0, 3.0])
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])  # row 1 has a hole; row 2 is empty
    assert_close(last_token_rewards(scores, mask), [[0, 1, 0, 0], [0, 0, 2, 0], [0, 0, 0, 0]])


def test_discounted_returns_hand_computed():
    # row 0, gamma 0.5: rewards [-0.02, -0.04, 0.9]: G2 = 0.9, G1 = -0.04 + 0.45 = 0.41, G0 = -0.02 + 0.205
    # row 1: rewards [-0.05, 2.1]: G1 = 2.1, G0 = -0.05 + 1.05 = 1.0;  padding rewards (9) are ignored
    rewards = torch.tensor([[-0.02, -0.04, 0.9, 9.0], [-0.05, 2.1, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert_close(discounted_returns(rewards, mask, 0.5), [[0.185, 0.41, 0.9, 0], [1.0, 2.1, 0, 0]])


def test_discounted_returns_carry_over_a_hole():
    # a masked tool-output token between two response tokens: the return skips it undiscounted
    # (verl resets at every masked position and would give G0 = 0 here)
    assert_close(discounted_returns(torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[1, 0, 1]]), 0.5), [[0.5, 0.0, 1.0]])


def test_reinforce_pp_advantages_whiten_the_returns():
    rewards = torch.tensor([[-0.02, -0.04, 0.9, 0.0], [-0.05, 2.1, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = reinforce_pp_advantages(rewards, mask, 0.5)
    assert_close(ret, [[0.185, 0.41, 0.9, 0], [1.0, 2.1, 0, 0]])
    m = mask.tolist()
    assert_close(adv, scatter(m, whiten_ref([0.185, 0.41, 0.9, 1.0, 2.1])))


# ---------------------------------------------------------------- GAE

# row 0: score 1 on its last token, values [0.5, 0.6, 0.8];  row 1: score 0, values [0.3, -0.2], padding 5
GAE_REWARDS = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
GAE_VALUES = torch.tensor([[0.5, 0.6, 0.8], [0.3, -0.2, 5.0]])
GAE_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_gae_gamma_1_lam_095_hand_computed():
    # row 0: d2 = 1 - 0.8 = 0.2, A2 = 0.2;  d1 = 0.8 - 0.6 = 0.2, A1 = 0.2 + 0.95*0.2 = 0.39
    #        d0 = 0.6 - 0.5 = 0.1, A0 = 0.1 + 0.95*0.39 = 0.4705;  returns = A + V = [0.9705, 0.99, 1.0]
    # row 1: d1 = 0 - (-0.2) = 0.2, A1 = 0.2;  d0 = -0.2 - 0.3 = -0.5, A0 = -0.5 + 0.19 = -0.31
    #        returns = [-0.01, 0.0]
    adv, ret = gae_advantages(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=1.0, lam=0.95)
    assert_close(ret, [[0.9705, 0.99, 1.0], [-0.01, 0.0, 0.0]])
    assert_close(adv, scatter(GAE_MASK.tolist(), whiten_ref([0.4705, 0.39, 0.2, -0.31, 0.2])))


def test_gae_gamma_099_lam_09_hand_computed():
    # gamma*lam = 0.891
    # row 0: A2 = 1 - 0.8 = 0.2;  d1 = 0.99*0.8 - 0.6 = 0.192, A1 = 0.192 + 0.891*0.2 = 0.3702
    #        d0 = 0.99*0.6 - 0.5 = 0.094, A0 = 0.094 + 0.891*0.3702 = 0.4238482
    # row 1: A1 = 0.2;  d0 = 0.99*(-0.2) - 0.3 = -0.498, A0 = -0.498 + 0.1782 = -0.3198
    adv, ret = gae_advantages(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.99, lam=0.9)
    assert_close(ret, [[0.9238482, 0.9702, 1.0], [-0.0198, 0.0, 0.0]])
    assert_close(adv, scatter(GAE_MASK.tolist(), whiten_ref([0.4238482, 0.3702, 0.2, -0.3198, 0.2])))


def test_gae_ragged_with_holes_matches_textbook_loop():
    g = torch.Generator().manual_seed(0)
    mask = [[1, 1, 1, 1, 0, 0], [1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
    m = torch.tensor(mask)
    scores = torch.tensor([1.0, -0.5, 0.25, 2.0])
    rewards = last_token_rewards(scores, m) - 0.1 * torch.rand(4, 6, generator=g) * m  # per-token KL-like penalties
    values = torch.randn(4, 6, generator=g)
    for gamma, lam in ((1.0, 0.95), (0.99, 0.9)):
        raw, rets = gae_ref(rewards.tolist(), values.tolist(), mask, gamma, lam)
        adv, ret = gae_advantages(rewards, values, m, gamma, lam)
        assert_close(ret, scatter(mask, rets), atol=1e-5)
        assert_close(adv, scatter(mask, whiten_ref(raw)), atol=1e-5)


def test_gae_ignores_nan_at_padding():
    values = GAE_VALUES.clone()
    values[1, 2] = float("nan")
    adv, ret = gae_advantages(GAE_REWARDS, values, GAE_MASK, gamma=1.0, lam=0.95)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert_close(ret[1], [-0.01, 0.0, 0.0])
