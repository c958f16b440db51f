"""The attention input of a decode step in one pass: split the fused qkv projection, [q/k RMSNorm (Qwen3)], RoPE on
q and k, and the write of k and v into the paged KV cache.

Tokens are addressed in the cache by their slot, ``block * block_size + offset``; the cache of one layer is
[blocks, kv_heads, block_size, head_dim]. RoPE is transformers' ``x·cos + rotate_half(x)·sin`` with the sine table
stored signed (``[-sin_lo, sin_hi]``), so ``rotate_half(x)·sin = swap_halves(x)·sin_signed`` exactly; the Triton
kernel rounds each product and the sum to the weight dtype, as the torch ops do.
"""

from __future__ import annotations

import torch

from hybridrl.engines.kernels import HAS_TRITON, use_triton
from hybridrl.engines.kernels.linear import summed
from hybridrl.engines.kernels.norms import rms_norm_torch

if HAS_TRITON:
    import triton
    import triton.language as tl


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin over the last dim (x [N, heads, d], tables [N, 1, d])."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin_signed


def split_qkv_torch(qkv: torch.Tensor, q_heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, q_heads, d], k and v [N, kv_heads, d] of a fused projection qkv [N, (q + 2 kv) · d], with the optional
    per-head q/k RMSNorm and RoPE applied (tables cos/sin [N, 1, d] at each token's position)."""
    n = qkv.shape[0]
    d = cos.shape[-1]
    qkv = qkv.view(n, q_heads + 2 * kv_heads, d)
    qk, v = qkv[:, : q_heads + kv_heads], qkv[:, q_heads + kv_heads :]
    if q_norm is not None:
        qk = torch.cat((rms_norm_torch(qk[:, :q_heads], q_norm, eps), rms_norm_torch(qk[:, q_heads:], k_norm, eps)),
                       dim=1)
    qk = rope_torch(qk, cos, sin)  # q and k heads together: one RoPE pass
    return qk[:, :q_heads], qk[:, q_heads:], v


def write_kv_torch(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> None:
    """Store k, v [N, kv_heads, d] at `slots` [N] of one layer's cache [blocks, kv_heads, block_size, d]."""
    bs = k_cache.shape[2]
    block, offset = slots // bs, slots % bs
    k_cache[block, :, offset] = k
    v_cache[block, :, offset] = v


def rope_write_torch(qkv: torch.Tensor, q_heads: int, kv_heads: int, cos_table: torch.Tensor,
                     sin_table: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                     eps: float) -> torch.Tensor:
    """Rotated q [N, q_heads, d] of qkv [N, (q + 2 kv) · d] (or its float32 partials [S, N, (q + 2 kv) · d]) at
    positions `pos`; k (rotated) and v go to the cache."""
    q, k, v = split_qkv_torch(summed(qkv, k_cache.dtype), q_heads, kv_heads, cos_table[pos][:, None],
                              sin_table[pos][:, None], q_norm, k_norm, eps)
    write_kv_torch(k_cache, v_cache, slots, k, v)
    return q


if HAS_TRITON:

    @triton.jit
    def _rope_write_kernel(qkv_ptr, q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, qn_ptr, kn_ptr,
                           eps, q_heads, kv_heads, stride_blk, stride_head, parts, part_stride,
                           BS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr,
                           PARTS: tl.constexpr, SP: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        dt = q_ptr.dtype.element_ty
        i = tl.arange(0, HALF)
        src = qkv_ptr + tok * (q_heads + 2 * kv_heads) * D + head * D
        if PARTS:  # the projection's float32 partials, in one load: summed, then rounded as its epilogue would
            s = tl.arange(0, SP)
            at = src + s[:, None] * part_stride + i[None, :]
            lo = tl.sum(tl.load(at, mask=(s < parts)[:, None], other=0.0), axis=0).to(dt).to(tl.float32)
            hi = tl.sum(tl.load(at + HALF, mask=(s < parts)[:, None], other=0.0), axis=0).to(dt).to(tl.float32)
        else:
            lo = tl.load(src + i).to(tl.float32)
            hi = tl.load(src + HALF + i).to(tl.float32)
        slot = tl.load(slot_ptr + tok)
        block = slot // BS
        offset = slot % BS
        if head < q_heads + kv_heads:
            if QK_NORM:
                if head < q_heads:
                    wl = tl.load(qn_ptr + i).to(tl.float32)
                    wh = tl.load(qn_ptr + HALF + i).to(tl.float32)
                else:
                    wl = tl.load(kn_ptr + i).to(tl.float32)
                    wh = tl.load(kn_ptr + HALF + i).to(tl.float32)
                inv = tl.rsqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / D + eps)
                lo = (wl * (lo * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
                hi = (wh * (hi * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            p = tl.load(pos_ptr + tok)
            cos_lo = tl.load(cos_ptr + p * D + i).to(tl.float32)
            cos_hi = tl.load(cos_ptr + p * D + HALF + i).to(tl.float32)
            sin_lo = tl.load(sin_ptr + p * D + i).to(tl.float32)
            sin_hi = tl.load(sin_ptr + p * D + HALF + i).to(tl.float32)
            out_lo = ((lo * cos_lo).to(dt).to(tl.float32) + (hi * sin_lo).to(dt).to(tl.float32)).to(dt)
            out_hi = ((hi * cos_hi).to(dt).to(tl.float32) + (lo * sin_hi).to(dt).to(tl.float32)).to(dt)
            if head < q_heads:
                dst = q_ptr + (tok * q_heads + head) * D
            else:
                dst = kc_ptr + block * stride_blk + (head - q_heads) * stride_head + offset * D
            tl.store(dst + i, out_lo)
            tl.store(dst + HALF + i, out_hi)
        else:
            dst = vc_ptr + block * stride_blk + (head - q_heads - kv_heads) * stride_head + offset * D
            tl.store(dst + i, lo.to(dt))
            tl.store(dst + HALF + i, hi.to(dt))


def rope_write_triton(qkv: torch.Tensor, q_heads: int, kv_heads: int, cos_table: torch.Tensor,
                      sin_table: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                      eps: float, warps: int = 1) -> torch.Tensor:
    """The Triton form of `rope_write_torch` (head_dim a power of two; one program per token and head)."""
    partial = qkv.dim() == 3
    n = qkv.shape[-2]
    d = cos_table.shape[-1]
    qkv = qkv.contiguous()
    q = torch.empty(n, q_heads, d, dtype=k_cache.dtype, device=qkv.device)
    norm = q_norm is not None
    _rope_write_kernel[(n, q_heads + 2 * kv_heads)](
        qkv, q, k_cache, v_cache, cos_table, sin_table, pos, slots, q_norm if norm else q, k_norm if norm else q,
        eps, q_heads, kv_heads, k_cache.stride(0), k_cache.stride(1), qkv.shape[0] if partial else 1,
        n * qkv.shape[-1], BS=k_cache.shape[2], D=d, HALF=d // 2, QK_NORM=norm, PARTS=partial,
        SP=triton.next_power_of_2(qkv.shape[0]) if partial else 1, num_warps=warps,
    )
    return q


def rope_write(qkv: torch.Tensor, q_heads: int, kv_heads: int, cos_table: torch.Tensor, sin_table: torch.Tensor,
               pos: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
               kernels: bool = True) -> torch.Tensor:
    """Rotated q [N, q_heads, d]; k and v of each token stored at its slot (one Triton kernel on CUDA when
    `kernels` and the head dim is a power of two)."""
    d = cos_table.shape[-1]
    if use_triton(qkv, kernels) and d >= 2 and d & (d - 1) == 0:
        return rope_write_triton(qkv, q_heads, kv_heads, cos_table, sin_table, pos, slots, k_cache, v_cache,
                                 q_norm, k_norm, eps)
    return rope_write_torch(qkv, q_heads, kv_heads, cos_table, sin_table, pos, slots, k_cache, v_cache,
                            q_norm, k_norm, eps)
