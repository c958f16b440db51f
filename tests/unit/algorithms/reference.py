"""Independent references for the algorithm tests: a float64 comparison, and plain-Python versions of the papers'
formulas (whitening, GAE) written over each sequence's list of response tokens, never through the code under test."""

from __future__ import annotations

import math

import torch


def assert_close(actual, expected, atol: float = 1e-6) -> None:
    """`actual` equals `expected` within `atol`, compared in float64."""
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


def gae_ref(rewards: list[list[float]], values: list[list[float]], mask: list[list[int]], gamma: float, lam: float):
    """The textbook GAE recursion over each sequence's response tokens only (a hole is simply not a step):
    (raw advantages, returns), both flat over the response tokens in row-major order."""
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


# Four sequences of uneven length, split into micro-batches [row 0] and [rows 1-3] (5 and 2 + 1 + 3 tokens).
MICRO_MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]])
MICRO_BATCHES = (slice(0, 1), slice(1, 4))


def micro_batches_equal_full_batch(loss_fn, mode: str, denominator) -> None:
    """The gradient of `loss_fn` over the whole batch equals the sum of its micro-batch gradients when every
    micro-batch divides by the whole batch's `denominator(mask, mode)` (the normalizer gradient accumulation needs).

    `loss_fn(x, mask, normalizer, rows)` is the loss of rows `rows` of x, normalized by `normalizer` (None: its own)."""
    x = torch.linspace(-0.5, 0.4, 20).view(4, 5)
    full = x.clone().requires_grad_()
    loss_fn(full, MICRO_MASK, None, slice(None)).backward()
    norm = sum(denominator(MICRO_MASK[s], mode) for s in MICRO_BATCHES)
    acc = x.clone().requires_grad_()
    for s in MICRO_BATCHES:
        loss_fn(acc[s], MICRO_MASK[s], norm, s).backward()
    assert_close(acc.grad, full.grad)
