# Experiment of call w_ (docs/measurements/README.md, fourth 2026-12-01 session), kept as run. From the repo root on
# the device: PYTHONPATH=. python3 docs/measurements/h200_1201/scripts/w_bmm_split.py [args]
import sys, torch, torch.nn.functional as F
sys.path.insert(0, "."); sys.path.insert(0, "tools")
from bench_decode_kernels import graph_time_us
dev = "cuda"
print(torch.__version__)
for name, m, n, k in [("down", 256, 1536, 8960), ("o", 256, 1536, 1536), ("qkv", 256, 2048, 1536), ("gate_up", 256, 17920, 1536),
                      ("down64", 64, 896, 4864)]:
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    ref = F.linear(x, w).float()
    row = {"name": name, "cublas": round(graph_time_us(lambda: F.linear(x, w)), 2)}
    for s in (2, 3, 4, 6, 8):
        if k % s: continue
        kc = k // s
        a = x.as_strided((s, m, kc), (kc, k, 1))
        b = w.as_strided((s, n, kc), (kc, k, 1)).transpose(1, 2)
        try:
            out = torch.bmm(a, b, out_dtype=torch.float32)
            err = (out.sum(0) - ref).abs().max().item()
            row[f"bmm_f32_s{s}"] = (round(graph_time_us(lambda: torch.bmm(a, b, out_dtype=torch.float32)), 2), round(err, 4))
        except Exception as e:
            row[f"bmm_f32_s{s}"] = repr(e)[:120]
        out = torch.bmm(a, b)
        row[f"bmm_bf16_s{s}"] = (round(graph_time_us(lambda: torch.bmm(a, b)), 2), round((out.float().sum(0) - ref).abs().max().item(), 4))
    print(row, flush=True)
