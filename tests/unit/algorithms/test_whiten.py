"""hybridrl.algorithms.whiten: masked variance and whitening against hand-computed values."""

from __future__ import annotations

import math

import torch

from hybridrl.algorithms import masked_var, masked_whiten
from tests.unit.algorithms.reference import assert_close


def test_masked_var_and_whiten_hand_computed():
    # masked values 1, 3, 8: mean 4, squared deviations 9 + 1 + 16 = 26
    values = torch.tensor([[1.0, 3.0, float("nan")], [8.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert_close(masked_var(values, mask), 13.0)  # 26 / (3 - 1)
    assert_close(masked_var(values, mask, unbiased=False), 26 / 3)
    s = math.sqrt(13 + 1e-8)
    assert_close(masked_whiten(values, mask), [[-3 / s, -1 / s, 0], [4 / s, 0, 0]])
    assert_close(masked_whiten(values, mask, shift_mean=False), [[-3 / s + 4, -1 / s + 4, 0], [4 / s + 4, 0, 0]])


def test_whiten_edge_cases():
    # one token: variance 0 (verl raises), whitened to 0; empty mask: all 0, no NaN
    assert_close(masked_var(torch.tensor([[5.0, 1.0]]), torch.tensor([[1, 0]])), 0.0)
    assert_close(masked_whiten(torch.tensor([[5.0, 1.0]]), torch.tensor([[1, 0]])), [[0.0, 0.0]])
    assert_close(masked_whiten(torch.tensor([[5.0, 1.0]]), torch.tensor([[0, 0]])), [[0.0, 0.0]])
