"""GSPO, CISPO, the clipped value loss and the KL estimators against hand-computed values and the
gradients their papers define."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms import (
    LOSS_AGG_MODES,
    aggregation_denominator,
    canonical_kl_estimator,
    cispo_loss,
    clipped_value_loss,
    explained_variance,
    gspo_loss,
    kl_penalty,
)


def close(actual, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=atol,
        rtol=0,
    )


# ---------------------------------------------------------------- GSPO
# old_logp = 0. Row 0: token log-ratios [0.1, 0.3] (padding NaN) -> mean 0.2, s0 = e^0.2 = 1.2214028
#               Row 1: [-0.2, 0.0, -0.1] -> mean -0.1, s1 = e^-0.1 = 0.9048374
# A = [+1, -1] per sequence.
GSPO_MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
S0, S1 = math.exp(0.2), math.exp(-0.1)


def _gspo_logp() -> torch.Tensor:
    return torch.tensor([[0.1, 0.3, float("nan")], [-0.2, 0.0, -0.1]], requires_grad=True)


def test_gspo_unclipped_value_and_per_token_gradient():
    logp = _gspo_logp()
    loss, m = gspo_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), GSPO_MASK, 0.3, 0.3)
    # both ratios inside [0.7, 1.3]: per-sequence loss -A*s = [-1.2214028, +0.9048374], mean over 2 sequences
    close(loss, (-S0 + S1) / 2)
    close(m["clip_frac"], 0.0)
    close(m["ppo_kl"], -(0.1 + 0.3 - 0.2 + 0.0 - 0.1) / 5)
    loss.backward()
    # paper: grad of sequence i = -A_i * s_i * (1/|y_i|) * sum_t grad logp_t, then / number of sequences
    close(logp.grad, [[-S0 / 2 / 2, -S0 / 2 / 2, 0.0], [S1 / 3 / 2, S1 / 3 / 2, S1 / 3 / 2]])


def test_gspo_paper_clip_ranges_clip_whole_sequences():
    logp = _gspo_logp()
    loss, m = gspo_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), GSPO_MASK, 3e-4, 4e-4)
    # s0 = 1.22 > 1.0004 with A > 0 -> -1.0004;  s1 = 0.905 < 0.9997 with A < 0 -> +0.9997
    close(loss, (-1.0004 + 0.9997) / 2)
    close(m["clip_frac"], 1.0)
    loss.backward()
    close(logp.grad, torch.zeros(2, 3))  # clipped sequences get no gradient


def test_gspo_sequence_level_not_token_level():
    # tokens of one sequence with ratios e^0.5 and e^-0.5: token PPO would clip both (clip 0.2), the
    # sequence ratio is exactly 1, so GSPO clips nothing and every token has gradient -A/|y|
    logp = torch.tensor([[0.5, -0.5]], requires_grad=True)
    loss, m = gspo_loss(logp, torch.zeros(1, 2), torch.tensor([2.0]), torch.ones(1, 2), 0.2, 0.2)
    close(loss, -2.0)
    close(m["clip_frac"], 0.0)
    loss.backward()
    close(logp.grad, [[-1.0, -1.0]])


# ---------------------------------------------------------------- CISPO
# old_logp = 0; ratios [1.5, 0.5, 1.1] (token 4 is padding); A = [1, -1, 2]; clip_high 0.2
CISPO_MASK = torch.tensor([[1, 1, 1, 0]])
CISPO_ADV = torch.tensor([[1.0, -1.0, 2.0, 7.0]])


def _cispo_logp() -> torch.Tensor:
    return torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1), float("nan")]], requires_grad=True)


def test_cispo_value_and_gradient_without_lower_bound():
    logp = _cispo_logp()
    loss, m = cispo_loss(logp, torch.zeros(1, 4), CISPO_ADV, CISPO_MASK, 10.0, 0.2, "token-mean")
    # weights: min(1.5, 1.2) = 1.2;  0.5 (lower bound 1 - 10 < 0: none);  1.1
    # loss_t = -w * A * logp: -1.2*ln1.5 = -0.4865581, -0.5*(-1)*ln0.5 = -0.3465736, -1.1*2*ln1.1 = -0.2096825
    close(loss, (-1.2 * math.log(1.5) + 0.5 * math.log(0.5) - 2.2 * math.log(1.1)) / 3)
    close(m["clip_frac"], 1 / 3)
    loss.backward()
    # the weights are detached: d loss / d logp_t = -w_t * A_t / 3 exactly (no d w / d logp term, which
    # for the unclipped tokens would add -A * logp * ratio)
    close(logp.grad, [[-1.2 / 3, 0.5 / 3, -2.2 / 3, 0.0]])


def test_cispo_lower_bound_and_seq_mode():
    logp = _cispo_logp()
    loss, _ = cispo_loss(logp, torch.zeros(1, 4), CISPO_ADV, CISPO_MASK, 0.2, 0.2, "seq-mean-token-sum")
    # token 2's weight is now max(0.5, 0.8) = 0.8;  one sequence: token sum
    close(loss, -1.2 * math.log(1.5) + 0.8 * math.log(0.5) - 2.2 * math.log(1.1))
    loss.backward()
    close(logp.grad, [[-1.2, 0.8, -2.2, 0.0]])


# ---------------------------------------------------------------- normalizer for every loss


def _micro_equals_full(loss_fn, mode: str) -> None:
    x = torch.linspace(-0.5, 0.4, 20).view(4, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]])
    full = x.clone().requires_grad_()
    loss_fn(full, mask, None).backward()
    micro = [slice(0, 1), slice(1, 4)]
    norm = sum(aggregation_denominator(mask[s], mode) for s in micro)
    acc = x.clone().requires_grad_()
    for s in micro:
        loss_fn(acc[s], mask[s], norm, s).backward()
    close(acc.grad, full.grad)


ADV = torch.tensor([1.0, -0.5, 2.0, -1.0])
OLD = torch.linspace(-0.3, 0.3, 20).view(4, 5)


def test_gspo_normalizer_accumulates_to_full_batch():
    def fn(lp, mask, norm, s=slice(None)):
        return gspo_loss(lp, OLD[s], ADV[s], mask, 0.2, 0.2, normalizer=norm)[0]

    _micro_equals_full(fn, "seq-mean-token-mean")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_cispo_and_value_loss_normalizer_accumulates_to_full_batch(mode):
    def cispo(lp, mask, norm, s=slice(None)):
        return cispo_loss(lp, OLD[s], ADV[s], mask, 0.2, 0.28, mode, normalizer=norm)[0]

    def value(v, mask, norm, s=slice(None)):
        return clipped_value_loss(v, OLD[s], OLD[s] * 2 + 0.1, mask, 0.05, mode, normalizer=norm)[0]

    _micro_equals_full(cispo, mode)
    _micro_equals_full(value, mode)


# ---------------------------------------------------------------- value loss


def test_clipped_value_loss_hand_computed():
    # cliprange 0.2, returns R, old values v_old:
    #  t  v    v_old  R    clipped v   (v-R)^2   (clip-R)^2   max
    #  0  1.2  0.8    1.5  1.0         0.09      0.25         0.25  (clipped)
    #  1  2.0  1.0    1.0  1.2         1.0       0.04         1.0
    #  2  0.5  0.5    0.0  0.5         0.25      0.25         0.25
    #  3  9    0      0    (padding)
    # 0.5 * token-mean = 0.5 * 1.5 / 3 = 0.25
    values = torch.tensor([[1.2, 2.0, 0.5, 9.0]], requires_grad=True)
    old = torch.tensor([[0.8, 1.0, 0.5, 0.0]])
    returns = torch.tensor([[1.5, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, m = clipped_value_loss(values, old, returns, mask, 0.2, "token-mean")
    close(loss, 0.25)
    close(m["vf_clipfrac"], 1 / 3)
    close(m["vpred_mean"], 3.7 / 3)
    loss.backward()
    # token 0: the clipped term wins and is flat in v -> 0; token 1: (v - R) / 3; token 2: (v - R) / 3
    close(values.grad, [[0.0, 1 / 3, 0.5 / 3, 0.0]])


def test_explained_variance():
    # R - V = [0, 0, 1]: unbiased var 1/3;  var(R = [1, 2, 3]) = 1
    ev = explained_variance(
        torch.tensor([[1.0, 2.0, 2.0, 7.0]]), torch.tensor([[1.0, 2.0, 3.0, 0.0]]), torch.tensor([[1, 1, 1, 0]])
    )
    close(ev, 1 - (1 / 3) / (1 + 1e-5))


# ---------------------------------------------------------------- KL


def test_kl_abs_and_aliases():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])  # logp - ref = [0.5, -1]
    close(kl_penalty(logp, ref, "abs"), [0.5, 1.0])
    close(kl_penalty(logp, ref, "kl"), [0.5, -1.0])
    close(kl_penalty(logp, ref, "mse"), [0.125, 0.5])
    close(kl_penalty(logp, ref, "low_var_kl"), [math.exp(-0.5) - 0.5, math.e - 2])
    names = ("kl", "mse", "low_var_kl", "abs", "k3")
    assert [canonical_kl_estimator(n) for n in names] == ["k1", "k2", "k3", "abs", "k3"]
    with pytest.raises(ValueError, match="unknown KL estimator 'full'"):
        canonical_kl_estimator("full")


def test_k3_clamped_per_token_when_reference_exceeds_policy_by_11():
    # ref - logp = 11: exp(11) - 11 - 1 = 59862.1 before the clamp; verl clamps each token to 10.
    # ref - logp = 2: e^2 - 3 = 4.3890561 stays; ref - logp = -11: e^-11 + 10 = 10.0000167 -> 10
    logp = torch.tensor([-12.0, -3.0, -1.0])
    ref = torch.tensor([-1.0, -1.0, -12.0])
    close(kl_penalty(logp, ref, "k3"), [10.0, math.exp(2) - 3, 10.0])
