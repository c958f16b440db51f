"""Skinny GEMMs of a decode step: y = x Wᵀ (+ b) for few rows (a decode batch) and a weight [N, K].

At decode batch sizes a projection reads its whole weight for a few dozen rows, so its time is the weight read plus
latency: the launch, and each program's serial walk over K. cuBLAS picks tall tiles and, for long K, a split-K with a
separate reduce kernel. Here one program owns a [rows, BLOCK_N] tile of the output and a share of K (`splits`
shares); with one split it writes the output in the weight dtype, with several it writes float32 partials
[splits, rows, N] that the consuming kernel sums (`rope_write` after qkv, `add_rms_norm` after o_proj and
down_proj), so no reduce kernel runs and the sum order is fixed (deterministic, unlike atomics).

At more rows a long-K product is compute, and cuBLAS beats Triton's tiles; there cuBLAS's own split-K for a narrow
output (down_proj) ends in a separate reduce kernel. `project` then runs the same split as one batched cuBLAS GEMM over
K slices (`torch.bmm` with float32 output) and hands its [splits, rows, N] partials to the same consumers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from hybridrl.engines.native.kernels import HAS_TRITON, pdl, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from hybridrl.engines.native.kernels.pdl import await_inputs


if HAS_TRITON:

    @triton.jit
    def _linear_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        m,
        n,
        k,
        k_per_split,
        HAS_BIAS: tl.constexpr,
        PARTIAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr,
        IEEE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        pid_m = tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_in = rows < m
        col_in = cols < n
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * k
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * k
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        start = split * k_per_split
        stop = tl.minimum(start + k_per_split, k)
        for k0 in tl.range(start, stop, BLOCK_K, num_stages=STAGES):
            kk = k0 + ks
            k_in = kk < stop
            a = tl.load(x_rows + kk[None, :], mask=row_in[:, None] & k_in[None, :], other=0.0)
            b = tl.load(w_rows + kk[None, :], mask=col_in[:, None] & k_in[None, :], other=0.0)
            if IEEE:  # float32 weights: a true float32 product, not TF32
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        if HAS_BIAS:
            if split == 0:
                acc += tl.load(b_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
        out_mask = row_in[:, None] & col_in[None, :]
        offs = rows.to(tl.int64)[:, None] * n + cols[None, :]
        if PARTIAL:
            tl.store(out_ptr + split.to(tl.int64) * m * n + offs, acc, mask=out_mask)
        else:
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    splits: int = 1,
    block_n: int = 32,
    block_k: int = 128,
    block_m: int = 64,
    stages: int = 3,
    warps: int = 4,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]ᵀ (+ bias): [M, N] in x's dtype with one split, else float32 partials
    [splits, M, N] whose sum is the product (the bias is in split 0)."""
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    # Each split's share of K is a whole number of BLOCK_K steps.
    per = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, per)
    block_m = max(16, min(block_m, triton.next_power_of_2(m)))
    if splits == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), splits, triton.cdiv(m, block_m))
    _linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        per,
        HAS_BIAS=bias is not None,
        PARTIAL=splits > 1,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        STAGES=stages,
        IEEE=x.dtype == torch.float32,
        num_warps=warps,
        **pdl.launch(x),
    )
    return out


class SkinnyPlan(NamedTuple):
    """A launch of the skinny kernel: K splits, and the tile's width along N and its step along K."""

    splits: int
    block_n: int
    block_k: int


# Where the skinny kernel beats cuBLAS on the H200 (`python -m benchmarks.kernels`): up to 64 rows and outputs up to
# 2048 wide (the 0.5B's qkv, o_proj and down_proj at batch 64: 3.9/3.7/7.2 µs → 2.9/2.6/4.3). Wide outputs (gate_up)
# and 256 rows run as fast or faster in cuBLAS.
SKINNY_MAX_ROWS = 64
SKINNY_MAX_WIDTH = 2048


def skinny_plan(m: int, n: int, k: int, sms: int) -> SkinnyPlan | None:
    """The launch for x [m, k] @ W[n, k]ᵀ on a GPU with `sms` SMs, or None where cuBLAS is the better choice.

    About one program per SM: tiles of 64 output columns (32 for narrow, short products), and the power-of-two
    number of K splits (≤ 8) that brings tiles × splits nearest to the SM count, so each program walks a short
    stretch of K."""
    if not 0 < m <= SKINNY_MAX_ROWS or n > SKINNY_MAX_WIDTH or sms <= 0:
        return None
    block_n = 32 if n < 1024 and k < 2048 else 64
    tiles = -(-n // block_n)
    want = max(1.0, sms / tiles)
    splits = min(min((1, 2, 4, 8), key=lambda s: abs(s - want)), max(1, k // 64))
    block_k = 128 if k // splits >= 512 else 64
    return SkinnyPlan(splits, block_n, block_k)


# Where the batched cuBLAS split beats F.linear on the H200 (`python -m benchmarks.kernels --what batched`; each with
# the add_rms_norm that consumes it): down_proj of the 1.5B
# at 256 rows 20.1 → 15.3 µs (128 rows: 11.6 → 10.2), of the 0.5B at 256 rows 11.3 → 8.4 (128: 9.9 → 7.4), all with
# 4 slices (2 and 8 were slower). At K 1536 (the 1.5B's o_proj) the best split gained ≤ 0.35 µs, and a wide output
# (gate_up) lost outright (32 µs against 22.6), so neither takes it.
BATCHED_SPLITS = 4
BATCHED_MIN_K = 4096
# Measured at 128 and 256 rows only. Past a decode batch (a packed prefill's thousands of tokens) the product is
# compute-bound, cuBLAS does not split it, and the partials would only add traffic.
BATCHED_MAX_ROWS = 256


def batched_splits(m: int, n: int, k: int) -> int:
    """K slices for x [m, k] @ W[n, k]ᵀ as one batched cuBLAS GEMM with float32 partials, or 0 where F.linear is the
    better choice: a decode batch larger than the skinny kernel takes, a narrow output, a long K that splits into
    16-byte-aligned slices."""
    if (
        not SKINNY_MAX_ROWS < m <= BATCHED_MAX_ROWS
        or n > SKINNY_MAX_WIDTH
        or k < BATCHED_MIN_K
        or k % (BATCHED_SPLITS * 8)
    ):
        return 0
    return BATCHED_SPLITS


_FLOAT_OUT: dict[str, bool] = {}


def bmm_float_out(device: torch.device) -> bool:
    """Whether `torch.bmm(..., out_dtype=torch.float32)` runs on half inputs on this device type (newer torch, CUDA;
    older torch has no `out_dtype`, the CPU no kernel for it). Probed once per device type, on tiny tensors."""
    kind = torch.device(device).type
    if kind not in _FLOAT_OUT:
        a = torch.zeros(1, 1, 8, dtype=torch.bfloat16, device=device)
        try:
            torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32)
            _FLOAT_OUT[kind] = True
        except (TypeError, RuntimeError):  # no such argument, or no kernel for it (NotImplementedError)
            _FLOAT_OUT[kind] = False
    return _FLOAT_OUT[kind]


def linear_batched(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """Float32 partials [splits, M, N] of x [M, K] @ weight[N, K]ᵀ (no bias; CUDA): slice s is the product over
    K columns [s·K/splits, (s+1)·K/splits), all slices in one batched cuBLAS GEMM that reads x and the weight in
    place."""
    m, k = x.shape
    n = weight.shape[0]
    kc = k // splits
    a = x.as_strided((splits, m, kc), (kc, x.stride(0), 1))
    b = weight.as_strided((splits, n, kc), (kc, weight.stride(0), 1)).transpose(1, 2)
    return torch.bmm(a, b, out_dtype=torch.float32)


def project(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sms: int, kernels: bool = True
) -> torch.Tensor:
    """x Wᵀ (+ b) for a decode step: float32 partials [S, M, N] from the skinny kernel where its plan beats cuBLAS
    (Triton, few rows, a narrow weight) or from a batched cuBLAS split (more rows, a long K), else F.linear's
    [M, N]. Hand the result to a consumer that takes partials (`rope_write`, `add_rms_norm`), or to `summed`.
    `sms` 0 turns both off (every projection in F.linear)."""
    # Both read the weight as dense rows [N, K].
    if not (use_triton(x, kernels) and sms > 0 and weight.is_contiguous() and (bias is None or bias.is_contiguous())):
        return F.linear(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    plan = skinny_plan(m, n, k, sms)
    if plan is not None:
        return linear_triton(x, weight, bias, splits=plan.splits, block_n=plan.block_n, block_k=plan.block_k)
    # The batched split: CUDA (cuBLAS), half-precision inputs as measured, no bias, x's columns dense, and a torch
    # whose bmm writes float32.
    if (
        x.is_cuda
        and bias is None
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(-1) == 1
        and (splits := batched_splits(m, n, k))
        and bmm_float_out(x.device)
    ):
        return linear_batched(x, weight, splits)
    return F.linear(x, weight, bias)


def summed(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A projection's output [M, N] in `dtype`: its float32 partials summed (then rounded once, as a GEMM's epilogue
    rounds), or itself."""
    return y.sum(0).to(dtype) if y.dim() == 3 else y
