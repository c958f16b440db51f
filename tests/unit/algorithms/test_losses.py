"""hybridrl.algorithms.losses: loss aggregation, the PPO-clip, GSPO and CISPO policy losses and the entropy,
against hand-computed values (arithmetic in the comments) and the gradients their papers define."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms import (
    LOSS_AGG_MODES,
    aggregate,
    aggregation_denominator,
    cispo_loss,
    entropy_from_logits,
    gspo_loss,
    masked_mean,
    ppo_clip_loss,
)
from tests.unit.algorithms.reference import (
    MICRO_BATCHES,
    MICRO_MASK,
    assert_close,
    micro_batches_equal_full_batch,
)

# ---------------------------------------------------------------- aggregation


def test_masked_mean_ignores_padding_garbage():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert_close(masked_mean(x, mask), 3.25)  # (1 + 2 + 4 + 6) / 4
    assert_close(masked_mean(x, torch.zeros_like(mask)), 0.0)


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
    assert_close(aggregate(LOSS, MASK, mode), expected)
    assert_close(aggregate(LOSS, torch.zeros_like(MASK), mode), 0.0)  # empty mask: 0, not NaN


def test_aggregate_normalizer_and_errors():
    assert_close(aggregate(LOSS, MASK, "token-mean", normalizer=10.0), 0.7)  # 7 / 10
    assert_close(aggregate(LOSS, MASK, "seq-mean-token-mean", normalizer=torch.tensor(10.0)), 0.55)  # 5.5 / 10
    assert_close(aggregation_denominator(MASK, "token-mean"), 3)
    assert_close(aggregation_denominator(MASK, "seq-mean-token-sum"), 2)
    assert_close(aggregation_denominator(MASK, "seq-mean-token-sum-norm"), 6)
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'sum'"):
        aggregate(LOSS, MASK, "sum")
    with pytest.raises(ValueError, match="normalizer must be positive"):
        aggregate(LOSS, MASK, "token-mean", normalizer=0.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_accumulation_with_normalizer_equals_full_batch(mode):
    def loss(x, mask, norm, rows):
        return aggregate(x.square(), mask, mode, normalizer=norm)

    micro_batches_equal_full_batch(loss, mode, aggregation_denominator)
    # Averaging per-micro-batch means is NOT the same (why the normalizer exists), so the check above can fail.
    x = torch.linspace(-0.5, 0.4, 20).view(4, 5)
    full = x.clone().requires_grad_()
    aggregate(full.square(), MICRO_MASK, mode).backward()
    naive = x.clone().requires_grad_()
    for s in MICRO_BATCHES:
        (aggregate(naive[s].square(), MICRO_MASK[s], mode) / len(MICRO_BATCHES)).backward()
    assert not torch.allclose(naive.grad, full.grad, atol=1e-4)


# ---------------------------------------------------------------- PPO-clip

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


def _ppo_logp() -> torch.Tensor:
    return torch.tensor([[*(math.log(r) for r in RATIOS), 50.0]], requires_grad=True)


def test_ppo_clip_loss_values_metrics_and_grads():
    logp = _ppo_logp()
    loss, m = ppo_clip_loss(logp, torch.zeros(1, 7), ADV, PPO_MASK, 0.2, 0.3, 3.0, "token-mean")
    assert_close(loss, 0.35)
    assert_close(m["clip_frac"], 2 / 6)  # tokens 2 and 4
    assert_close(m["dual_clip_frac"], 1 / 6)  # token 6
    assert_close(m["ratio_mean"], sum(RATIOS) / 6)  # 8.8 / 6
    assert_close(m["ppo_kl"], -sum(math.log(r) for r in RATIOS) / 6)  # -ln(1.98) / 6 = -0.1138495
    assert all(not v.requires_grad for v in m.values())
    loss.backward()
    # d(-A*r)/dlogp = -A*r where the unclipped term is active, else 0; divided by 6 tokens
    assert_close(logp.grad, [[-1.1 / 6, 0, -0.5 / 6, 0, 1.2 / 6, 0, 0]])


def test_ppo_clip_loss_is_weights_and_1d_advantages():
    w = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 7.0]], requires_grad=True)
    loss, _ = ppo_clip_loss(_ppo_logp(), torch.zeros(1, 7), ADV, PPO_MASK, 0.2, 0.3, 3.0, "token-mean", is_weights=w)
    assert_close(loss, (2.1 - 1.5) / 6)  # token 6 contributes 3.0 * 0.5 instead of 3.0
    loss.backward()
    assert w.grad is None
    # [B] advantages are broadcast: A=+1 on ratios [1.1, 1.5] -> (-1.1 - 1.3) / 2 = -1.2
    logp = torch.tensor([[math.log(1.1), math.log(1.5)]])
    adv_1d = torch.tensor([1.0])
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 2), adv_1d, torch.ones(1, 2), 0.2, 0.3, 3.0, "token-mean")
    assert_close(loss, -1.2)


def test_ppo_clip_loss_seq_mode_with_normalizer():
    # seq-mean-token-sum over one sequence: token sum 2.1; normalizer 4 sequences -> 0.525
    loss, _ = ppo_clip_loss(
        _ppo_logp(), torch.zeros(1, 7), ADV, PPO_MASK, 0.2, 0.3, 3.0, "seq-mean-token-sum", normalizer=4.0
    )
    assert_close(loss, 2.1 / 4)


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
    assert_close(loss, (-S0 + S1) / 2)
    assert_close(m["clip_frac"], 0.0)
    assert_close(m["ppo_kl"], -(0.1 + 0.3 - 0.2 + 0.0 - 0.1) / 5)
    loss.backward()
    # paper: grad of sequence i = -A_i * s_i * (1/|y_i|) * sum_t grad logp_t, then / number of sequences
    assert_close(logp.grad, [[-S0 / 2 / 2, -S0 / 2 / 2, 0.0], [S1 / 3 / 2, S1 / 3 / 2, S1 / 3 / 2]])


def test_gspo_paper_clip_ranges_clip_whole_sequences():
    logp = _gspo_logp()
    loss, m = gspo_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), GSPO_MASK, 3e-4, 4e-4)
    # s0 = 1.22 > 1.0004 with A > 0 -> -1.0004;  s1 = 0.905 < 0.9997 with A < 0 -> +0.9997
    assert_close(loss, (-1.0004 + 0.9997) / 2)
    assert_close(m["clip_frac"], 1.0)
    loss.backward()
    assert_close(logp.grad, torch.zeros(2, 3))  # clipped sequences get no gradient


def test_gspo_sequence_level_not_token_level():
    # tokens of one sequence with ratios e^0.5 and e^-0.5: token PPO would clip both (clip 0.2), the
    # sequence ratio is exactly 1, so GSPO clips nothing and every token has gradient -A/|y|
    logp = torch.tensor([[0.5, -0.5]], requires_grad=True)
    loss, m = gspo_loss(logp, torch.zeros(1, 2), torch.tensor([2.0]), torch.ones(1, 2), 0.2, 0.2)
    assert_close(loss, -2.0)
    assert_close(m["clip_frac"], 0.0)
    loss.backward()
    assert_close(logp.grad, [[-1.0, -1.0]])


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
    assert_close(loss, (-1.2 * math.log(1.5) + 0.5 * math.log(0.5) - 2.2 * math.log(1.1)) / 3)
    assert_close(m["clip_frac"], 1 / 3)
    loss.backward()
    # the weights are detached: d loss / d logp_t = -w_t * A_t / 3 exactly (no d w / d logp term, which
    # for the unclipped tokens would add -A * logp * ratio)
    assert_close(logp.grad, [[-1.2 / 3, 0.5 / 3, -2.2 / 3, 0.0]])


def test_cispo_lower_bound_and_seq_mode():
    logp = _cispo_logp()
    loss, _ = cispo_loss(logp, torch.zeros(1, 4), CISPO_ADV, CISPO_MASK, 0.2, 0.2, "seq-mean-token-sum")
    # token 2's weight is now max(0.5, 0.8) = 0.8;  one sequence: token sum
    assert_close(loss, -1.2 * math.log(1.5) + 0.8 * math.log(0.5) - 2.2 * math.log(1.1))
    loss.backward()
    assert_close(logp.grad, [[-1.2, 0.8, -2.2, 0.0]])


# ---------------------------------------------------------------- micro-batches add up to the batch

NORM_ADV = torch.tensor([1.0, -0.5, 2.0, -1.0])
NORM_OLD = torch.linspace(-0.3, 0.3, 20).view(4, 5)


def test_gspo_normalizer_accumulates_to_full_batch():
    def loss(lp, mask, norm, rows):
        return gspo_loss(lp, NORM_OLD[rows], NORM_ADV[rows], mask, 0.2, 0.2, normalizer=norm)[0]

    micro_batches_equal_full_batch(loss, "seq-mean-token-mean", aggregation_denominator)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_cispo_normalizer_accumulates_to_full_batch(mode):
    def loss(lp, mask, norm, rows):
        return cispo_loss(lp, NORM_OLD[rows], NORM_ADV[rows], mask, 0.2, 0.28, mode, normalizer=norm)[0]

    micro_batches_equal_full_batch(loss, mode, aggregation_denominator)


# ---------------------------------------------------------------- entropy


def test_entropy_from_logits():
    # uniform over 2: ln 2;  p = [1/4, 3/4]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3)]])
    assert_close(entropy_from_logits(logits), [math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))])
    peaked = entropy_from_logits(torch.tensor([[0.0, -1e4], [1e4, 0.0]]))
    assert_close(peaked, [0.0, 0.0])  # finite, no 0 * log 0 = NaN
