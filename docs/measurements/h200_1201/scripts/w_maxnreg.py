# Experiment of call w_ (docs/measurements/README.md, fourth 2026-12-01 session), kept as run. From the repo root on
# the device: PYTHONPATH=. python3 docs/measurements/h200_1201/scripts/w_maxnreg.py [args]
import sys, json, torch, triton
sys.path.insert(0, "."); sys.path.insert(0, "tools")
from bench_decode_kernels import graph_time_us
from hybridrl.engines.kernels import attention as A
res = []
for shape, (rows, hq, hkv, d, length, keys) in {"1.5b": (256, 12, 2, 128, 384, 64), "0.5b": (64, 14, 2, 64, 256, 128)}.items():
    bs, dev = 16, "cuda"
    width = -(-length // bs) + 1
    k = torch.randn(1 + rows * width, hkv, bs, d, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
    table = (1 + torch.arange(rows * width).view(rows, width)).int().to(dev)
    q = torch.randn(rows, hq, d, device=dev, dtype=torch.bfloat16)
    lens = torch.full((rows,), length, device=dev)
    ref = A.decode_attention_triton(q, k, v, table, lens, d**-0.5, 1)
    for maxnreg in (None, 128, 96, 80, 64):
      for warps in (4, 8):
        out = torch.empty_like(q)
        extra = {} if maxnreg is None else {"maxnreg": maxnreg}
        def go():
            A._split_kernel[(rows, hkv, 1)](q, k, v, table, lens, lens, out, out, out, d**-0.5, 1, hq // hkv,
                table.stride(0), k.stride(0), k.stride(1), BS=bs, D=d, GP=16, TILE_BLOCKS=keys // bs, IEEE=False,
                DIRECT=True, ROWS=False, num_warps=warps, **extra)
        try:
            go(); err = (out.float() - ref.float()).abs().max().item()
            r = {"shape": shape, "maxnreg": maxnreg, "warps": warps, "us": graph_time_us(go), "err": err}
        except Exception as e:
            r = {"shape": shape, "maxnreg": maxnreg, "warps": warps, "error": repr(e)[:200]}
        print(r, flush=True); res.append(r)
json.dump(res, open(sys.argv[1], "w"), indent=1)
