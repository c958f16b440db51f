# Experiment of call t_ (docs/measurements/README.md, fourth 2026-12-01 session), kept as run. From the repo root on
# the device: PYTHONPATH=. python3 docs/measurements/h200_1201/scripts/t_ncu_attn.py [args]
import sys, torch
sys.path.insert(0, ".")
from hybridrl.engines.kernels.attention import decode_attention_triton
rows, hq, hkv, d, bs = 256, 12, 2, 128, 16
lens = torch.full((rows,), 384)
width = 40
blocks = 1 + rows * width
dev = "cuda"
k = torch.randn(blocks, hkv, bs, d, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
table = (1 + torch.arange(rows * width).view(rows, width)).int()
if len(sys.argv) > 3 and sys.argv[3] == "shared":  # GRPO: groups of 8 rows share their first 8 blocks
    table[:, :8] = table[::8, :8].repeat_interleave(8, 0)
table = table.to(dev)
q = torch.randn(rows, hq, d, device=dev, dtype=torch.bfloat16)
sl = lens.to(dev)
kw = dict(keys=int(sys.argv[1]) if len(sys.argv) > 1 else 64, warps=int(sys.argv[2]) if len(sys.argv) > 2 else 4)
for _ in range(5):
    decode_attention_triton(q, k, v, table, sl, d**-0.5, 1, **kw)
torch.cuda.synchronize()
