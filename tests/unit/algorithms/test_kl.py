"""hybridrl.algorithms.kl: the KL estimators (k1, k2, k3, abs and verl's names for them), k3's clamps, and the KL
subtracted from rewards, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms import apply_kl_to_rewards, canonical_kl_estimator, kl_penalty
from tests.unit.algorithms.reference import assert_close

LOGP = torch.tensor([-1.0, -2.0])
REF = torch.tensor([-1.5, -1.0])  # logp - ref = [0.5, -1.0]


def test_kl_estimators():
    assert_close(kl_penalty(LOGP, REF, "k1"), [0.5, -1.0])
    assert_close(kl_penalty(LOGP, REF, "k2"), [0.125, 0.5])  # 0.5 * [0.25, 1]
    # ref - logp = [-0.5, 1]: exp(-0.5) + 0.5 - 1 = 0.1065307;  exp(1) - 1 - 1 = 0.7182818
    assert_close(kl_penalty(LOGP, REF, "k3"), [math.exp(-0.5) - 0.5, math.e - 2])
    assert_close(kl_penalty(LOGP, REF, "abs"), [0.5, 1.0])
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(LOGP, REF, "k4")


def test_verl_names_are_the_same_estimators():
    assert_close(kl_penalty(LOGP, REF, "kl"), kl_penalty(LOGP, REF, "k1"))
    assert_close(kl_penalty(LOGP, REF, "mse"), kl_penalty(LOGP, REF, "k2"))
    assert_close(kl_penalty(LOGP, REF, "low_var_kl"), kl_penalty(LOGP, REF, "k3"))
    names = ("kl", "mse", "low_var_kl", "abs", "k3")
    assert [canonical_kl_estimator(n) for n in names] == ["k1", "k2", "k3", "abs", "k3"]
    with pytest.raises(ValueError, match="unknown KL estimator 'full'"):
        canonical_kl_estimator("full")


def test_k3_is_clamped_per_token_and_finite_at_extreme_ratios():
    # As verl: each token's k3 is clamped to [-10, 10], after its log-ratio is clamped to [-20, 20].
    # ref - logp = 11: exp(11) - 11 - 1 = 59862.1 -> 10;  2: e^2 - 3 = 4.3890561 stays;  -11: e^-11 + 10 -> 10
    logp = torch.tensor([-12.0, -3.0, -1.0])
    ref = torch.tensor([-1.0, -1.0, -12.0])
    assert_close(kl_penalty(logp, ref, "k3"), [10.0, math.exp(2) - 3, 10.0])
    # ref - logp = +-100 (exp(100) overflows float32): clamped to +-20 first, so both finite, then 10
    kl = kl_penalty(torch.tensor([-100.0, 0.0]), torch.tensor([0.0, -100.0]), "k3")
    assert torch.isfinite(kl).all()
    assert_close(kl, [10.0, 10.0])


def test_apply_kl_to_rewards_sequence_and_token():
    logp = LOGP.repeat(2, 1)
    ref = REF.repeat(2, 1)
    mask = torch.tensor([[1, 1], [1, 0]])
    # k1 per token = [0.5, -1.0]; seq kl = [0.5 - 1.0, 0.5] = [-0.5, 0.5]; coef 0.1
    new, seq_kl = apply_kl_to_rewards(torch.tensor([1.0, 0.0]), logp, ref, mask, 0.1, "k1")
    assert_close(seq_kl, [-0.5, 0.5])
    assert_close(new, [1.05, -0.05])  # 1 - 0.1 * -0.5, 0 - 0.1 * 0.5
    token_new, _ = apply_kl_to_rewards(torch.zeros(2, 2), logp, ref, mask, 0.1, "k1")
    assert_close(token_new, [[-0.05, 0.1], [-0.05, 0.0]])  # padding gets no penalty
