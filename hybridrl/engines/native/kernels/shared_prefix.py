"""Decode attention for rows that share their leading KV blocks (a GRPO group's prompt): those blocks are read once per
group, for all its rows' queries at once, instead of once per row.

The samples of one prompt share the prompt's full blocks in the paged cache (`Scheduler._give_blocks`), yet the
split kernel (`attention.py`) reads every row's context on its own. Here one launch holds two kinds of program:

    row:   one per (row, kv head): the row's own blocks after the shared ones → split 1 of the row's two
    slot:  one per (group slot, kv head): the queries of all the slot's rows for that kv head (rows × query heads per
           kv head ≤ 64: one [64, d] × [d, tile] product per tile) over the blocks they share → split 0 of each row

and `attention.reduce_splits` combines each row's two splits by their log-sum-exps. The slot programs run beside the
row programs; the price is the reduce and the float32 split rows. The grid is fixed by the batch (slots = rows // 2:
a group has at least two rows), so a CUDA graph serves every grouping: an unused slot exits at once. The torch path
(CPU) gathers each row's context and needs none of it: the split is only a cheaper order of the same sums.

Measured on the H200 (256 rows of the 1.5B in groups of 8): with 512 shared prompt tokens a layer's attention took
28–60 µs against 38–76 for the split kernel; with 128 it took 16–50 against 15–52 (no gain), and the 0.5B (head dim
64) lost 6–8 µs there. Hence `engine.native.shared_prefix_tokens` (default 512): the runner groups rows only where
they share that many tokens on average.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from hybridrl.engines.native.kernels import HAS_TRITON, pdl
from hybridrl.engines.native.kernels.attention import reduce_splits, split_outputs, tile_keys

if HAS_TRITON:
    import triton
    import triton.language as tl

    from hybridrl.engines.native.kernels.attention import _attend_keys, _store_split
    from hybridrl.engines.native.kernels.pdl import await_inputs

# Queries one prefix program holds: members × query heads per kv head. 64 rows of a tensor-core product, whose
# float32 accumulator [64, head_dim] still fits a program's registers at head dim 128.
QUERIES_PER_SLOT = 64


class SharedPrefix(NamedTuple):
    """Which rows share which leading blocks, in the two static tensors the kernels read."""

    slots: torch.Tensor
    """int32 [S, members + 1]: a group slot's rows (-1: none), then how many leading blocks they share (0: unused)."""
    start: torch.Tensor
    """int32 [B]: the leading blocks of row b that its slot attends (0: the row attends all of its blocks itself)."""


def slot_members(q_heads: int, kv_heads: int) -> int:
    """Rows one group slot holds (0: too many query heads per kv head for a slot to pay off)."""
    members = QUERIES_PER_SLOT // (q_heads // kv_heads)
    return members if members >= 2 else 0


def prefix_groups(
    tables: Sequence[Sequence[int]], attended: Sequence[int], block_size: int, members: int
) -> list[tuple[list[int], int]]:
    """Group slots over rows [0, len(tables)): (rows, shared blocks) for each run of at least two rows whose block
    tables begin with the same blocks, at most `members` rows a slot (a larger group takes several slots), sharing
    only blocks every row of the slot attends whole (`attended[r]`: positions row r attends at least, e.g. its
    position + 1 when placed). Rows with no partner are in no slot."""
    by_first: dict[int, list[int]] = {}
    for r, t in enumerate(tables):
        if len(t) and attended[r] >= block_size:
            by_first.setdefault(t[0], []).append(r)
    out = []
    for rows in by_first.values():
        for i in range(0, len(rows) - 1, members):
            chunk = rows[i : i + members]
            if len(chunk) < 2:
                continue
            lead = tables[chunk[0]]
            shared = min(attended[r] for r in chunk) // block_size
            for r in chunk[1:]:
                t = tables[r]
                n = 1
                while n < shared and t[n] == lead[n]:
                    n += 1
                shared = n
            out.append((chunk, shared))
    return out


def pack_prefix(groups: list[tuple[list[int], int]], rows: int, members: int) -> list[int]:
    """The host form of `SharedPrefix` for `rows` rows (slots = rows // 2): slots row-major, then start; int32 values
    for one copy into the static tensors."""
    n_slots = max(1, rows // 2)
    slots = [[-1] * members + [0] for _ in range(n_slots)]
    start = [0] * rows
    for s, (chunk, shared) in enumerate(groups):
        slots[s][: len(chunk)] = chunk
        slots[s][members] = shared
        for r in chunk:
            start[r] = shared
    return [v for slot in slots for v in slot] + start


if HAS_TRITON:

    @triton.jit
    def _grouped_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        lens_ptr,
        start_ptr,
        slots_ptr,
        o_ptr,
        lse_ptr,
        scale,
        n_rows,
        group,
        stride_table,
        stride_blk,
        stride_head,
        MEMBERS: tl.constexpr,
        M: tl.constexpr,
        GP: tl.constexpr,
        BS: tl.constexpr,
        D: tl.constexpr,
        TILE_BLOCKS: tl.constexpr,
        IEEE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Programs [0, n_rows): row pid's own blocks, after its shared ones: split 1 of its two. Programs from
        n_rows on: group slot pid - n_rows, all its rows' queries over the blocks they share: split 0 of each."""
        await_inputs(PDL)
        pid = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        q_heads = tl.num_programs(1) * group
        d = tl.arange(0, D)
        if pid < n_rows:
            g = tl.arange(0, GP)
            heads = kvh * group + g
            mine = g < group
            seq_len = tl.load(lens_ptr + pid)
            begin = tl.load(start_ptr + pid)
            q = tl.load(q_ptr + (pid * q_heads + heads)[:, None] * D + d[None, :], mask=mine[:, None], other=0.0)
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
                pid,
                kvh,
                begin,
                tl.cdiv(seq_len, BS),
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
            _store_split(m_i, l_i, acc, o_ptr, o_ptr, lse_ptr, pid, heads, mine, q_heads, 2, 1, D, False)
            if begin == 0:  # in no slot: an empty split 0 (weight 0 in the reduce, and no stale row times 0)
                _store_split(
                    tl.full([GP], float("-inf"), tl.float32),
                    tl.zeros([GP], tl.float32),
                    tl.zeros([GP, D], tl.float32),
                    o_ptr,
                    o_ptr,
                    lse_ptr,
                    pid,
                    heads,
                    mine,
                    q_heads,
                    2,
                    0,
                    D,
                    False,
                )
        else:
            base = slots_ptr + (pid - n_rows) * (MEMBERS + 1)
            n_blocks = tl.load(base + MEMBERS)
            if n_blocks > 0:
                i = tl.arange(0, M)  # query i: member i // group, query head kvh · group + i % group
                member = i // group
                row = tl.load(base + member, mask=member < MEMBERS, other=-1).to(tl.int64)
                mine = (member < MEMBERS) & (row >= 0)
                heads = kvh * group + i % group
                q = tl.load(q_ptr + (row * q_heads + heads)[:, None] * D + d[None, :], mask=mine[:, None], other=0.0)
                lead = tl.load(base).to(tl.int64)  # every member's table holds the same blocks here
                m_i = tl.full([M], float("-inf"), tl.float32)
                l_i = tl.zeros([M], tl.float32)
                acc = tl.zeros([M, D], tl.float32)
                m_i, l_i, acc = _attend_keys(
                    q,
                    m_i,
                    l_i,
                    acc,
                    k_ptr,
                    v_ptr,
                    table_ptr,
                    lead,
                    kvh,
                    0,
                    n_blocks,
                    n_blocks * BS,
                    stride_table,
                    stride_blk,
                    stride_head,
                    scale,
                    BS,
                    D,
                    TILE_BLOCKS,
                    IEEE,
                )
                _store_split(m_i, l_i, acc, o_ptr, o_ptr, lse_ptr, row, heads, mine, q_heads, 2, 0, D, False)


def shared_prefix_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    prefix: SharedPrefix,
    warps: int = 4,
    stages: int = 2,
) -> torch.Tensor:
    """`attention.decode_attention_triton` of one query per row [B, q_heads, d], the blocks each group slot shares
    read once for the slot, each row's later blocks by the row: both in one launch (two splits a row), then the
    splits' reduce. `warps` and `stages`: launch tuning only."""
    b, hq, d = q.shape
    _, hkv, bs, _ = k_cache.shape
    group = hq // hkv
    members = prefix.slots.shape[1] - 1
    q = q.contiguous()
    out, parts, lse = split_outputs(b, hq, d, 2, q.dtype, q.device)
    _grouped_kernel[(b + prefix.slots.shape[0], hkv)](
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        prefix.start,
        prefix.slots,
        parts,
        lse,
        scale,
        b,
        group,
        block_table.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        MEMBERS=members,
        M=max(16, triton.next_power_of_2(members * group)),
        GP=max(16, triton.next_power_of_2(group)),
        BS=bs,
        D=d,
        TILE_BLOCKS=max(1, tile_keys(d) // bs),
        IEEE=q.dtype == torch.float32,
        num_warps=warps,
        num_stages=stages,
        **pdl.launch(q),
    )
    reduce_splits(parts, lse, out, 2)
    return out
