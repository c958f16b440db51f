"""Device experiment: the decode step's GEMMs at 256 rows (1.5B) in three operand layouts, graph-timed, weights rotated
over copies that exceed L2. tn: F.linear(x, W[N,K]) (the engine's); nn: x @ Wt with Wt [K,N] contiguous; tout: W @ xᵀ
([N,M] out)."""
import json, statistics, sys
import torch
import torch.nn.functional as F
sys.path.insert(0, "tools")
from bench_decode_kernels import graph_time_us

dev = torch.device("cuda")
SHAPES = {"1.5b": [("qkv", 256, 2048, 1536, True), ("o", 256, 1536, 1536, False), ("gate_up", 256, 17920, 1536, False),
                   ("down", 256, 1536, 8960, False), ("lm_head", 256, 151936, 1536, False)],
          "0.5b": [("qkv", 64, 1152, 896, True), ("o", 64, 896, 896, False), ("gate_up", 64, 9728, 896, False),
                   ("down", 64, 896, 4864, False)]}
out = []
for shape, rows in SHAPES.items():
    for name, m, n, k, bias in rows:
        copies = max(1, min(8, int(200e6 // (n * k * 2))))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        b = torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        xt = x.t().contiguous()
        it = {"i": 0}

        def nxt():
            it["i"] = (it["i"] + 1) % copies
            return it["i"]

        variants = {
            "tn": lambda: F.linear(x, ws[nxt()], b),
            "nn": lambda: (torch.addmm(b, x, wts[nxt()]) if bias else torch.mm(x, wts[nxt()])),
            "tout": lambda: (torch.addmm(b[:, None], ws[nxt()], xt) if bias else torch.mm(ws[nxt()], xt)),
            "tout_view": lambda: torch.mm(ws[nxt()], x.t()),
        }
        ref = F.linear(x, ws[0], b).float()
        res = {"shape": shape, "name": name, "m": m, "n": n, "k": k, "copies": copies}
        for v, fn in variants.items():
            try:
                it["i"] = copies - 1
                got = fn().float()
                got = got if got.shape == ref.shape else got.t()
                err = (got - ref).abs().max().item() if v != "tout_view" or not bias else None
                us = statistics.median(graph_time_us(fn, calls=copies * max(1, 16 // copies)) for _ in range(3))
                res[v] = {"us": us, "err": err}
            except Exception as e:  # noqa: BLE001
                res[v] = {"error": f"{type(e).__name__}: {e}"[:200]}
        res["tflops_tn"] = 2 * m * n * k / res["tn"]["us"] / 1e6 if "us" in res["tn"] else None
        print(json.dumps(res), flush=True)
        out.append(res)
json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "gemm_layouts.json", "w"), indent=1)
