"""RMSNorm fused with its neighbours: the residual add before it, and SiLU(gate)·up of the MLP.

In a decode step each layer ends two residual branches with ``x = x + branch; h = norm(x)``; the kernel reads x and
the branch once and writes both the new residual and the normed input of the next block. Roundings follow
transformers in the weight dtype: the sum is rounded, the norm is computed in float32 and rounded, then scaled by the
weight and rounded again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridrl.engines.native.kernels import HAS_TRITON, pdl, use_triton
from hybridrl.engines.native.kernels.linear import summed

if HAS_TRITON:
    import triton
    import triton.language as tl

    from hybridrl.engines.native.kernels.pdl import await_inputs


# -- torch (reference and CPU path) ------------------------------------------------------------------------------
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalize in float32, round to x's dtype, then scale in that dtype.
    F.rms_norm computes in float32 and rounds once, the same steps."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def add_rms_norm_torch(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual stream and the next block's normed input. delta may be a
    projection's float32 partials [S, N, H] (`linear.project`)."""
    s = x + summed(delta, x.dtype)
    return s, rms_norm_torch(s, weight, eps)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up of a fused [N, 2I] gate_up projection (gate first), as transformers' MLP computes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# -- Triton ------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr,
        d_ptr,
        w_ptr,
        res_ptr,
        out_ptr,
        hidden,
        eps,
        parts,
        part_stride,
        HAS_DELTA: tl.constexpr,
        PARTS: tl.constexpr,
        SP: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < hidden
        x = tl.load(x_ptr + row * hidden + cols, mask=inside, other=0.0)
        if HAS_DELTA:
            if PARTS:  # a projection's float32 partials, all in one load: summed, then rounded as its epilogue would
                s = tl.arange(0, SP)
                d = tl.load(
                    d_ptr + s[:, None] * part_stride + row * hidden + cols[None, :],
                    mask=(s < parts)[:, None] & inside[None, :],
                    other=0.0,
                )
                d = tl.sum(d, axis=0).to(res_ptr.dtype.element_ty)
            else:
                d = tl.load(d_ptr + row * hidden + cols, mask=inside, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + row * hidden + cols, x, mask=inside)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / hidden
        normed = (xf * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * hidden + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
        await_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < inter
        g = tl.load(gu_ptr + row * 2 * inter + cols, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=inside, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * inter + cols, (act * u).to(out_ptr.dtype.element_ty), mask=inside)


def norm_warps(block: int, partials: bool) -> int:
    """Warps per row of `_add_rms_norm_kernel` over a row of `block` (a power of two) columns. A delta in the activation
    dtype: 4. Float32 partials: one warp per 128 columns, at most 16 (16 at the 1.5B's 1536 → 2048, 8 at the 0.5B's 896
    → 1024). On the H200 (1..16 warps per shape) that was the best at each of the four partials shapes measured: 1536
    wide, 4 partials × 256 rows 2.89 → 2.72 µs and 8 × 64 rows 2.93 → 2.30 against 8 warps; 896 wide, 8 warps stay (16
    took 3.49 and 2.70 µs against 2.16 and 2.12). A bf16 delta: 4 warps were within 0.06 µs of the best everywhere."""
    return min(16, max(1, block // 128)) if partials else 4


def add_rms_norm_triton(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, warps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton form of `add_rms_norm_torch` over rows of x [N, H]; with delta None, a plain RMSNorm
    (the first element is then x itself). `warps` per row: by default `norm_warps`."""
    x = x.contiguous()
    n, hidden = x.shape
    out = torch.empty_like(x)
    res = torch.empty_like(x) if delta is not None else x
    d = delta.contiguous() if delta is not None else x
    parts = d.shape[0] if d.dim() == 3 else 1
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(n,)](
        x,
        d,
        weight,
        res,
        out,
        hidden,
        eps,
        parts,
        n * hidden,
        HAS_DELTA=delta is not None,
        PARTS=d.dim() == 3,
        SP=triton.next_power_of_2(parts),
        BLOCK=block,
        num_warps=warps or norm_warps(block, parts > 1),
        **pdl.launch(x),
    )
    return res, out


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """The Triton form of `silu_mul_torch`."""
    gate_up = gate_up.contiguous()
    n, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, **pdl.launch(gate_up))
    return out


# -- dispatch ----------------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: bool = True) -> torch.Tensor:
    """RMSNorm of rows of x [N, H] (Triton on CUDA when `kernels`)."""
    if use_triton(x, kernels) and x.dim() == 2:
        return add_rms_norm_triton(x, None, weight, eps)[1]
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, kernels: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) of rows [N, H] (one Triton kernel on CUDA when `kernels`); delta [N, H] or
    a projection's float32 partials [S, N, H]."""
    if use_triton(x, kernels) and x.dim() == 2:
        return add_rms_norm_triton(x, delta, weight, eps)
    return add_rms_norm_torch(x, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor, kernels: bool = True) -> torch.Tensor:
    """SiLU(gate) · up of a fused [N, 2I] projection (one Triton kernel on CUDA when `kernels`)."""
    if use_triton(gate_up, kernels) and gate_up.dim() == 2:
        return silu_mul_triton(gate_up)
    return silu_mul_torch(gate_up)
