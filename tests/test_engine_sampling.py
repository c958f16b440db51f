"""Counter-based sampling with one step index per row (rows of a continuous batch are at different steps) draws
exactly what the one-index form draws for each row alone."""

from __future__ import annotations

import torch

import math

from hybridrl.engines.sampling import (
    _mix_int,
    counter_exponential,
    exponential_from_bits,
    sample_tokens,
    step_key,
    step_keys,
)

_GOLDEN = 0x9E3779B97F4A7C15


def test_step_keys_are_step_key_per_entry():
    steps = torch.tensor([0, 1, 5, 511, 2**31 + 7, 10**12])
    # splitmix64's finalizer of (step + 1) · golden mod 2**64, as a signed int64, written out here.
    want = [(_mix_int((int(s) + 1) * _GOLDEN) + 2**63) % 2**64 - 2**63 for s in steps]
    assert step_keys(steps).tolist() == want == [step_key(int(s)) for s in steps]


def test_per_row_steps_draw_what_each_row_draws_alone():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    keys = torch.tensor([3, -7, 2**40 + 1, 0, 99, -(2**62)])
    steps = torch.tensor([0, 4, 4, 17, 1, 300])
    for top_k, top_p, temperature in ((-1, 1.0, 1.0), (5, 1.0, 0.7), (-1, 0.8, 1.3)):
        tok, lp = sample_tokens(logits, temperature, top_k, top_p, keys=keys, step=steps)
        for r in range(6):
            t1, l1 = sample_tokens(logits[r : r + 1], temperature, top_k, top_p, keys=keys[r : r + 1], step=int(steps[r]))
            assert tok[r] == t1[0] and lp[r] == l1[0]
    noise = counter_exponential(keys, steps, 50)
    for r in range(6):
        assert torch.equal(noise[r], counter_exponential(keys[r : r + 1], int(steps[r]), 50)[0])


def test_exponential_from_bits_is_minus_log_of_the_bin_centre_and_never_zero():
    """E(k) = -log((k + 0.5) / 2^24), from float64 here, for the bins at both ends and across the middle; the top bin
    once rounded to u = 1, E = 0 (a score of +inf: that token won whatever its probability)."""
    ks = [0, 1, 2**20, 2**23 - 1, 2**23, 2**23 + 1, 2**24 - 2**18, 2**24 - 3, 2**24 - 2, 2**24 - 1]
    got = exponential_from_bits(torch.tensor(ks, dtype=torch.int64))
    want = [-math.log1p(-(2**24 - k - 0.5) / 2**24) if k >= 2**23 else -math.log((k + 0.5) / 2**24) for k in ks]
    for k, g, w in zip(ks, got.tolist(), want):
        assert g > 0 and abs(g - w) <= 2e-7 * w, (k, g, w)
    assert got.tolist() == sorted(got.tolist(), reverse=True) and len(set(got.tolist())) == len(ks)


def test_a_token_of_negligible_probability_is_never_drawn():
    """One token at +40 over 50,000 at 0: the others' total probability is 50,000 · e^-40 ≈ 2e-13. With the top bin's
    E = 0 one of them won in 50,000 / 2^24 ≈ 0.3% of rows (5 of these 2,000 before the fix)."""
    rows, vocab = 2000, 50000
    logits = torch.zeros(rows, vocab)
    logits[:, 7] = 40.0
    keys = torch.arange(rows, dtype=torch.int64) * 1_000_003 + 11
    tok, _ = sample_tokens(logits, 1.0, keys=keys, step=0, kernel=False)
    assert torch.equal(tok, torch.full((rows,), 7))
