# Experiment of call w_ (docs/measurements/README.md, fourth 2026-12-01 session), kept as run. From the repo root on
# the device: PYTHONPATH=. python3 docs/measurements/h200_1201/scripts/w_cascade_proxy.py [args]
import sys, torch
sys.path.insert(0, "."); sys.path.insert(0, "tools")
from bench_decode_kernels import graph_time_us
from hybridrl.engines.kernels import attention as A
bs, dev, d, hkv = 16, "cuda", 128, 2
def case(rows, hq, length, keys=None, warps=4):
    width = -(-length // bs) + 1
    k = torch.randn(1 + rows * width, hkv, bs, d, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
    table = (1 + torch.arange(rows * width).view(rows, width)).int().to(dev)
    q = torch.randn(rows, hq, d, device=dev, dtype=torch.bfloat16)
    lens = torch.full((rows,), length, device=dev)
    return graph_time_us(lambda: A.decode_attention_triton(q, k, v, table, lens, d**-0.5, 1, keys=keys, warps=warps))
print("full 256 rows x 384", case(256, 12, 384))
print("suffix 256 rows x 256", case(256, 12, 256))
for keys in (32, 64, 128):
    for warps in (4, 8):
        print("prefix 32 groups x 48 q-heads/kv x 128 keys", keys, warps, case(32, 96, 128, keys, warps))
