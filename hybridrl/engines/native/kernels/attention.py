"""Decode attention over the paged KV cache: one query token per sequence, GQA, split-K (flash-decoding).

The cache of one layer is [blocks, kv_heads, block_size, head_dim]; row b of `block_table` lists sequence b's blocks
in order and `seq_lens[b]` how many of their positions it attends. The Triton path runs in two kernels:

    split:  one program per (sequence, kv head, split): the split's share of the sequence's blocks, read once for
            all g query heads of that kv head (a [g, d] × [d, tile] product), with an online softmax; writes the
            split's normalized output and its log-sum-exp (with one split: the output itself, and no reduce)
    reduce: one program per (sequence, query head): the splits combined by their log-sum-exps

Splitting the keys keeps every SM busy when batch × kv heads is small (0.5B: 2 kv heads); the split count is a
launch parameter, so a CUDA graph captured once serves every sequence length. The torch path gathers the blocks
into a padded [B, kv_heads, L, d] view and runs SDPA with a length mask: the reference, and the CPU path.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from hybridrl.engines.native.kernels import HAS_TRITON, pdl, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from hybridrl.engines.native.kernels.pdl import await_inputs


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
    table_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output [B, q_heads, d] of q [B, q_heads, d] over the first `seq_lens[b]` cached positions of each
    sequence (`max_len` ≥ every seq_lens[b]: the gathered width, padding masked). With `table_rows` [B], query b reads
    block table row table_rows[b] (several queries of one sequence share its row)."""
    if table_rows is not None:
        block_table = block_table[table_rows]
    b, hq, d = q.shape
    _, hkv, bs, _ = k_cache.shape
    g = hq // hkv
    table = block_table[:, : -(-max_len // bs)].long()
    length = max_len
    k = k_cache[table].permute(0, 2, 1, 3, 4).reshape(b, hkv, -1, d)[:, :, :length]
    v = v_cache[table].permute(0, 2, 1, 3, 4).reshape(b, hkv, -1, d)[:, :, :length]
    keep = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None]
    mask = torch.zeros(b, 1, 1, length, dtype=q.dtype, device=q.device).masked_fill_(
        ~keep[:, None, None, :], float("-inf")
    )
    # The g query heads of one kv head sit in SDPA's query-length dim: GQA with no K/V repeat
    # (transformers' repeat_kv order: kv head j serves query heads j·g .. j·g + g - 1).
    o = F.scaled_dot_product_attention(q.view(b, hkv, g, d), k, v, attn_mask=mask, scale=scale)
    return o.reshape(b, hq, d)


if HAS_TRITON:

    @triton.jit
    def _attend_keys(
        q,
        m_i,
        l_i,
        acc,
        k_ptr,
        v_ptr,
        table_ptr,
        table_row,
        kvh,
        first,
        last,
        n_keys,
        stride_table,
        stride_blk,
        stride_head,
        scale,
        BS: tl.constexpr,
        D: tl.constexpr,
        TILE_BLOCKS: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """The online softmax (running max m_i [GP], sum l_i [GP], weighted values acc [GP, D], carried on from the
        values given) of q [GP, D] over positions < n_keys in blocks [first, last) of block table row `table_row`
        (tiles with no such position are not visited)."""
        d = tl.arange(0, D)
        t = tl.arange(0, TILE_BLOCKS * BS)
        for start in range(first, tl.minimum(last, tl.cdiv(n_keys, BS)), TILE_BLOCKS):
            blk = start + t // BS
            in_range = blk < last
            phys = tl.load(table_ptr + table_row * stride_table + blk, mask=in_range, other=0).to(tl.int64)
            valid = in_range & (blk * BS + t % BS < n_keys)
            off = phys * stride_blk + kvh * stride_head + (t % BS) * D
            k = tl.load(k_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)  # in flight with k
            if IEEE:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            qk = tl.where(valid[None, :], qk * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _store_split(
        m_i,
        l_i,
        acc,
        out_ptr,
        o_ptr,
        lse_ptr,
        seq,
        heads,
        mine,
        q_heads,
        n_splits,
        split,
        D: tl.constexpr,
        DIRECT: tl.constexpr,
    ):
        """A split's normalized output and log-sum-exp for query heads `heads` (rows where `mine`) of sequence `seq`:
        with one split the answer itself, in out_ptr's dtype; else float32 rows for `_reduce_kernel`."""
        d = tl.arange(0, D)
        has = l_i > 0
        out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
        if DIRECT:  # one split: this is the answer, no reduce kernel
            tl.store(
                out_ptr + (seq * q_heads + heads)[:, None] * D + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=mine[:, None],
            )
        else:
            lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
            row = (seq * q_heads + heads) * n_splits + split
            tl.store(o_ptr + row[:, None] * D + d[None, :], out, mask=mine[:, None])
            tl.store(lse_ptr + row, lse, mask=mine)

    @triton.jit
    def _split_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        rows_ptr,
        lens_ptr,
        o_ptr,
        lse_ptr,
        out_ptr,
        scale,
        n_splits,
        group,
        stride_table,
        stride_blk,
        stride_head,
        BS: tl.constexpr,
        D: tl.constexpr,
        GP: tl.constexpr,
        TILE_BLOCKS: tl.constexpr,
        IEEE: tl.constexpr,
        DIRECT: tl.constexpr,
        ROWS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        seq = tl.program_id(0).to(tl.int64)
        if ROWS:
            table_row = tl.load(rows_ptr + seq).to(tl.int64)
        else:
            table_row = seq
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        q_heads = tl.num_programs(1) * group
        seq_len = tl.load(lens_ptr + seq)
        n_blocks = tl.cdiv(seq_len, BS)
        per = tl.cdiv(tl.cdiv(n_blocks, n_splits), TILE_BLOCKS) * TILE_BLOCKS
        first = split * per
        last = tl.minimum(first + per, n_blocks)

        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        heads = kvh * group + g
        mine = g < group
        q = tl.load(q_ptr + (seq * q_heads + heads)[:, None] * D + d[None, :], mask=mine[:, None], other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        m_i, l_i, acc = _attend_keys(
            q,
            m_i,
            l_i,
            acc,
            k_ptr,
            v_ptr,
            table_ptr,
            table_row,
            kvh,
            first,
            last,
            seq_len,
            stride_table,
            stride_blk,
            stride_head,
            scale,
            BS,
            D,
            TILE_BLOCKS,
            IEEE,
        )
        _store_split(m_i, l_i, acc, out_ptr, o_ptr, lse_ptr, seq, heads, mine, q_heads, n_splits, split, D, DIRECT)

    @triton.jit
    def _reduce_kernel(o_ptr, lse_ptr, out_ptr, n_splits, D: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr):
        await_inputs(PDL)
        head_row = tl.program_id(0).to(tl.int64)  # sequence × q_heads + head
        s = tl.arange(0, SP)
        d = tl.arange(0, D)
        inside = s < n_splits
        lse = tl.load(lse_ptr + head_row * n_splits + s, mask=inside, other=float("-inf"))
        top = tl.max(lse, axis=0)
        w = tl.where(inside, tl.exp(lse - top), 0.0)
        o = tl.load(o_ptr + (head_row * n_splits + s)[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
        out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
        tl.store(out_ptr + head_row * D + d, out.to(out_ptr.dtype.element_ty))


def split_count(
    batch: int,
    kv_heads: int,
    max_blocks: int,
    block_size: int,
    sms: int,
    keys: int = 0,
    head_dim: int = 0,
) -> int:
    """Key splits per (sequence, kv head): about one wave of programs over the SMs, at most one per 64 keys; and two
    where the programs alone would not be split but the longest row attends at least `long_context_keys` keys
    (`keys`).

    On the H200, 64 rows × 2 kv heads (128 programs on 132 SMs) ran fastest unsplit at short contexts: 6.5 µs against
    8.1 at 3 splits with their reduce; a smaller batch needs the splits to fill the SMs."""
    programs = batch * kv_heads
    want = sms // max(1, programs)
    if want < 2:
        at = long_context_keys(head_dim, programs, sms)
        if at and keys >= at:
            want = 2
    return max(1, min(want, -(-max_blocks * block_size // 64), 32))


def long_context_keys(head_dim: int, programs: int, sms: int) -> int:
    """Keys from which two splits beat one for `programs` (rows × kv heads) that `split_count` would not split; 0:
    never. Graph-timed on the H200 over GRPO-shaped tables (µs at 256/384/640/1024/2048 keys, one split → two), at most
    one program per SM: the 1.5B's 64 rows 8.0/11.0/16.7/32.8/60.7 → 8.3/10.3/13.7/24.0/41.9 (head dim 128: from 384);
    the 0.5B's 64 rows 5.1/6.7/9.8/13.9/33.5 → 6.1/7.1/8.9/11.2/24.1 (head dim 64: from 512).

    Never with more programs. Two per SM (the 1.5B's 128 rows) came within 2 µs either way. At four per SM the kernel
    alone won in two splits from 320 keys (the 1.5B's 256 rows: 32.1/51.6/82.3 → 30.0/47.7/71.3 µs at 384/640/1024),
    but the engine lost with it: the 1.5B GRPO rollout (32 × 8 × 512, rows splitting from 320 keys) made 85.7k and
    85.1k tok/s against 88.1k and 88.0k unsplit, interleaved in one run."""
    if programs <= sms:
        return 384 if head_dim >= 128 else 512
    return 0


def tile_keys(head_dim: int) -> int:
    """Keys per step of a program's loop: 8192 key elements (128 keys at head dim 64, 64 at 128: the fastest of
    32/64/128 on the H200 for the 0.5B and 1.5B shapes)."""
    return max(16, min(128, 8192 // head_dim))


def pipeline_stages(programs: int, sms: int) -> int:
    """Stages of a split program's software pipeline: 2 where `programs` (rows × kv heads, before any key split)
    outnumber the SMs, else 3.

    Graph-timed on the H200 over the engine's tables (the 1.5B's 256 rows, 128–640 keys, one split, 512 programs on
    132 SMs): 30.4 µs at 2 stages against 31.0 at 3 and 4; the 1.5B GRPO rollout (32 × 8 × 512) made 91.89k and 91.89k
    tok/s with 2 against 91.17k and 91.06k with 3, the four runs interleaved in separate processes. Fewer programs than
    SMs (the 0.5B's 64 rows, split) run fastest with 3, with or without their splits."""
    return 2 if programs > sms else 3


def _tile_blocks(block_size: int, keys: int) -> int:
    return max(1, keys // block_size)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def split_outputs(
    b: int, q_heads: int, d: int, n_splits: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The answer [b, q_heads, d] and, with more than one split, the float32 per-split rows and log-sum-exps that
    `_store_split` writes and `reduce_splits` combines (empty with one split)."""
    many = n_splits > 1
    out = torch.empty(b, q_heads, d, dtype=dtype, device=device)
    parts = torch.empty(b * q_heads * n_splits * d if many else 0, dtype=torch.float32, device=device)
    lse = torch.empty(b * q_heads * n_splits if many else 0, dtype=torch.float32, device=device)
    return out, parts, lse


def reduce_splits(parts: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, n_splits: int) -> None:
    """Combine the splits into `out` [b, q_heads, d] (nothing to do with one split: the kernel wrote `out`)."""
    if n_splits > 1:
        b, hq, d = out.shape
        _reduce_kernel[(b * hq,)](
            parts, lse, out, n_splits, D=d, SP=max(2, triton.next_power_of_2(n_splits)), **pdl.launch(out)
        )


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    n_splits: int,
    table_rows: torch.Tensor | None = None,
    keys: int | None = None,
    warps: int = 4,
    stages: int | None = None,
) -> torch.Tensor:
    """The Triton form of `decode_attention_torch` (head_dim a power of two ≥ 16; block_table int32 or int64).
    `keys` per step of a program's loop (whole blocks; default `tile_keys`), `warps` per program and `stages` of
    its software pipeline (default `pipeline_stages`): launch tuning only."""
    b, hq, d = q.shape
    _, hkv, bs, _ = k_cache.shape
    if stages is None:
        stages = pipeline_stages(b * hkv, _sm_count(q.device))
    group = hq // hkv
    q = q.contiguous()
    out, parts, lse = split_outputs(b, hq, d, n_splits, q.dtype, q.device)
    _split_kernel[(b, hkv, n_splits)](
        q,
        k_cache,
        v_cache,
        block_table,
        table_rows if table_rows is not None else seq_lens,
        seq_lens,
        parts,
        lse,
        out,
        scale,
        n_splits,
        group,
        block_table.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        BS=bs,
        D=d,
        GP=max(16, triton.next_power_of_2(group)),
        TILE_BLOCKS=_tile_blocks(bs, keys or tile_keys(d)),
        IEEE=q.dtype == torch.float32,
        DIRECT=n_splits == 1,
        ROWS=table_rows is not None,
        num_warps=warps,
        num_stages=stages,
        **pdl.launch(q),
    )
    reduce_splits(parts, lse, out, n_splits)
    return out


def triton_supports(head_dim: int, block_size: int) -> bool:
    """Whether the Triton kernel takes this shape (a power-of-two head dim of at least 16; tiles of ≥ 16 keys)."""
    tile = _tile_blocks(block_size, tile_keys(head_dim)) * block_size
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and tile >= 16


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float | None = None,
    n_splits: int = 1,
    kernels: bool = True,
    table_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention [B, q_heads, d]; the Triton split-K kernel on CUDA when `kernels` and the shape allows,
    else `decode_attention_torch` (which gathers `max_len` positions per sequence). `table_rows` [B]: query b reads
    block table row table_rows[b] (None: row b)."""
    d = q.shape[-1]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    if use_triton(q, kernels) and triton_supports(d, k_cache.shape[2]):
        return decode_attention_triton(q, k_cache, v_cache, block_table, seq_lens, scale, n_splits, table_rows)
    return decode_attention_torch(q, k_cache, v_cache, block_table, seq_lens, max_len, scale, table_rows)
