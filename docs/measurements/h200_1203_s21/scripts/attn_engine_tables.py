"""For the next session (written in session 21, not yet run): do the kernel benches predict the engine once they time
attention on the engine's block tables? Session 21's row kernel (one program per row over both kv heads) beat the split
kernel alone on tables whose rows took their blocks in turn (`f_attn_rotated.json`) and lost in the engine, whose
scheduler gives each row one run of blocks (`bench_decode_kernels.engine_tables`). Here both kernels, 1.5B shape, GRPO
groups of 8 with 128-token prompts, on both layouts. If the row kernel loses on the engine's tables, the benches' old
tables explain session 21's (and session 8's) disagreement. From the repo root on the device:
PYTHONPATH=. python3 docs/measurements/h200_1203_s21/scripts/attn_engine_tables.py"""
import json, os, sys, statistics
sys.path.insert(0, "tools")
import torch
import triton, triton.language as tl
from bench_decode_kernels import engine_tables, graph_time_us
from hybridrl.engines.kernels.attention import decode_attention_triton

@triton.jit
def _row_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, scale, stride_table, stride_blk,
                HKV: tl.constexpr, G: tl.constexpr, QP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                TK: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    n_keys = tl.load(lens_ptr + seq)
    d = tl.arange(0, D)
    qh = tl.arange(0, QP)                        # query heads (padded)
    q_in = qh < HKV * G
    q = tl.load(q_ptr + (seq * HKV * G + qh)[:, None] * D + d[None, :], mask=q_in[:, None], other=0.0)
    r = tl.arange(0, HKV * TK)                    # tile rows: (kv head, key)
    head = r // TK
    key = r % TK
    mine = (qh // G)[:, None] == head[None, :]    # a query head scores only its kv head's keys
    m_i = tl.full([QP], float("-inf"), tl.float32)
    l_i = tl.zeros([QP], tl.float32)
    acc = tl.zeros([QP, D], tl.float32)
    for start in range(0, n_keys, TK):
        pos = start + key
        blk = pos // BS
        valid = pos < n_keys
        phys = tl.load(table_ptr + seq * stride_table + blk, mask=valid, other=0).to(tl.int64)
        off = phys * stride_blk + head * (BS * D) + (pos % BS) * D
        k = tl.load(k_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k))
        s = tl.where(mine & valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (seq * HKV * G + qh)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=q_in[:, None])

def row_attention(q, k, v, table, lens, scale, tk, warps, stages):
    b, hq, d = q.shape
    _, hkv, bs, _ = k.shape
    out = torch.empty_like(q)
    _row_kernel[(b,)](q, k, v, table, lens, out, scale, table.stride(0), k.stride(0), HKV=hkv, G=hq // hkv,
                      QP=max(16, triton.next_power_of_2(hq)), BS=bs, D=d, TK=tk, num_warps=warps, num_stages=stages)
    return out


dev = torch.device("cuda")
hq, hkv, d, bs = 12, 2, 128, 16
res = []
for rows in (192, 256, 384):
    engine = engine_tables(rows, 8, 128, 513, bs)
    width = engine.shape[1]
    turns = 1 + torch.arange(rows * width).view(width, rows).t().contiguous()  # rows take blocks in turn
    for g in range(0, rows, 8):
        turns[g:g + 8, :8] = turns[g, :8]
    q = torch.randn(rows, hq, d, device=dev, dtype=torch.bfloat16)
    for layout, table in (("engine", engine), ("in_turn", turns)):
        table = table.int().to(dev)
        k = torch.randn(int(table.max()) + 1, hkv, bs, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for keys in (200, 384, 640):
            lens = torch.full((rows,), keys, dtype=torch.int32, device=dev)
            r = {"rows": rows, "layout": layout, "keys": keys,
                 "split_us": graph_time_us(lambda: decode_attention_triton(q, k, v, table, lens, d**-0.5, 1)),
                 "rows_us": graph_time_us(lambda: row_attention(q, k, v, table, lens, d**-0.5, 64, 8, 3))}
            res.append(r)
            print(json.dumps(r), flush=True)
open(os.path.join(os.environ.get("OUT", "."), "attn_engine_tables.json"), "w").write(json.dumps(res, indent=1))
