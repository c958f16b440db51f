# Experiment of call v_ (docs/measurements/README.md, fourth 2026-12-01 session), kept as run. From the repo root on
# the device: PYTHONPATH=. python3 docs/measurements/h200_1201/scripts/v_attn_variants.py [args]
"""Scratch: decode attention kernel variants (pipelining experiments). Not product code."""
import sys, json, torch, triton, triton.language as tl
sys.path.insert(0, ".")
from hybridrl.engines.kernels.attention import decode_attention_triton, decode_attention_torch


@triton.jit
def _tile(q, k_ptr, v_ptr, trow, start, t, d, n_blocks, seq_len, kvh, stride_blk, stride_head, scale, m_i, l_i, acc,
          BS: tl.constexpr, D: tl.constexpr):
    blk = start + t // BS
    in_range = blk < n_blocks
    phys = tl.load(trow + blk, mask=in_range, other=0).to(tl.int64)
    valid = in_range & (blk * BS + t % BS < seq_len)
    off = phys * stride_blk + kvh * stride_head + (t % BS) * D
    k = tl.load(k_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(v_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    qk = tl.dot(q, tl.trans(k))
    qk = tl.where(valid[None, :], qk * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    p = tl.exp(qk - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _kx(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, scale, group, stride_table, stride_blk, stride_head,
        BS: tl.constexpr, D: tl.constexpr, GP: tl.constexpr, TILE_BLOCKS: tl.constexpr, MODE: tl.constexpr,
        STAGES: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    q_heads = tl.num_programs(1) * group
    seq_len = tl.load(lens_ptr + seq)
    n_blocks = tl.cdiv(seq_len, BS)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    heads = kvh * group + g
    q_mask = (g < group)[:, None]
    q = tl.load(q_ptr + (seq * q_heads + heads)[:, None] * D + d[None, :], mask=q_mask, other=0.0)
    t = tl.arange(0, TILE_BLOCKS * BS)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    trow = table_ptr + seq * stride_table
    if MODE == 0:
        for start in range(0, n_blocks, TILE_BLOCKS):
            m_i, l_i, acc = _tile(q, k_ptr, v_ptr, trow, start, t, d, n_blocks, seq_len, kvh, stride_blk,
                                  stride_head, scale, m_i, l_i, acc, BS, D)
    elif MODE == 1:
        for start in tl.range(0, n_blocks, TILE_BLOCKS, num_stages=STAGES):
            m_i, l_i, acc = _tile(q, k_ptr, v_ptr, trow, start, t, d, n_blocks, seq_len, kvh, stride_blk,
                                  stride_head, scale, m_i, l_i, acc, BS, D)
    else:
        # Registers double-buffered by hand: the next tile's K/V loads are issued before this tile's math.
        blk = t // BS
        in_range = blk < n_blocks
        phys = tl.load(trow + blk, mask=in_range, other=0).to(tl.int64)
        valid = in_range & (blk * BS + t % BS < seq_len)
        off = phys * stride_blk + kvh * stride_head + (t % BS) * D
        k = tl.load(k_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        for start in range(0, n_blocks, TILE_BLOCKS):
            nblk = start + TILE_BLOCKS + t // BS
            n_in = nblk < n_blocks
            nphys = tl.load(trow + nblk, mask=n_in, other=0).to(tl.int64)
            nvalid = n_in & (nblk * BS + t % BS < seq_len)
            noff = nphys * stride_blk + kvh * stride_head + (t % BS) * D
            nk = tl.load(k_ptr + noff[:, None] + d[None, :], mask=nvalid[:, None], other=0.0)
            nv = tl.load(v_ptr + noff[:, None] + d[None, :], mask=nvalid[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k))
            qk = tl.where(valid[None, :], qk * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
            k, v, valid = nk, nv, nvalid
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    tl.store(out_ptr + (seq * q_heads + heads)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)


def run(q, k, v, table, lens, mode, stages, keys, warps):
    b, hq, d = q.shape
    _, hkv, bs, _ = k.shape
    out = torch.empty_like(q)
    _kx[(b, hkv)](q, k, v, table, lens, out, d**-0.5, hq // hkv, table.stride(0), k.stride(0), k.stride(1),
                  BS=bs, D=d, GP=16, TILE_BLOCKS=keys // bs, MODE=mode, STAGES=stages, num_warps=warps,
                  num_stages=stages)
    return out


if __name__ == "__main__":
    sys.path.insert(0, 'tools'); from bench_decode_kernels import graph_time_us
    dev = "cuda"
    res = []
    for shape, (rows, hq, hkv, d, length) in {"1.5b": (256, 12, 2, 128, 384), "0.5b": (64, 14, 2, 64, 256)}.items():
        bs = 16
        width = -(-length // bs) + 1
        blocks = 1 + rows * width
        k = torch.randn(blocks, hkv, bs, d, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
        for shared in (False, True):
            table = (1 + torch.arange(rows * width).view(rows, width)).int()
            if shared:
                table[:, :8] = table[::8, :8].repeat_interleave(8, 0)
            table = table.to(dev)
            q = torch.randn(rows, hq, d, device=dev, dtype=torch.bfloat16)
            lens = torch.full((rows,), length, device=dev)
            ref = decode_attention_torch(q, k, v, table, lens, width * bs, d**-0.5)
            base = graph_time_us(lambda: decode_attention_triton(q, k, v, table, lens, d**-0.5, 1))
            res.append({"shape": shape, "shared": shared, "mode": "current", "us": base})
            for mode, stages, keys, warps in [(0, 3, 64, 4), (1, 2, 64, 4), (1, 3, 64, 4), (1, 4, 64, 4), (1, 3, 32, 4),
                                              (1, 4, 32, 4), (2, 1, 64, 4), (2, 1, 32, 4), (2, 1, 64, 8),
                                              (2, 1, 128, 8), (1, 3, 64, 8), (1, 3, 128, 8)]:
                try:
                    o = run(q, k, v, table, lens, mode, stages, keys, warps)
                    err = (o.float() - ref.float()).abs().max().item()
                    us = graph_time_us(lambda: run(q, k, v, table, lens, mode, stages, keys, warps))
                    res.append({"shape": shape, "shared": shared, "mode": mode, "stages": stages, "keys": keys,
                                "warps": warps, "us": us, "err": err})
                except Exception as e:
                    res.append({"shape": shape, "shared": shared, "mode": mode, "stages": stages, "keys": keys,
                                "warps": warps, "error": repr(e)[:300]})
                print(res[-1], flush=True)
    json.dump(res, open(sys.argv[1], "w"), indent=1)
