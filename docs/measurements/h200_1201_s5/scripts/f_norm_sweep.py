# Experiment of call f_ (docs/measurements/README.md, fifth 2026-12-01 session), kept as run. From the repo root
# on the device: PYTHONPATH=. python3 docs/measurements/h200_1201_s5/scripts/f_norm_sweep.py
"""add_rms_norm at the engine's shapes: warps per row 1..16, bf16 delta and float32 partials."""
import json, sys, torch
sys.path.insert(0, ".")
from hybridrl.engines.kernels import norms


def bench(fn, n=400):
    for _ in range(5):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(40):
            fn()
    ts = []
    for _ in range(n // 40):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); g.replay(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1000 / 40)
    return sorted(ts)[len(ts) // 2]


res = []
for hidden, rows, parts in [(1536, 256, 0), (1536, 256, 4), (896, 256, 0), (896, 256, 4), (896, 64, 0), (896, 64, 8),
                            (1536, 64, 0), (1536, 64, 8)]:
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    d = torch.randn(parts, rows, hidden, device="cuda") if parts else torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    row = {"hidden": hidden, "rows": rows, "parts": parts}
    for warps in (1, 2, 4, 8, 16):
        row[warps] = bench(lambda: norms.add_rms_norm_triton(x, d, w, 1e-6, warps=warps))
    row["default"] = bench(lambda: norms.add_rms_norm_triton(x, d, w, 1e-6))
    print(row, flush=True)
    res.append(row)
print(json.dumps(res))
