"""The fused Triton sampler against the torch path it replaces: same noise, same draws.

Runs on CUDA, or on CPU under Triton's interpreter with `TRITON_INTERPRET=1 HYBRIDRL_KERNELS_ON_CPU=1` (smaller
batches there: the interpreter is slow).
"""

from __future__ import annotations

import pytest
import torch

import tests.triton_interpret  # noqa: F401  (the interpreter's numpy fix, when it is on)
from hybridrl.engines import sampling_triton
from hybridrl.engines.kernels import ON_CPU
from hybridrl.engines.sampling import row_keys, sample_tokens, step_key

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.skipif(sampling_triton.triton is None or not (torch.cuda.is_available() or ON_CPU),
                       reason="the fused sampler needs Triton, and CUDA or the interpreter (HYBRIDRL_KERNELS_ON_CPU=1)"),
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
    # Float rounding (log, exp) may differ in the last bit between the two; a different draw needs a near-tie.
    assert same / total >= 0.995, same / total


def test_launch_tuning_leaves_the_draws_unchanged():
    """Segments per row and entries per step only split the work: each entry's score is the same number however the
    row is cut, so the same tokens; the log-probs equal the torch path's to rounding."""
    g = torch.Generator(device=DEVICE).manual_seed(3)
    logits = torch.randn(ROWS, 5003, device=DEVICE, generator=g) * 2
    keys = keys_for(ROWS)
    ref_tok, _ = sampling_triton.sample_counter(logits, 0.8, keys, step_key(4), segments=1, block=1024)
    torch_tok, torch_lp = sample_tokens(logits, 0.8, keys=keys, step=4, kernel=False)
    assert torch.equal(ref_tok, torch_tok)  # no near-tie among these rows' best scores
    for segments, block in [(8, 1024), (16, 256), (32, 2048)]:
        tok, lp = sampling_triton.sample_counter(logits, 0.8, keys, step_key(4), segments=segments, block=block)
        assert torch.equal(tok, ref_tok), (segments, block)
        assert torch.allclose(lp, torch_lp, atol=1e-5), (segments, block)


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
    assert torch.equal(tok, sampling_triton.sample_counter(logits, 0.9, row_keys(keys, steps), 0)[0])
    for r in range(16):
        t1, l1 = sample_tokens(logits[r : r + 1], 0.9, keys=keys[r : r + 1], step=int(steps[r]))
        assert tok[r] == t1[0] and torch.allclose(lp[r], l1[0])


if sampling_triton.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _noise_kernel(h_ptr, out_ptr, n, FAST: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        h = tl.load(h_ptr + i, mask=i < n, other=0)
        tl.store(out_ptr + i, sampling_triton._exponential(h, FAST), mask=i < n)


def test_kernel_noise_is_exp_of_the_exact_uniform_at_both_ends():
    """The kernel's Exp(1) from the top 24 bits k of a hash (made without an integer-to-float conversion) against
    -log(u), u = (k + 0.5) / 2^24, in float64: at k = 0, 1, around 2^23 and at the top values, and at random k, with
    random low bits under them that must not matter. Within 4e-6 relative (the approximate log on CUDA; float32
    rounding of 1 - w); at the top k, where the old noise gave E = 0, E is about 2^-25."""
    g = torch.Generator().manual_seed(3)
    ks = torch.cat([torch.tensor([0, 1, 2, (1 << 23) - 2, (1 << 23) - 1, 1 << 23, (1 << 23) + 1, (1 << 24) - 2 ** 18,
                                  (1 << 24) - 3, (1 << 24) - 2, (1 << 24) - 1]),
                    torch.randint(0, 1 << 24, (4000,), generator=g)]).to(torch.int64)
    low = torch.randint(0, 1 << 40, ks.shape, generator=g, dtype=torch.int64)
    h = ((ks - ((ks >> 23) << 24)) << 40) | low  # k in bits 40..63 of an int64 (two's complement: top bit = sign)
    assert torch.equal((h >> 40) & 0xFFFFFF, ks)
    out = torch.empty(len(ks), dtype=torch.float32, device=DEVICE)
    _noise_kernel[(triton.cdiv(len(ks), 256),)](h.to(DEVICE), out, len(ks), FAST=sampling_triton.fast_log(out.device),
                                              BLOCK=256)
    want = -torch.log((ks.double() + 0.5) / 2**24)
    rel = ((out.double().cpu() - want) / want).abs()
    assert rel.max().item() < 4e-6, (rel.max().item(), ks[rel.argmax()].item())
    assert 2.9e-8 < out[10].item() < 3.0e-8  # k = 2^24 - 1: -log(1 - 2^-25)
