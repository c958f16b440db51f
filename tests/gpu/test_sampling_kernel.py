"""The fused Triton sampler against the torch path it replaces: same uniform, same inverse CDF, same draws.

Runs on CUDA, or on CPU under Triton's interpreter with `TRITON_INTERPRET=1 HYBRIDRL_KERNELS_ON_CPU=1` (smaller
batches there: the interpreter is slow).
"""

from __future__ import annotations

import math

import pytest
import torch

import tests.triton_interpret  # noqa: F401  (the interpreter's numpy fix, when it is on)
from hybridrl.engines.native.kernels import ON_CPU
from hybridrl.engines.native.kernels import sampling as sampling_kernel
from hybridrl.engines.sampling import counter_uniform, row_keys, sample_tokens, step_key

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.skipif(
        sampling_kernel.triton is None or not (torch.cuda.is_available() or ON_CPU),
        reason="the fused sampler needs Triton, and CUDA or the interpreter (HYBRIDRL_KERNELS_ON_CPU=1)",
    ),
    pytest.mark.interpreted,  # every test: the sampler's own checks are the kernel path
]
ROWS, STEPS = (64, 10) if DEVICE == "cuda" else (6, 2)


def keys_for(rows: int) -> torch.Tensor:
    return (torch.arange(rows, device=DEVICE, dtype=torch.int64) * 2654435761 + 97) ^ 0x5DEECE66D


@pytest.mark.parametrize("vocab,temperature", [(151936, 1.0), (32003, 0.7), (1000, 1.5)])
def test_kernel_draws_what_the_torch_path_draws(vocab, temperature):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    padded = torch.randn(ROWS, vocab + 61, device=DEVICE, generator=g).to(torch.bfloat16) * 3
    logits = padded[:, :vocab]  # a strided view, as the engine passes it (padded vocab rows)
    keys = keys_for(ROWS)
    same, total = 0, 0
    for step in range(STEPS):
        tk, lk = sample_tokens(logits, temperature, keys=keys, step=step)
        tt, lt = sample_tokens(logits, temperature, keys=keys, step=step, kernel=False)
        same += int((tk == tt).sum())
        total += tk.numel()
        agree = tk == tt
        assert torch.allclose(lk[agree], lt[agree], atol=1e-4), (lk - lt).abs().max()
        assert tk.dtype == torch.int64 and lk.dtype == torch.float32
        assert int(tk.max()) < vocab
    # The two sum in different orders; a different draw needs u within float rounding of an interval's end.
    assert same / total >= 0.995, same / total


def test_launch_tuning_leaves_the_draws_unchanged():
    """Segments per row and blocks per step only split the work: each block's max and sum are the same numbers however
    the row is cut, so the same tokens; the log-probs equal the torch path's to rounding."""
    g = torch.Generator(device=DEVICE).manual_seed(3)
    logits = torch.randn(ROWS, 5003, device=DEVICE, generator=g) * 2
    keys = keys_for(ROWS)
    ref_tok, _ = sampling_kernel.sample_counter(logits, 0.8, keys, step_key(4), segments=1, sub=1)
    torch_tok, torch_lp = sample_tokens(logits, 0.8, keys=keys, step=4, kernel=False)
    assert torch.equal(ref_tok, torch_tok)  # no u near an interval's end among these rows
    for segments, sub in [(8, 1), (2, 2), (4, 4)]:
        tok, lp = sampling_kernel.sample_counter(logits, 0.8, keys, step_key(4), segments=segments, sub=sub)
        assert torch.equal(tok, ref_tok), (segments, sub)
        assert torch.allclose(lp, torch_lp, atol=1e-5), (segments, sub)


def test_kernel_draws_the_entry_at_its_uniform_times_v_from_a_flat_row():
    """Flat logits over 4096 entries (four blocks): entry k holds [k / V, (k + 1) / V), so the kernel's draw is
    floor(u · V) for u = `counter_uniform` of the row's key and step: the kernel's uniform is the torch path's."""
    rows, vocab = 16, 4096
    keys = keys_for(rows)
    tok, lp = sampling_kernel.sample_counter(torch.zeros(rows, vocab, device=DEVICE), 1.0, keys, step_key(7))
    want = (counter_uniform(keys, 7) * vocab).floor().long()
    assert torch.equal(tok, want)
    assert torch.allclose(lp, torch.full_like(lp, -math.log(vocab)), atol=1e-6)


def test_kernel_never_draws_what_is_minus_infinity():
    """Mass 1/4, 1/4, 1/2 at entries 5, 2100 and 2999 of 3000 (block 1 holds only -inf); the rest -inf."""
    rows = 64 if DEVICE == "cuda" else 12
    logits = torch.full((rows, 3000), float("-inf"), device=DEVICE)
    logits[:, [5, 2100, 2999]] = torch.tensor([0.25, 0.25, 0.5], device=DEVICE).log()
    keys = keys_for(rows)
    tok, lp = sampling_kernel.sample_counter(logits, 1.0, keys, step_key(0))
    assert set(tok.tolist()) <= {5, 2100, 2999} and len(set(tok.tolist())) == 3
    assert torch.equal(tok, sample_tokens(logits, 1.0, keys=keys, step=0, kernel=False)[0])
    assert torch.allclose(lp, logits[torch.arange(rows), tok], atol=1e-6)


@pytest.mark.skipif(DEVICE != "cuda", reason="40,000 rows: too slow for the interpreter")
def test_kernel_draws_follow_the_softmax():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], device="cuda")
    rows = 40000
    logits = probs.log()[None, :].expand(rows, -1).contiguous()
    tokens, lp = sample_tokens(logits, 1.0, keys=keys_for(rows), step=0)
    freq = torch.bincount(tokens, minlength=5).float() / rows
    assert torch.allclose(freq, probs, atol=0.01), freq
    assert torch.allclose(lp, probs.log()[tokens], atol=1e-5)


def test_a_row_draws_the_same_alone_or_in_a_batch():
    g = torch.Generator(device=DEVICE).manual_seed(1)
    logits = torch.randn(48, 5000, device=DEVICE, generator=g)
    keys = keys_for(48)
    full, _ = sample_tokens(logits, 1.0, keys=keys, step=5)
    part, _ = sample_tokens(logits[7:19], 1.0, keys=keys[7:19], step=5)
    assert torch.equal(full[7:19], part)


def test_kernel_takes_one_step_per_row():
    """Rows of a continuous batch are at different steps: the kernel's per-row draw equals each row's own."""
    g = torch.Generator(device=DEVICE).manual_seed(2)
    logits = torch.randn(16, 7000, device=DEVICE, generator=g)
    keys = keys_for(16)
    steps = torch.arange(16, device=DEVICE, dtype=torch.int64) * 37 % 11
    tok, lp = sample_tokens(logits, 0.9, keys=keys, step=steps)
    # The kernel makes each row's step key itself: the same draws as from keys the torch code made (`row_keys`).
    assert torch.equal(tok, sampling_kernel.sample_counter(logits, 0.9, row_keys(keys, steps), 0)[0])
    for r in range(16):
        t1, l1 = sample_tokens(logits[r : r + 1], 0.9, keys=keys[r : r + 1], step=int(steps[r]))
        assert tok[r] == t1[0] and torch.allclose(lp[r], l1[0])
