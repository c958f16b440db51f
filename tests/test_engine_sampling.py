"""Counter-based sampling with one step index per row (rows of a continuous batch are at different steps) draws
exactly what the one-index form draws for each row alone."""

from __future__ import annotations

import torch

from hybridrl.engines.sampling import _mix_int, counter_exponential, sample_tokens, step_key, step_keys

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
