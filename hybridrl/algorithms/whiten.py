"""Masked statistics over response tokens: variance and whitening with verl's conventions."""

from __future__ import annotations

import torch

from hybridrl.algorithms.losses import masked_mean

WHITEN_EPS = 1e-8
"""Added to the variance before the inverse square root (verl's `masked_whiten`)."""


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over positions where `mask` is nonzero (a 0-d tensor).

    With `unbiased` the mean of squared deviations is scaled by n / (n - 1) (Bessel), as verl's
    `masked_var`. Unlike verl, which raises for n <= 1, the variance of fewer than two values is 0
    here: one token in a batch is a legitimate edge case, and whitening then maps it to 0.
    """
    m = mask.to(values.dtype)
    mean = masked_mean(values, m)
    centered = torch.where(m > 0, values - mean, torch.zeros_like(values))
    var = masked_mean(centered.square(), m)
    if unbiased:
        n = m.sum()
        if n < 2:
            return torch.zeros_like(var)
        var = var * n / (n - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) * rsqrt(var + 1e-8) with mean and unbiased var over the masked positions.

    verl's `masked_whiten`: with `shift_mean=False` the mean is added back after scaling. Positions
    where `mask` is 0 are returned as 0 (verl leaves them whitened garbage; every caller masks them).
    """
    m = mask.to(values.dtype)
    mean = masked_mean(values, m)
    var = masked_var(values, m, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m > 0, whitened, torch.zeros_like(whitened))
