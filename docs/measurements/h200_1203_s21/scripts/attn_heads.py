"""Scratch of session 21, kept as run (calls 4 and 5; the sweep put under `main` afterwards so the other scripts
import its kernel; from the repo root on the device: PYTHONPATH=. python3 <this file>).
1.5B decode attention at 256 rows, one program per (row, kv head) (the engine's kernel) against one program
per row over all its kv heads, each tile [heads x keys, d] so a block's heads are read as one contiguous span."""
import itertools, json, os, sys
sys.path.insert(0, "tools")
import torch
import triton, triton.language as tl
from bench_decode_kernels import graph_time_us
from hybridrl.engines.kernels.attention import decode_attention_triton, decode_attention_torch

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


def main() -> None:
    dev = torch.device("cuda")
    rows, hq, hkv, d = 256, 12, 2, 128
    res = {"gpu": torch.cuda.get_device_name(), "cases": []}
    for bs, n in itertools.product((16, 32), (200, 384, 640)):
        gen = torch.Generator().manual_seed(0)
        width = -(-640 // bs)
        blocks = 1 + rows * width
        k = torch.randn(blocks, hkv, bs, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        # Blocks handed out as the engine's lockstep rows grow (row r's j-th block after every row's (j-1)-th), a group
        # of 8 rows sharing its prompt's 128 tokens.
        ids = 1 + torch.arange(rows * width).view(width, rows).t().contiguous()
        shared = 128 // bs
        for g in range(rows // 8):
            ids[g * 8:(g + 1) * 8, :shared] = ids[g * 8, :shared]
        table = ids.int().to(dev)
        lens = torch.full((rows,), n, dtype=torch.int32, device=dev)
        q = torch.randn(rows, hq, d, device=dev, dtype=torch.bfloat16)
        scale = d ** -0.5
        ref = decode_attention_torch(q.float(), k.float(), v.float(), table, lens, n, scale)
        case = {"block_size": bs, "keys": n, "bound_us": rows * n * hkv * d * 4 / 4.8e12 * 1e6}
        cur = decode_attention_triton(q, k, v, table, lens, scale, 1)
        case["engine_err"] = (cur.float() - ref).abs().max().item()
        case["engine_us"] = graph_time_us(lambda: decode_attention_triton(q, k, v, table, lens, scale, 1))
        var = []
        for tk, warps, stages in itertools.product((16, 32, 64), (4, 8), (2, 3, 4)):
            try:
                got = row_attention(q, k, v, table, lens, scale, tk, warps, stages)
                err = (got.float() - ref).abs().max().item()
                us = graph_time_us(lambda: row_attention(q, k, v, table, lens, scale, tk, warps, stages))
                var.append({"tk": tk, "warps": warps, "stages": stages, "us": us, "err": err})
            except Exception as e:  # noqa: BLE001
                var.append({"tk": tk, "warps": warps, "stages": stages, "error": f"{type(e).__name__}: {e}"[:200]})
        ok = sorted((x for x in var if "us" in x), key=lambda x: x["us"])
        case["row_best"] = ok[:4]
        case["row_errors"] = [x for x in var if "error" in x][:3]
        case["engine_again_us"] = graph_time_us(lambda: decode_attention_triton(q, k, v, table, lens, scale, 1))
        res["cases"].append(case)
        print(json.dumps({kk: vv for kk, vv in case.items() if kk != "row_best"}), ok[:1], flush=True)
    open(os.path.join(os.environ.get("OUT", "."), "attn_heads.json"), "w").write(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
