"""Advantage estimators, returns, GAE and whitening against hand-computed values.

Expected numbers are written out (arithmetic in the comments) or come from plain-Python loops in this
file that follow the papers' formulas over each sequence's list of response tokens; never from the code
under test.
"""

from __future__ import annotations

import math

import torch

from hybridrl.algorithms import (
    discounted_returns,
    gae_advantages,
    last_token_rewards,
    masked_var,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)


def close(actual, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=atol,
        rtol=0,
    )


def whiten_ref(xs: list[float]) -> list[float]:
    """verl's masked_whiten by hand: (x - mean) / sqrt(unbiased var + 1e-8)."""
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


def scatter(mask: list[list[int]], flat: list[float]) -> list[list[float]]:
    """Put per-token values (row-major over mask==1 positions) back into [B, T], 0 elsewhere."""
    it = iter(flat)
    return [[next(it) if m else 0.0 for m in row] for row in mask]


# ---------------------------------------------------------------- whitening


def test_masked_var_and_whiten_hand_computed():
    # masked values 1, 3, 8: mean 4, squared deviations 9 + 1 + 16 = 26
    values = torch.tensor([[1.0, 3.0, float("nan")], [8.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(masked_var(values, mask), 13.0)  # 26 / (3 - 1)
    close(masked_var(values, mask, unbiased=False), 26 / 3)
    s = math.sqrt(13 + 1e-8)
    close(masked_whiten(values, mask), [[-3 / s, -1 / s, 0], [4 / s, 0, 0]])
    close(masked_whiten(values, mask, shift_mean=False), [[-3 / s + 4, -1 / s + 4, 0], [4 / s + 4, 0, 0]])


def test_whiten_edge_cases():
    # one token: variance 0 (verl raises), whitened to 0; empty mask: all 0, no NaN
    close(masked_var(torch.tensor([[5.0, 1.0]]), torch.tensor([[1, 0]])), 0.0)
    close(masked_whiten(torch.tensor([[5.0, 1.0]]), torch.tensor([[1, 0]])), [[0.0, 0.0]])
    close(masked_whiten(torch.tensor([[5.0, 1.0]]), torch.tensor([[0, 0]])), [[0.0, 0.0]])


# ---------------------------------------------------------------- RLOO


def test_rloo_hand_computed():
    # [3, 1, 2]: 3 - (1+2)/2 = 1.5; 1 - (3+2)/2 = -1.5; 2 - (3+1)/2 = 0.  [0.5]*3: all equal -> exactly 0
    rewards = torch.tensor([3.0, 1.0, 2.0, 0.5, 0.5, 0.5])
    close(rloo_advantages(rewards, 3), [1.5, -1.5, 0.0, 0.0, 0.0, 0.0])
    assert torch.equal(rloo_advantages(torch.full((4,), 0.1), 2), torch.zeros(4))


def test_rloo_matches_leave_one_out_loop():
    rewards = [0.3, 1.0, 0.0, 0.7, 0.2, 0.9, 0.9, 0.4]
    g = 4
    expected = []
    for i, r in enumerate(rewards):
        start = (i // g) * g
        others = [rewards[j] for j in range(start, start + g) if j != i]
        expected.append(r - sum(others) / len(others))
    close(rloo_advantages(torch.tensor(rewards), g), expected)


# ---------------------------------------------------------------- REINFORCE++-baseline


def test_reinforce_pp_baseline_group_mean_then_batch_whitening():
    # groups of 2: [1, 0] -> [0.5, -0.5];  [2, 2] -> [0, 0]
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]])
    # tokens: 0.5 x3 (row 0), -0.5 (row 1), 0 x2 (row 2), 0 (row 3) -> whitened over all 7 tokens
    tokens = [0.5, 0.5, 0.5, -0.5, 0.0, 0.0, 0.0]
    m = [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]]
    close(reinforce_pp_baseline_advantages(rewards, mask, 2), scatter(m, whiten_ref(tokens)))
    # mean 1/7: the all-equal group's tokens are not 0 after batch whitening (token-weighted, as verl)
    assert reinforce_pp_baseline_advantages(rewards, mask, 2)[2, 0] < 0


# ---------------------------------------------------------------- token rewards and returns


def test_last_token_rewards_ragged():
    scores = torch.tensor([1.0, 2.0, 3.0])
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])  # row 1 has a hole; row 2 is empty
    close(last_token_rewards(scores, mask), [[0, 1, 0, 0], [0, 0, 2, 0], [0, 0, 0, 0]])


def test_discounted_returns_hand_computed():
    # row 0, gamma 0.5: rewards [-0.02, -0.04, 0.9]: G2 = 0.9, G1 = -0.04 + 0.45 = 0.41, G0 = -0.02 + 0.205
    # row 1: rewards [-0.05, 2.1]: G1 = 2.1, G0 = -0.05 + 1.05 = 1.0;  padding rewards (9) are ignored
    rewards = torch.tensor([[-0.02, -0.04, 0.9, 9.0], [-0.05, 2.1, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    close(discounted_returns(rewards, mask, 0.5), [[0.185, 0.41, 0.9, 0], [1.0, 2.1, 0, 0]])


def test_discounted_returns_carry_over_a_hole():
    # a masked tool-output token between two response tokens: the return skips it undiscounted
    # (verl resets at every masked position and would give G0 = 0 here)
    close(discounted_returns(torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[1, 0, 1]]), 0.5), [[0.5, 0.0, 1.0]])


def test_reinforce_pp_advantages_whiten_the_returns():
    rewards = torch.tensor([[-0.02, -0.04, 0.9, 0.0], [-0.05, 2.1, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = reinforce_pp_advantages(rewards, mask, 0.5)
    close(ret, [[0.185, 0.41, 0.9, 0], [1.0, 2.1, 0, 0]])
    m = mask.tolist()
    close(adv, scatter(m, whiten_ref([0.185, 0.41, 0.9, 1.0, 2.1])))


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
    close(ret, [[0.9705, 0.99, 1.0], [-0.01, 0.0, 0.0]])
    close(adv, scatter(GAE_MASK.tolist(), whiten_ref([0.4705, 0.39, 0.2, -0.31, 0.2])))


def test_gae_gamma_099_lam_09_hand_computed():
    # gamma*lam = 0.891
    # row 0: A2 = 1 - 0.8 = 0.2;  d1 = 0.99*0.8 - 0.6 = 0.192, A1 = 0.192 + 0.891*0.2 = 0.3702
    #        d0 = 0.99*0.6 - 0.5 = 0.094, A0 = 0.094 + 0.891*0.3702 = 0.4238482
    # row 1: A1 = 0.2;  d0 = 0.99*(-0.2) - 0.3 = -0.498, A0 = -0.498 + 0.1782 = -0.3198
    adv, ret = gae_advantages(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.99, lam=0.9)
    close(ret, [[0.9238482, 0.9702, 1.0], [-0.0198, 0.0, 0.0]])
    close(adv, scatter(GAE_MASK.tolist(), whiten_ref([0.4238482, 0.3702, 0.2, -0.3198, 0.2])))


def gae_ref(rewards: list[list[float]], values: list[list[float]], mask: list[list[int]], gamma: float, lam: float):
    """The textbook recursion over each sequence's response tokens only (a hole is simply not a step)."""
    raw, rets = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        idx = [t for t, m in enumerate(m_row) if m]
        a_row = [0.0] * len(idx)
        nxt_v, nxt_a = 0.0, 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            delta = r_row[t] + gamma * nxt_v - v_row[t]
            a_row[k] = delta + gamma * lam * nxt_a
            nxt_v, nxt_a = v_row[t], a_row[k]
        raw.extend(a_row)
        rets.extend(a + v_row[t] for a, t in zip(a_row, idx))
    return raw, rets


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
        close(ret, scatter(mask, rets), atol=1e-5)
        close(adv, scatter(mask, whiten_ref(raw)), atol=1e-5)


def test_gae_ignores_nan_at_padding():
    values = GAE_VALUES.clone()
    values[1, 2] = float("nan")
    adv, ret = gae_advantages(GAE_REWARDS, values, GAE_MASK, gamma=1.0, lam=0.95)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    close(ret[1], [-0.01, 0.0, 0.0])
