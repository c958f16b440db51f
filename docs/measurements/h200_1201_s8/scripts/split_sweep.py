"""Session 8, call 2: decode attention (the engine's split kernel) over key splits 1-4 by context length, at
GRPO-shaped tables (groups of 8 rows share a 128-token prompt), graph-timed. Which split count wins where."""
import json, os, importlib.util
import torch
spec = importlib.util.spec_from_file_location("bdk", "tools/bench_decode_kernels.py"); bdk = importlib.util.module_from_spec(spec); spec.loader.exec_module(bdk)
from hybridrl.engines.kernels.attention import decode_attention_triton, decode_attention_torch
dev = torch.device("cuda")
res = []
for shape, B, HQ, HKV, D in (("1.5b", 256, 12, 2, 128), ("1.5b", 128, 12, 2, 128), ("1.5b", 64, 12, 2, 128),
                             ("0.5b", 256, 14, 2, 64), ("0.5b", 64, 14, 2, 64), ("7b", 128, 28, 4, 128)):
    BS, P, G = 16, 128, 8
    for L in (160, 256, 320, 384, 512, 640, 1024, 2048):
        nb = -(-L // BS); pb = P // BS
        pool = B * nb + 64
        k = torch.randn(pool, HKV, BS, D, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
        q = torch.randn(B, HQ, D, device=dev, dtype=torch.bfloat16)
        table = torch.randperm(pool, device=dev).int()[: B * nb].view(B, nb).contiguous()
        for g in range(B // G):
            table[g * G:(g + 1) * G, :pb] = table[g * G, :pb]
        lens = torch.full((B,), L, device=dev, dtype=torch.int32)
        ref = decode_attention_torch(q, k, v, table, lens, nb * BS, D ** -0.5)
        row = {"shape": shape, "rows": B, "L": L}
        for s in (1, 2, 3, 4):
            got = decode_attention_triton(q, k, v, table, lens, D ** -0.5, s)
            row[f"s{s}_us"] = bdk.graph_time_us(lambda s=s: decode_attention_triton(q, k, v, table, lens, D ** -0.5, s))
            row[f"s{s}_err"] = (got.float() - ref.float()).abs().max().item()
        row["best"] = min((1, 2, 3, 4), key=lambda s: row[f"s{s}_us"])
        print({k2: (round(x, 1) if isinstance(x, float) and k2.endswith("us") else x) for k2, x in row.items()
               if not k2.endswith("err")}, flush=True)
        res.append(row)
        del k, v
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "a_split_sweep.json"), "w"), indent=1)
