"""Attention at the 1.5B GRPO shape: shared-prefix tables vs distinct vs suffix only (does L2 already share?)."""
import json, os, sys, importlib.util
import torch
sys.path.insert(0, "tools")
spec = importlib.util.spec_from_file_location("bdk", "tools/bench_decode_kernels.py"); bdk = importlib.util.module_from_spec(spec); spec.loader.exec_module(bdk)
from hybridrl.engines.kernels.attention import decode_attention_triton, split_count
dev = torch.device("cuda")
B, HQ, HKV, D, BS, P, G = 256, 12, 2, 128, 16, 128, 8
res = []
for L in (192, 384, 640):
    nb = -(-L // BS); pb = P // BS
    pool = B * nb + 64
    k = torch.randn(pool, HKV, BS, D, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
    q = torch.randn(B, HQ, D, device=dev, dtype=torch.bfloat16)
    perm = torch.randperm(pool, device=dev).int()
    distinct = perm[: B * nb].view(B, nb).contiguous()
    shared = distinct.clone()
    for g in range(B // G):
        shared[g * G:(g + 1) * G, :pb] = distinct[g * G, :pb]
    suffix = distinct[:, pb:].contiguous()
    lens = torch.full((B,), L, device=dev, dtype=torch.int32)
    slens = lens - P
    sp = split_count(B, HKV, nb, BS, 132)
    row = {"L": L, "splits": sp}
    for name, t, ln in (("shared", shared, lens), ("distinct", distinct, lens), ("suffix_only", suffix, slens)):
        row[name + "_us"] = bdk.graph_time_us(lambda: decode_attention_triton(q, k, v, t, ln, 0.088, sp))
    for name, t, ln in (("shared_s2", shared, lens), ("distinct_s2", distinct, lens)):
        row[name + "_us"] = bdk.graph_time_us(lambda: decode_attention_triton(q, k, v, t, ln, 0.088, 2))
    row["kv_bytes_distinct"] = B * L * HKV * D * 2 * 2
    row["bound_distinct_us"] = row["kv_bytes_distinct"] / 4.8e12 * 1e6
    row["bound_suffix_us"] = B * (L - P) * HKV * D * 4 / 4.8e12 * 1e6
    print(row, flush=True); res.append(row)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "prefix_exp.json"), "w"), indent=1)
