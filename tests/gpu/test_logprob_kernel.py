"""The fused log-prob kernel against the torch path: values, entropy and gradients.

Runs on CUDA, or on CPU under Triton's interpreter with `TRITON_INTERPRET=1 HYBRIDRL_KERNELS_ON_CPU=1` (the tests
marked `interpreted`, with smaller vocabularies there: the interpreter is slow).
"""

from __future__ import annotations

import pytest
import torch

import tests.triton_interpret  # noqa: F401  (the interpreter's numpy fix, when it is on)
from hybridrl.engines.native.kernels import ON_CPU
from hybridrl.training import logprob_kernel
from hybridrl.training.logprobs import token_logprobs_and_entropy

pytestmark = pytest.mark.skipif(
    logprob_kernel.triton is None or not (torch.cuda.is_available() or ON_CPU),
    reason="the fused kernel needs Triton, and CUDA or the interpreter (HYBRIDRL_KERNELS_ON_CPU=1)",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "vocab,temperature,dtype", [(151936, 1.0, torch.bfloat16), (1001, 0.7, torch.bfloat16), (5003, 1.3, torch.float32)]
)
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_fused_equals_torch_path(vocab, temperature, dtype, entropy_grad):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(3, 40, vocab, device="cuda", generator=g) * 2).to(dtype)
    targets = torch.randint(0, vocab, (3, 40), device="cuda", generator=g)
    a = torch.randn(3, 40, device="cuda", generator=g)
    b = torch.randn(3, 40, device="cuda", generator=g)
    results = []
    for kernel in (True, False):
        x = logits.clone().requires_grad_()
        lp, ent = token_logprobs_and_entropy(x, targets, temperature, with_entropy=True, kernel=kernel)
        loss = (lp * a).sum() + ((ent * b).sum() if entropy_grad else 0)
        loss.backward()
        results.append((lp.detach(), ent.detach(), x.grad.float()))
    (lp1, ent1, g1), (lp0, ent0, g0) = results
    assert torch.allclose(lp1, lp0, atol=2e-5, rtol=1e-5), (lp1 - lp0).abs().max()
    assert torch.allclose(ent1, ent0, atol=2e-4, rtol=1e-4), (ent1 - ent0).abs().max()
    # Both round the float32 gradient to the logits' dtype once.
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert torch.allclose(g1, g0, atol=tol, rtol=1e-2), (g1 - g0).abs().max()


def test_no_grad_pass_and_without_entropy():
    logits = torch.randn(17, 3000, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, 3000, (17,), device="cuda")
    with torch.no_grad():
        lp, ent = token_logprobs_and_entropy(logits, targets, 1.0, with_entropy=False)
    assert ent is None
    ref = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None])[:, 0]
    assert torch.allclose(lp, ref, atol=2e-5)


@pytest.mark.interpreted
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_gradient_over_the_logits_equals_a_separate_one(entropy_grad):
    """`reuse_logits`: the backward writes d(logits) into a model output's own memory; the gradients that reach the
    model (here a linear head's input and weight) are those of a separate buffer, bit for bit."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    vocab, hidden, n = (151936, 64, 96) if DEVICE == "cuda" else (1000, 16, 12)
    h0 = torch.randn(n, hidden, device=DEVICE, generator=g)
    w0 = torch.randn(vocab, hidden, device=DEVICE, generator=g) / hidden**0.5
    targets = torch.randint(0, vocab, (n,), device=DEVICE, generator=g)
    a, b = torch.randn(2, n, device=DEVICE, generator=g)
    grads = []
    for reuse in (False, True):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        logits = h @ w.T  # [n, V], an intermediate like a model's head output
        if not reuse:
            logits.retain_grad()
        lp, ent = token_logprobs_and_entropy(logits, targets, 0.8, with_entropy=True, reuse_logits=reuse)
        ((lp * a).sum() + ((ent * b).sum() if entropy_grad else 0)).backward()
        grads.append((lp.detach(), h.grad, w.grad, logits.grad if not reuse else logits.detach()))
    for before, after in zip(*grads):
        assert torch.equal(before, after)  # the last pair: the logits now hold their own gradient


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device memory")
def test_gradient_over_the_logits_holds_one_buffer_fewer():
    n, vocab, hidden = 2048, 151936, 256
    h0 = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), device="cuda")
    peaks = []
    for reuse in (False, True):
        h = h0.clone().requires_grad_()
        lp, _ = token_logprobs_and_entropy(h @ w.T, targets, 1.0, with_entropy=False, reuse_logits=reuse)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        lp.sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        w.grad = None
    # A separate gradient adds a [n, V] buffer beside the logits; over them, the backward's peak is the head's
    # own gradients (w's, allocated once the logits are gone either way). On an H100: 623 MB against 79 MB.
    one_buffer = n * vocab * 2
    assert peaks[0] >= one_buffer and peaks[1] <= peaks[0] - 0.8 * one_buffer, (peaks, one_buffer)
