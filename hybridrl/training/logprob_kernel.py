"""Token log-probs (and entropy) from logits in one fused pass each way (Triton, GPU).

The torch path upcasts the [tokens, vocab] logits to float32, runs logsumexp (which keeps that float32
copy for its backward), and builds the gradient from several [tokens, vocab] float32 temporaries: at
8 × 1024 tokens of a 152k vocabulary that was ~12% of a 1.5B update on the H200. Here the forward reads
the logits once (online max / sum per row, plus Σ p·x for the entropy) and keeps only the logits
themselves and three floats per row; the backward reads them once and writes d(logits) in their dtype, into the
logits' own memory when the caller lets it (`reuse_logits`: the logits are dead once their gradient exists, so the
update holds one [tokens, vocab] buffer instead of two):

    d logp / d x_j = onehot_j − p_j          d H / d x_j = −p_j (x_j − E_p[x])      (x = logits / T)

Numerics follow `token_logprobs_and_entropy`: float32 math on the stored logits.
"""

from __future__ import annotations

import torch

from hybridrl.engines.native.kernels import ON_CPU

try:  # Triton ships with CUDA builds of torch; CPU wheels have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

_BLOCK = 4096


def available(logits: torch.Tensor) -> bool:
    """Whether the fused kernels can take these logits (CUDA, or CPU under the tests' interpreter; Triton
    importable)."""
    return triton is not None and (logits.is_cuda or ON_CPU)


if triton is not None:

    @triton.jit
    def _forward_kernel(
        logits_ptr, stride, targets_ptr, vocab, temperature, logp_ptr, lse_ptr, ent_ptr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        run_max = tl.full([BLOCK], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK], tl.float32)  # Σ exp(x - run_max) per lane
        run_dot = tl.zeros([BLOCK], tl.float32)  # Σ exp(x - run_max) · x per lane
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < vocab
            x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32) / temperature
            new_max = tl.maximum(run_max, x)
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            scale = tl.exp(run_max - safe)
            e = tl.exp(x - safe)
            run_sum = run_sum * scale + e
            run_dot = run_dot * scale + tl.where(inside, e * x, 0.0)
            run_max = new_max
        m = tl.max(run_max, axis=0)
        w = tl.exp(run_max - m)
        total = tl.sum(run_sum * w, axis=0)
        dot = tl.sum(run_dot * w, axis=0)
        lse = m + tl.log(total)
        target = tl.load(targets_ptr + row)
        xt = tl.load(base + target).to(tl.float32) / temperature
        tl.store(logp_ptr + row, xt - lse)
        tl.store(lse_ptr + row, lse)
        tl.store(ent_ptr + row, lse - dot / total)

    @triton.jit
    def _backward_kernel(
        logits_ptr,
        stride,
        grad_ptr,
        grad_stride,
        targets_ptr,
        vocab,
        temperature,
        lse_ptr,
        ent_ptr,
        g_logp_ptr,
        g_ent_ptr,
        HAS_ENT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        out = grad_ptr + row * grad_stride
        lse = tl.load(lse_ptr + row)
        g = tl.load(g_logp_ptr + row)
        target = tl.load(targets_ptr + row)
        if HAS_ENT:
            ge = tl.load(g_ent_ptr + row)
            mean_x = lse - tl.load(ent_ptr + row)  # E_p[x] = lse − H
        # Each block is read before it is written and never read again, so `out` may be the logits themselves.
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < vocab
            x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32) / temperature
            p = tl.exp(x - lse)
            d = tl.where(cols == target, g, 0.0) - p * g
            if HAS_ENT:
                d = d - ge * p * (x - mean_x)
            tl.store(out + cols, (d / temperature).to(out.dtype.element_ty), mask=inside)


def forward_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-prob, log-sum-exp, entropy) [N] float32 of `targets` [N] under softmax(logits [N, V] / temperature), in
    one read of `logits` (rows contiguous)."""
    n, vocab = logits.shape
    stats = torch.empty(3, n, dtype=torch.float32, device=logits.device)
    if n:
        _forward_kernel[(n,)](
            logits,
            logits.stride(0),
            targets,
            vocab,
            float(temperature),
            stats[0],
            stats[1],
            stats[2],
            BLOCK=_BLOCK,
            num_warps=8,
        )
    return stats[0], stats[1], stats[2]


def backward_into(
    logits: torch.Tensor,
    out: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    lse: torch.Tensor,
    ent: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_ent: torch.Tensor | None,
) -> torch.Tensor:
    """d(loss)/d(logits) into `out` [N, V] (which may be `logits` itself), given d(loss)/d(log-prob) and
    d(loss)/d(entropy) [N] (None: zero) and `forward_stats`' lse and entropy; returns `out`."""
    n, vocab = logits.shape
    g_logp = (grad_logp if grad_logp is not None else torch.zeros_like(lse)).float().contiguous()
    has_ent = grad_ent is not None
    g_ent = grad_ent.float().contiguous() if has_ent else g_logp
    if n:
        _backward_kernel[(n,)](
            logits,
            logits.stride(0),
            out,
            out.stride(0),
            targets,
            vocab,
            float(temperature),
            lse,
            ent,
            g_logp,
            g_ent,
            HAS_ENT=has_ent,
            BLOCK=_BLOCK,
            num_warps=8,
        )
    return out


class FusedTokenLogprobs(torch.autograd.Function):
    """(log-prob [N], entropy [N]) of `targets` [N] under softmax(logits [N, V] / temperature). With
    `reuse_logits`, the backward writes d(logits) over the logits: only for logits nothing else reads afterwards
    (a model's output, its graph not retained), never a caller's leaf tensor."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, reuse_logits: bool = False):
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        targets = targets.contiguous()
        logp, lse, ent = forward_stats(logits, targets, temperature)
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.temperature = float(temperature)
        ctx.reuse_logits = reuse_logits
        ctx.set_materialize_grads(False)  # an unused entropy gets no gradient pass
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_ent: torch.Tensor):
        logits, targets, lse, ent = ctx.saved_tensors
        out = logits if ctx.reuse_logits else torch.empty_like(logits)
        return backward_into(logits, out, targets, ctx.temperature, lse, ent, grad_logp, grad_ent), None, None, None


def fused_token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, reuse_logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(logits / T)[target] and the entropy per position, for logits [..., V] and targets [...];
    `reuse_logits` as `FusedTokenLogprobs` says."""
    shape = targets.shape
    flat = logits.reshape(-1, logits.shape[-1])
    lp, ent = FusedTokenLogprobs.apply(flat, targets.reshape(-1), temperature, reuse_logits)
    return lp.view(shape), ent.view(shape)
