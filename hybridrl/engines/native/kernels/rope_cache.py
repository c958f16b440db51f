"""The attention input of a decode step in one pass: split the fused qkv projection, [q/k RMSNorm (Qwen3)], RoPE on
q and k, and the write of k and v into the paged KV cache.

Tokens are addressed in the cache by their slot, ``block * block_size + offset``; the cache of one layer is
[blocks, kv_heads, block_size, head_dim]. RoPE is transformers' ``x·cos + rotate_half(x)·sin`` with the sine table
stored signed (``[-sin_lo, sin_hi]``), so ``rotate_half(x)·sin = swap_halves(x)·sin_signed`` exactly; the Triton
kernel rounds each product and the sum to the weight dtype, as the torch ops do.
"""

from __future__ import annotations

import torch

from hybridrl.engines.native.kernels import HAS_TRITON, pdl, use_triton
from hybridrl.engines.native.kernels.linear import summed
from hybridrl.engines.native.kernels.norms import rms_norm_torch

if HAS_TRITON:
    import triton
    import triton.language as tl

    from hybridrl.engines.native.kernels.pdl import await_inputs


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin over the last dim (x [N, heads, d], tables [N, 1, d])."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin_signed


def split_qkv_torch(
    qkv: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, q_heads, d], k and v [N, kv_heads, d] of a fused projection qkv [N, (q + 2 kv) · d], with the optional
    per-head q/k RMSNorm and RoPE applied (tables cos/sin [N, 1, d] at each token's position)."""
    n = qkv.shape[0]
    d = cos.shape[-1]
    qkv = qkv.view(n, q_heads + 2 * kv_heads, d)
    qk, v = qkv[:, : q_heads + kv_heads], qkv[:, q_heads + kv_heads :]
    if q_norm is not None:
        qk = torch.cat(
            (rms_norm_torch(qk[:, :q_heads], q_norm, eps), rms_norm_torch(qk[:, q_heads:], k_norm, eps)), dim=1
        )
    qk = rope_torch(qk, cos, sin)  # q and k heads together: one RoPE pass
    return qk[:, :q_heads], qk[:, q_heads:], v


def write_kv_torch(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store k, v [N, kv_heads, d] at `slots` [N] of one layer's cache [blocks, kv_heads, block_size, d]."""
    bs = k_cache.shape[2]
    block, offset = slots // bs, slots % bs
    k_cache[block, :, offset] = k
    v_cache[block, :, offset] = v


def rope_write_torch(
    qkv: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    pos: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """Rotated q [N, q_heads, d] of qkv [N, (q + 2 kv) · d] (or its float32 partials [S, N, (q + 2 kv) · d]) at
    positions `pos`; k (rotated) and v go to the cache."""
    q, k, v = split_qkv_torch(
        summed(qkv, k_cache.dtype),
        q_heads,
        kv_heads,
        cos_table[pos][:, None],
        sin_table[pos][:, None],
        q_norm,
        k_norm,
        eps,
    )
    write_kv_torch(k_cache, v_cache, slots, k, v)
    return q


if HAS_TRITON:

    @triton.jit
    def _rope_write_kernel(
        qkv_ptr,
        q_ptr,
        kc_ptr,
        vc_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        slot_ptr,
        qn_ptr,
        kn_ptr,
        eps,
        q_heads,
        kv_heads,
        stride_blk,
        stride_head,
        parts,
        part_stride,
        BS: tl.constexpr,
        D: tl.constexpr,
        HALF: tl.constexpr,
        QK_NORM: tl.constexpr,
        PARTS: tl.constexpr,
        SP: tl.constexpr,
        HEADS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # One program: token `tok`, heads [first, first + HEADS) of its q, k and v heads (in qkv's order), as rows of a
        # [HEADS, d/2] tile: the token's position, slot and RoPE tables are read once for all of them.
        await_inputs(PDL)
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        dt = q_ptr.dtype.element_ty
        i = tl.arange(0, HALF)
        total = q_heads + 2 * kv_heads
        inside = head < total
        is_q = head < q_heads
        is_v = inside & (head >= q_heads + kv_heads)
        is_k = inside & ~is_q & ~is_v
        src = qkv_ptr + tok * total * D + head[:, None] * D + i[None, :]
        m2 = inside[:, None]
        if PARTS:  # the projection's float32 partials, in one load: summed, then rounded as its epilogue would
            s = tl.arange(0, SP)[:, None, None]
            at = src[None, :, :] + s * part_stride
            m3 = (s < parts) & m2[None, :, :]
            lo = tl.sum(tl.load(at, mask=m3, other=0.0), axis=0).to(dt).to(tl.float32)
            hi = tl.sum(tl.load(at + HALF, mask=m3, other=0.0), axis=0).to(dt).to(tl.float32)
        else:
            lo = tl.load(src, mask=m2, other=0.0).to(tl.float32)
            hi = tl.load(src + HALF, mask=m2, other=0.0).to(tl.float32)
        slot = tl.load(slot_ptr + tok)
        block = slot // BS
        offset = slot % BS
        # q and k heads: [RMSNorm,] RoPE; v heads are stored as they are.
        a, b = lo, hi
        if QK_NORM:
            wl = tl.where(is_q[:, None], tl.load(qn_ptr + i)[None, :], tl.load(kn_ptr + i)[None, :]).to(tl.float32)
            wh = tl.where(is_q[:, None], tl.load(qn_ptr + HALF + i)[None, :], tl.load(kn_ptr + HALF + i)[None, :]).to(
                tl.float32
            )
            inv = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / D + eps)[:, None]
            a = (wl * (a * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            b = (wh * (b * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        p = tl.load(pos_ptr + tok)
        cos_lo = tl.load(cos_ptr + p * D + i).to(tl.float32)[None, :]
        cos_hi = tl.load(cos_ptr + p * D + HALF + i).to(tl.float32)[None, :]
        sin_lo = tl.load(sin_ptr + p * D + i).to(tl.float32)[None, :]
        sin_hi = tl.load(sin_ptr + p * D + HALF + i).to(tl.float32)[None, :]
        out_lo = ((a * cos_lo).to(dt).to(tl.float32) + (b * sin_lo).to(dt).to(tl.float32)).to(dt)
        out_hi = ((b * cos_hi).to(dt).to(tl.float32) + (a * sin_hi).to(dt).to(tl.float32)).to(dt)
        q_dst = q_ptr + (tok * q_heads + head)[:, None] * D + i[None, :]
        tl.store(q_dst, out_lo, mask=is_q[:, None])
        tl.store(q_dst + HALF, out_hi, mask=is_q[:, None])
        k_dst = kc_ptr + block * stride_blk + (head - q_heads)[:, None] * stride_head + offset * D + i[None, :]
        tl.store(k_dst, out_lo, mask=is_k[:, None])
        tl.store(k_dst + HALF, out_hi, mask=is_k[:, None])
        v_head = head - q_heads - kv_heads
        v_dst = vc_ptr + block * stride_blk + v_head[:, None] * stride_head + offset * D + i[None, :]
        tl.store(v_dst, lo.to(dt), mask=is_v[:, None])
        tl.store(v_dst + HALF, hi.to(dt), mask=is_v[:, None])


def rope_launch(partials: bool) -> tuple[int, int]:
    """(heads per program, warps) for a qkv in the weight dtype or as float32 partials, the fastest in `python -m
    benchmarks.kernels --what rope` on the H200. A bf16 qkv: 8 heads × 4 warps was the best at both shapes (the 1.5B's
    256 rows: 3.97 µs with one head per program and one warp → 1.92; the 0.5B's 64 rows: 2.00 → 1.71). The 0.5B's 8
    partials at 64 rows: 2 heads × 1 warp (2.80 → 2.60; 8 × 4 took 3.29, its [splits, heads, d/2] load too large for one
    program)."""
    return (2, 1) if partials else (8, 4)


def rope_write_triton(
    qkv: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    pos: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    warps: int | None = None,
    heads: int | None = None,
) -> torch.Tensor:
    """The Triton form of `rope_write_torch` (head_dim a power of two; one program per token and `heads` of its q,
    k and v heads; `heads` a power of two, and with `warps`: launch tuning only, by default `rope_launch`)."""
    partial = qkv.dim() == 3
    default_heads, default_warps = rope_launch(partial)
    heads, warps = heads or default_heads, warps or default_warps
    n = qkv.shape[-2]
    d = cos_table.shape[-1]
    qkv = qkv.contiguous()
    q = torch.empty(n, q_heads, d, dtype=k_cache.dtype, device=qkv.device)
    norm = q_norm is not None
    _rope_write_kernel[(n, triton.cdiv(q_heads + 2 * kv_heads, heads))](
        qkv,
        q,
        k_cache,
        v_cache,
        cos_table,
        sin_table,
        pos,
        slots,
        q_norm if norm else q,
        k_norm if norm else q,
        eps,
        q_heads,
        kv_heads,
        k_cache.stride(0),
        k_cache.stride(1),
        qkv.shape[0] if partial else 1,
        n * qkv.shape[-1],
        BS=k_cache.shape[2],
        D=d,
        HALF=d // 2,
        QK_NORM=norm,
        PARTS=partial,
        SP=triton.next_power_of_2(qkv.shape[0]) if partial else 1,
        HEADS=heads,
        num_warps=warps,
        **pdl.launch(qkv),
    )
    return q


def rope_write(
    qkv: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    pos: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    kernels: bool = True,
) -> torch.Tensor:
    """Rotated q [N, q_heads, d]; k and v of each token stored at its slot (one Triton kernel on CUDA when
    `kernels` and the head dim is a power of two)."""
    d = cos_table.shape[-1]
    if use_triton(qkv, kernels) and d >= 2 and d & (d - 1) == 0:
        return rope_write_triton(
            qkv, q_heads, kv_heads, cos_table, sin_table, pos, slots, k_cache, v_cache, q_norm, k_norm, eps
        )
    return rope_write_torch(
        qkv, q_heads, kv_heads, cos_table, sin_table, pos, slots, k_cache, v_cache, q_norm, k_norm, eps
    )
