"""hybridrl.algorithms.value_loss: the critic's clipped value loss and explained variance, against hand-computed
values."""

from __future__ import annotations

import pytest
import torch

from hybridrl.algorithms import LOSS_AGG_MODES, aggregation_denominator, clipped_value_loss, explained_variance
from tests.unit.algorithms.reference import assert_close, micro_batches_equal_full_batch


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
    assert_close(loss, 0.25)
    assert_close(m["vf_clipfrac"], 1 / 3)
    assert_close(m["vpred_mean"], 3.7 / 3)
    loss.backward()
    # token 0: the clipped term wins and is flat in v -> 0; token 1: (v - R) / 3; token 2: (v - R) / 3
    assert_close(values.grad, [[0.0, 1 / 3, 0.5 / 3, 0.0]])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_normalizer_accumulates_to_full_batch(mode):
    old = torch.linspace(-0.3, 0.3, 20).view(4, 5)

    def loss(v, mask, norm, rows):
        return clipped_value_loss(v, old[rows], old[rows] * 2 + 0.1, mask, 0.05, mode, normalizer=norm)[0]

    micro_batches_equal_full_batch(loss, mode, aggregation_denominator)


def test_explained_variance():
    # R - V = [0, 0, 1]: unbiased var 1/3;  var(R = [1, 2, 3]) = 1
    ev = explained_variance(
        torch.tensor([[1.0, 2.0, 2.0, 7.0]]), torch.tensor([[1.0, 2.0, 3.0, 0.0]]), torch.tensor([[1, 1, 1, 0]])
    )
    assert_close(ev, 1 - (1 / 3) / (1 + 1e-5))
