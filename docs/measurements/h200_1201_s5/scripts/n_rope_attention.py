# Experiment of call o_ (docs/measurements/README.md, fifth 2026-12-01 session), kept as run. From the repo root
# on the device: PYTHONPATH=. python3 docs/measurements/h200_1201_s5/scripts/n_rope_attention.py
"""rope_write + decode_attention (two kernels) against rope_attention (one), at the engine's decode shapes: the 1.5B
at 256 rows (bf16 qkv, contexts 128 + up to 512) and the 0.5B at 64 rows (8 float32 partials). CUDA-graph timed."""
import json, sys, torch
sys.path.insert(0, ".")
sys.path.insert(0, "tools")
from bench_decode_kernels import graph_time_us as graph_us  # noqa: E402
from hybridrl.engines.kernels import attention, rope_attention, rope_cache  # noqa: E402


res = []
for name, hq, hkv, d, rows, parts, lo, hi in [("1.5b", 12, 2, 128, 256, 0, 129, 640), ("1.5b_mid", 12, 2, 128, 256, 0, 300, 470),
                                              ("0.5b", 14, 2, 64, 64, 8, 129, 384), ("0.5b_256", 14, 2, 64, 256, 0, 129, 384)]:
    bs = 16
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(lo, hi, (rows,), generator=g)
    width = -(-int(lens.max()) // bs)
    blocks = 1 + rows * width
    dev = "cuda"
    kc = torch.randn(blocks, hkv, bs, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = (1 + torch.arange(rows * width).view(rows, width)).int().to(dev)
    pos = (lens - 1).to(dev)
    slots = table.long().gather(1, (pos // bs)[:, None]).squeeze(1) * bs + pos % bs
    w = (hq + 2 * hkv) * d
    qkv = (torch.randn(parts, rows, w, device=dev) / 3) if parts else torch.randn(rows, w, device=dev).to(torch.bfloat16)
    cos = torch.randn(1024, d, device=dev).to(torch.bfloat16)
    sin = torch.randn(1024, d, device=dev).to(torch.bfloat16)
    splits = attention.split_count(rows, hkv, width, bs, 132)
    scale = d**-0.5

    def two():
        q = rope_cache.rope_write_triton(qkv, hq, hkv, cos, sin, pos, slots, kc, vc, None, None, 1e-6)
        return attention.decode_attention_triton(q, kc, vc, table, pos + 1, scale, splits)

    ref = two().float()
    row = {"shape": name, "rows": rows, "splits": splits, "mean_len": float(lens.float().mean()), "two_kernels_us": graph_us(two)}
    for kw in [{}, {"maxnreg": 128}, {"warps": 8}, {"stages": 2}, {"maxnreg": 168}]:
        f = lambda kw=kw: rope_attention.rope_attention_triton(qkv, hq, hkv, cos, sin, pos, slots, kc, vc, None, None, 1e-6,
                                                               table, scale, splits, **kw)
        try:
            err = (f().float() - ref).abs().max().item()
            row[json.dumps(kw)] = {"us": graph_us(f), "max_abs_diff": err}
        except Exception as e:  # noqa: BLE001
            row[json.dumps(kw)] = {"error": repr(e)[:200]}
    print(row, flush=True)
    res.append(row)
print(json.dumps(res))
