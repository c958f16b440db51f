"""A decode step's attention in one kernel from the qkv projection: RoPE on the token's q and k heads, its k and v
written to the paged cache, and split-K attention over the sequence's cached keys plus its own.

`rope_write` then `decode_attention` (the torch path, and what the extend path runs) is two launches per layer, and
q makes a round trip through memory between them. Here each program of `decode_attention`'s grid (sequence, kv head,
split) first makes its own rows from qkv: its g query heads and its kv head's k and v, [q/k RMSNorm,] RoPE, rounded
as `rope_write` rounds them. The split that holds the token's position writes k and v to the token's slot and adds
the token's own key to its online softmax from registers (first: nothing stays live through the loop for it); the
cached keys every split reads are the positions before it, so no program reads what another writes in the launch.

One query per sequence (decode); several per sequence (a packed extend) take the two-kernel path. The engine runs it
where the grid is at most one program per SM (`FusedDecoder._layers`): its RoPE operands take registers the key loop
then lacks, which costs occupancy once programs share SMs (measured on the H200: faster at the 0.5B's 64 rows, slower
at 256 rows).
"""

from __future__ import annotations

import torch

from hybridrl.engines.native.kernels import HAS_TRITON, attention, pdl, use_triton
from hybridrl.engines.native.kernels.attention import decode_attention, decode_attention_torch, triton_supports
from hybridrl.engines.native.kernels.rope_cache import rope_write, rope_write_torch

if HAS_TRITON:
    import triton
    import triton.language as tl

    from hybridrl.engines.native.kernels.pdl import await_inputs

    _attend_keys, _store_split = attention._attend_keys, attention._store_split


def one_wave(rows: int, kv_heads: int, splits: int, sms: int) -> bool:
    """Whether the kernel's grid (rows × kv heads × splits programs) is at most one program per SM: where the engine
    runs it. On the H200 it took 9.1 µs against 10.3 for the two kernels at the 0.5B's 64 rows × 2 kv heads (128
    programs); at 256 rows (512), where programs share SMs, its RoPE operands' registers cost occupancy in the key loop:
    48.0 µs against 39.2 at the 1.5B's."""
    return rows * kv_heads * splits <= sms


def rope_attention_torch(
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
    block_table: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention output [B, q_heads, d] of one decode token per sequence from its qkv [B, (q + 2 kv) · d] (or float32
    partials [S, B, ...]): `rope_write_torch` (k, v to the cache), then `decode_attention_torch` over positions
    ≤ pos."""
    q = rope_write_torch(
        qkv, q_heads, kv_heads, cos_table, sin_table, pos, slots, k_cache, v_cache, q_norm, k_norm, eps
    )
    return decode_attention_torch(q, k_cache, v_cache, block_table, pos + 1, max_len, scale)


if HAS_TRITON:

    @triton.jit
    def _rope_attention_kernel(
        qkv_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        pos_ptr,
        slot_ptr,
        cos_ptr,
        sin_ptr,
        qn_ptr,
        kn_ptr,
        o_ptr,
        lse_ptr,
        out_ptr,
        eps,
        scale,
        n_splits,
        group,
        stride_table,
        stride_blk,
        stride_head,
        parts,
        part_stride,
        BS: tl.constexpr,
        D: tl.constexpr,
        R: tl.constexpr,
        TILE_BLOCKS: tl.constexpr,
        IEEE: tl.constexpr,
        DIRECT: tl.constexpr,
        QK_NORM: tl.constexpr,
        PARTS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        seq = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        kv_heads = tl.num_programs(1)
        q_heads = kv_heads * group
        total = q_heads + 2 * kv_heads
        dt = k_ptr.dtype.element_ty
        p = tl.load(pos_ptr + seq)
        seq_len = p + 1
        n_blocks = tl.cdiv(seq_len, BS)
        per = tl.cdiv(tl.cdiv(n_blocks, n_splits), TILE_BLOCKS) * TILE_BLOCKS
        first = split * per
        last = tl.minimum(first + per, n_blocks)
        owner = (first <= n_blocks - 1) & (n_blocks - 1 < last)  # this split holds the token's own position

        # Rows of this program's tile: its g query heads, then its kv head's k, then v (the rest padding).
        r = tl.arange(0, R)
        d = tl.arange(0, D)
        swapped = (d + D // 2) % D
        is_q = r < group
        is_k = r == group
        is_v = r == group + 1
        head = tl.where(is_q, kvh * group + r, tl.where(is_k, q_heads + kvh, q_heads + kv_heads + kvh))
        rows = (is_q | is_k | is_v)[:, None]
        src = qkv_ptr + (seq * total + head)[:, None] * D
        if PARTS:  # the projection's float32 partials: summed, then rounded as its epilogue would
            x = tl.zeros([R, D], tl.float32)
            xs = tl.zeros([R, D], tl.float32)
            for s in range(parts):
                x += tl.load(src + s * part_stride + d[None, :], mask=rows, other=0.0)
                xs += tl.load(src + s * part_stride + swapped[None, :], mask=rows, other=0.0)
            x = x.to(dt).to(tl.float32)
            xs = xs.to(dt).to(tl.float32)
        else:
            x = tl.load(src + d[None, :], mask=rows, other=0.0).to(tl.float32)
            xs = tl.load(src + swapped[None, :], mask=rows, other=0.0).to(tl.float32)
        a, b = x, xs
        if QK_NORM:  # per-head RMSNorm of q and k rows before RoPE (Qwen3)
            w = tl.where(is_q[:, None], tl.load(qn_ptr + d)[None, :], tl.load(kn_ptr + d)[None, :]).to(tl.float32)
            ws = tl.where(is_q[:, None], tl.load(qn_ptr + swapped)[None, :], tl.load(kn_ptr + swapped)[None, :]).to(
                tl.float32
            )
            inv = tl.rsqrt(tl.sum(a * a, axis=1) / D + eps)[:, None]
            a = (w * (a * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            b = (ws * (b * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        # RoPE as `rope_write` rounds it: column j is x_j·cos_j + x_(j+d/2 mod d)·sin_j (the sine table signed).
        cos = tl.load(cos_ptr + p * D + d).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + p * D + d).to(tl.float32)[None, :]
        rot = ((a * cos).to(dt).to(tl.float32) + (b * sin).to(dt).to(tl.float32)).to(dt)
        q = tl.where(is_q[:, None], rot, 0.0).to(dt)
        k_own = tl.sum(tl.where(is_k[:, None], rot.to(tl.float32), 0.0), axis=0)  # [D], values of the weight dtype
        v_own = tl.sum(tl.where(is_v[:, None], x, 0.0), axis=0)
        if owner:
            slot = tl.load(slot_ptr + seq)
            dst = (slot // BS) * stride_blk + kvh * stride_head + (slot % BS) * D + d
            tl.store(k_ptr + dst, k_own.to(dt))
            tl.store(v_ptr + dst, v_own.to(dt))
        # The owner's softmax starts at the token's own key (weight exp(0) = 1), from registers; the cached keys
        # follow: the positions before the token.
        own = is_q & owner
        s_own = tl.sum(q.to(tl.float32) * k_own[None, :], axis=1) * scale
        m_i = tl.where(own, s_own, float("-inf"))
        l_i = tl.where(own, 1.0, 0.0)
        acc = tl.where(own[:, None], v_own[None, :], 0.0)
        m_i, l_i, acc = _attend_keys(
            q,
            m_i,
            l_i,
            acc,
            k_ptr,
            v_ptr,
            table_ptr,
            seq,
            kvh,
            first,
            last,
            seq_len - 1,
            stride_table,
            stride_blk,
            stride_head,
            scale,
            BS,
            D,
            TILE_BLOCKS,
            IEEE,
        )
        _store_split(
            m_i, l_i, acc, out_ptr, o_ptr, lse_ptr, seq, kvh * group + r, is_q, q_heads, n_splits, split, D, DIRECT
        )


def rope_attention_triton(
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
    block_table: torch.Tensor,
    scale: float,
    n_splits: int,
    warps: int = 4,
    stages: int = 3,
    maxnreg: int | None = None,
) -> torch.Tensor:
    """The Triton form of `rope_attention_torch` (head dim a power of two ≥ 16; `warps`, `stages` and a register cap
    `maxnreg`: launch tuning)."""
    partial = qkv.dim() == 3
    b = pos.shape[0]
    _, _, bs, d = k_cache.shape
    group = q_heads // kv_heads
    qkv = qkv.contiguous()
    out, parts, lse = attention.split_outputs(b, q_heads, d, n_splits, k_cache.dtype, qkv.device)
    norm = q_norm is not None
    tile_blocks = attention._tile_blocks(bs, attention.tile_keys(d))
    _rope_attention_kernel[(b, kv_heads, n_splits)](
        qkv,
        k_cache,
        v_cache,
        block_table,
        pos,
        slots,
        cos_table,
        sin_table,
        q_norm if norm else out,
        k_norm if norm else out,
        parts,
        lse,
        out,
        eps,
        scale,
        n_splits,
        group,
        block_table.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        qkv.shape[0] if partial else 1,
        b * qkv.shape[-1],
        BS=bs,
        D=d,
        R=max(16, triton.next_power_of_2(group + 2)),
        TILE_BLOCKS=tile_blocks,
        IEEE=k_cache.dtype == torch.float32,
        DIRECT=n_splits == 1,
        QK_NORM=norm,
        PARTS=partial,
        num_warps=warps,
        num_stages=stages,
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
        **pdl.launch(qkv),
    )
    attention.reduce_splits(parts, lse, out, n_splits)
    return out


def rope_attention(
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
    block_table: torch.Tensor,
    max_len: int,
    scale: float,
    n_splits: int = 1,
    kernels: bool = True,
) -> torch.Tensor:
    """Decode attention [B, q_heads, d] straight from qkv: the one-kernel form on CUDA when `kernels` and the shape
    allows, else `rope_write` then `decode_attention` (the same kernels as an extend, or the torch path)."""
    d = k_cache.shape[-1]
    if use_triton(qkv, kernels) and triton_supports(d, k_cache.shape[2]):
        return rope_attention_triton(
            qkv,
            q_heads,
            kv_heads,
            cos_table,
            sin_table,
            pos,
            slots,
            k_cache,
            v_cache,
            q_norm,
            k_norm,
            eps,
            block_table,
            scale,
            n_splits,
        )
    q = rope_write(
        qkv, q_heads, kv_heads, cos_table, sin_table, pos, slots, k_cache, v_cache, q_norm, k_norm, eps, kernels
    )
    return decode_attention(q, k_cache, v_cache, block_table, pos + 1, max_len, scale, n_splits, kernels)
