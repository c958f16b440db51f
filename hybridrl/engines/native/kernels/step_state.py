"""The decode step's per-row bookkeeping as two small kernels: each row's cache slot before the forward, and the
advance after the sampler (outputs out, the sampled token in as the next input, position and step on).

In torch these are eleven [rows]-sized elementwise kernels per step (a floor division, a clamp, a gather, a cast, a
product, a remainder and a sum; then three copies and two in-place sums). Each is ~1.2 µs on the H200 plus its gap in
the step's graph, for a few hundred bytes of work. The torch functions are the reference and the CPU path.
"""

from __future__ import annotations

import torch

from hybridrl.engines.native.kernels import HAS_TRITON, pdl, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from hybridrl.engines.native.kernels.pdl import await_inputs

_BLOCK = 256  # rows per program: one program up to 256 rows


def cache_slots_torch(table: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slot [B] (int64) that position pos[b] of the sequence whose block table is table[b] writes:
    table[b, pos // block_size] · block_size + pos % block_size. A position past the table's last block (a padding
    row's) reads the last block instead of running off the table."""
    block = table.gather(1, (pos // block_size).clamp(max=table.shape[1] - 1)[:, None]).squeeze(1).long()
    return block * block_size + pos % block_size


def advance_torch(
    tok: torch.Tensor,
    lp: torch.Tensor,
    out_tok: torch.Tensor,
    out_lp: torch.Tensor,
    tokens: torch.Tensor,
    pos: torch.Tensor,
    steps: torch.Tensor,
    active: torch.Tensor,
) -> None:
    """After a step sampled `tok` with log-probs `lp` [B]: both to the outputs, `tok` as the next input, and the
    position and sample index of each active row one on (padding rows, active 0, stay)."""
    out_tok.copy_(tok)
    out_lp.copy_(lp)
    tokens.copy_(tok)
    pos += active
    steps += active


if HAS_TRITON:

    @triton.jit
    def _slots_kernel(
        table_ptr, pos_ptr, out_ptr, n, stride, width, BS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
    ):
        await_inputs(PDL)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        p = tl.load(pos_ptr + i, mask=inside, other=0)
        idx = tl.minimum(p // BS, width - 1)
        blk = tl.load(table_ptr + i.to(tl.int64) * stride + idx, mask=inside, other=0).to(tl.int64)
        tl.store(out_ptr + i, blk * BS + p % BS, mask=inside)

    @triton.jit
    def _advance_kernel(
        tok_ptr,
        lp_ptr,
        out_tok_ptr,
        out_lp_ptr,
        tokens_ptr,
        pos_ptr,
        steps_ptr,
        active_ptr,
        n,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        tok = tl.load(tok_ptr + i, mask=inside)
        a = tl.load(active_ptr + i, mask=inside, other=0)
        tl.store(out_tok_ptr + i, tok, mask=inside)
        tl.store(out_lp_ptr + i, tl.load(lp_ptr + i, mask=inside), mask=inside)
        tl.store(tokens_ptr + i, tok, mask=inside)
        tl.store(pos_ptr + i, tl.load(pos_ptr + i, mask=inside) + a, mask=inside)
        tl.store(steps_ptr + i, tl.load(steps_ptr + i, mask=inside) + a, mask=inside)


def cache_slots_triton(table: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """The Triton form of `cache_slots_torch` (table [B, W] with unit column stride, pos [B] int64 contiguous)."""
    b = pos.shape[0]
    out = torch.empty(b, dtype=torch.int64, device=pos.device)
    _slots_kernel[(triton.cdiv(b, _BLOCK),)](
        table, pos, out, b, table.stride(0), table.shape[1], BS=block_size, BLOCK=_BLOCK, **pdl.launch(pos)
    )
    return out


def advance_triton(
    tok: torch.Tensor,
    lp: torch.Tensor,
    out_tok: torch.Tensor,
    out_lp: torch.Tensor,
    tokens: torch.Tensor,
    pos: torch.Tensor,
    steps: torch.Tensor,
    active: torch.Tensor,
) -> None:
    """The Triton form of `advance_torch` (every tensor [B], contiguous)."""
    b = tok.shape[0]
    _advance_kernel[(triton.cdiv(b, _BLOCK),)](
        tok, lp, out_tok, out_lp, tokens, pos, steps, active, b, BLOCK=_BLOCK, **pdl.launch(tok)
    )


def cache_slots(table: torch.Tensor, pos: torch.Tensor, block_size: int, kernels: bool = True) -> torch.Tensor:
    """`cache_slots_torch`, in one Triton kernel on CUDA when `kernels` and the layouts allow."""
    if use_triton(pos, kernels) and table.stride(1) == 1 and pos.is_contiguous() and pos.dtype == torch.int64:
        return cache_slots_triton(table, pos, block_size)
    return cache_slots_torch(table, pos, block_size)


def advance(
    tok: torch.Tensor,
    lp: torch.Tensor,
    out_tok: torch.Tensor,
    out_lp: torch.Tensor,
    tokens: torch.Tensor,
    pos: torch.Tensor,
    steps: torch.Tensor,
    active: torch.Tensor,
    kernels: bool = True,
) -> None:
    """`advance_torch`, in one Triton kernel on CUDA when `kernels` and every tensor is contiguous."""
    rows = (tok, lp, out_tok, out_lp, tokens, pos, steps, active)
    if use_triton(tok, kernels) and all(t.is_contiguous() for t in rows):
        advance_triton(*rows)
    else:
        advance_torch(*rows)
