"""Counter-based inverse-CDF sampling on the torch path: the uniform is splitmix64's, the pick is the softmax's
inverse CDF, and one step index per row (rows of a continuous batch are at different steps) draws exactly what the
one-index form draws for each row alone."""

from __future__ import annotations

import math

import torch

from hybridrl.engines.sampling import (
    _mix,
    _mix_int,
    counter_uniform,
    inverse_cdf,
    row_keys,
    sample_tokens,
    step_key,
    step_keys,
)

_GOLDEN = 0x9E3779B97F4A7C15


def _signed(x: int) -> int:
    return (x + 2**63) % 2**64 - 2**63


def test_mix_is_splitmix64_by_its_published_outputs():
    """splitmix64 seeded with 1234567 outputs 6457827717110365317, 3203168211198807973, 9817491932198370423 (the
    reference generator's first three): each the finalizer of seed + n · golden."""
    states = torch.tensor([_signed(1234567 + n * _GOLDEN) for n in (1, 2, 3)])
    want = [6457827717110365317, 3203168211198807973, 9817491932198370423]
    assert _mix(states).tolist() == [_signed(w) for w in want]
    assert [_mix_int(1234567 + n * _GOLDEN) for n in (1, 2, 3)] == want


def test_step_keys_are_step_key_per_entry():
    steps = torch.tensor([0, 1, 5, 511, 2**31 + 7, 10**12])
    # splitmix64's finalizer of (step + 1) · golden mod 2**64, as a signed int64, written out here.
    want = [_signed(_mix_int((int(s) + 1) * _GOLDEN)) for s in steps]
    assert step_keys(steps).tolist() == want == [step_key(int(s)) for s in steps]


def test_counter_uniform_is_the_centre_of_the_top_52_bits_bin():
    keys = torch.tensor([3, -7, 2**40 + 1, 0, -(2**62)])
    for step in (0, 9):
        got = counter_uniform(keys, step).tolist()
        for k, g in zip(keys.tolist(), got):
            h = _mix_int((k ^ step_key(step)) % 2**64)  # the row's key for the step, finalized, as unsigned
            assert g == ((h >> 12) + 0.5) / 2**52 and 0 < g < 1


def test_inverse_cdf_picks_the_entry_whose_interval_holds_u():
    """Probabilities 0.1, 0.2, 0.3, 0.4: cumulative 0.1, 0.3, 0.6, 1.0 (by hand)."""
    scaled = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()[None].expand(7, -1).contiguous()
    u = torch.tensor([0.0, 0.05, 0.15, 0.35, 0.59, 0.61, 0.999], dtype=torch.float64)
    assert inverse_cdf(scaled, u).tolist() == [0, 0, 1, 2, 2, 3, 3]


def test_inverse_cdf_across_blocks_skips_what_cannot_be_drawn():
    """Mass 1/4, 1/4, 1/2 at entries 5, 2100 and 2999 of 3000 (blocks 0 and 2 of 1024; block 1 holds only -inf):
    every other entry is -inf and is never drawn, whatever u."""
    scaled = torch.full((9, 3000), float("-inf"))
    scaled[:, [5, 2100, 2999]] = torch.tensor([0.25, 0.25, 0.5]).log()
    u = torch.tensor([0.0, 0.1, 0.2499, 0.2501, 0.3, 0.4999, 0.5001, 0.9, 1 - 2**-52], dtype=torch.float64)
    assert inverse_cdf(scaled, u).tolist() == [5, 5, 5, 2100, 2100, 2100, 2999, 2999, 2999]


def test_inverse_cdf_of_a_flat_row_is_the_entry_at_u_times_v():
    """Flat logits over Qwen's 151,936 entries: entry k holds [k / V, (k + 1) / V), so u at its centre draws k, at
    block edges too (all the sums are integers, exact in float32 and float64)."""
    vocab = 151936
    ks = torch.tensor([0, 1, 1023, 1024, 1025, 75000, 148479, 148480, vocab - 2, vocab - 1])
    u = (ks.double() + 0.5) / vocab
    assert torch.equal(inverse_cdf(torch.zeros(len(ks), vocab), u), ks)


def test_draws_follow_the_softmax():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    rows = 40000
    logits = probs.log()[None, :].expand(rows, -1).contiguous()
    keys = torch.arange(rows, dtype=torch.int64) * 2654435761 + 97
    tokens, lp = sample_tokens(logits, 1.0, keys=keys, step=0, kernel=False)
    freq = torch.bincount(tokens, minlength=5).float() / rows
    assert torch.allclose(freq, probs, atol=0.01), freq  # 4.5 standard errors at p = 0.5
    assert torch.allclose(lp, probs.log()[tokens], atol=1e-6)


def test_per_row_steps_draw_what_each_row_draws_alone():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    keys = torch.tensor([3, -7, 2**40 + 1, 0, 99, -(2**62)])
    steps = torch.tensor([0, 4, 4, 17, 1, 300])
    for top_k, top_p, temperature in ((-1, 1.0, 1.0), (5, 1.0, 0.7), (-1, 0.8, 1.3)):
        tok, lp = sample_tokens(logits, temperature, top_k, top_p, keys=keys, step=steps)
        for r in range(6):
            t1, l1 = sample_tokens(
                logits[r : r + 1], temperature, top_k, top_p, keys=keys[r : r + 1], step=int(steps[r])
            )
            assert tok[r] == t1[0] and lp[r] == l1[0]
    u = counter_uniform(keys, steps)
    for r in range(6):
        assert u[r] == counter_uniform(keys[r : r + 1], int(steps[r]))[0]
    assert torch.equal(row_keys(keys, steps)[2:3], row_keys(keys[2:3], 4))


def test_top_k_and_top_p_draw_only_what_they_keep():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).expand(3000, -1).contiguous()
    keys = torch.arange(3000, dtype=torch.int64)
    tok, _ = sample_tokens(logits, 1.0, top_k=2, keys=keys, step=1, kernel=False)
    assert set(tok.tolist()) == {0, 1}
    p = torch.softmax(logits[0], -1)  # 0.53, 0.20, 0.12, 0.07, 0.03: top-p 0.7 keeps the first two
    tok, _ = sample_tokens(logits, 1.0, top_p=0.7, keys=keys, step=1, kernel=False)
    assert set(tok.tolist()) == {0, 1}
    share = float((tok == 0).float().mean())
    assert abs(share - float(p[0] / (p[0] + p[1]))) < 0.03, share


def test_a_token_of_negligible_probability_is_never_drawn():
    """One token at +40 over 50,000 at 0: the others' total probability is 50,000 · e^-40 ≈ 2e-13."""
    rows, vocab = 2000, 50000
    logits = torch.zeros(rows, vocab)
    logits[:, 7] = 40.0
    keys = torch.arange(rows, dtype=torch.int64) * 1_000_003 + 11
    tok, lp = sample_tokens(logits, 1.0, keys=keys, step=0, kernel=False)
    assert torch.equal(tok, torch.full((rows,), 7))
    assert math.isfinite(float(lp.min()))
