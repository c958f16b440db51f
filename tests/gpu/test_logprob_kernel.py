"""The fused log-prob kernel (GPU only) against the torch path: values, entropy and gradients."""

from __future__ import annotations

import pytest
import torch

from hybridrl.training import logprob_kernel
from hybridrl.training.logprobs import token_logprobs_and_entropy

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or logprob_kernel.triton is None, reason="the fused kernel needs CUDA and Triton"
)


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
