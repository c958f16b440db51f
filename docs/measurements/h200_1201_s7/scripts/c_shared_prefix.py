"""Call 3 (session 7), as run: shared_prefix_attention (then with num_stages=3 by default; `shared_s2_us` is 2, now the
default) beside the split kernel at GRPO shapes, graph-timed."""
import json, os, sys, importlib.util
import torch
spec = importlib.util.spec_from_file_location("bdk", "tools/bench_decode_kernels.py"); bdk = importlib.util.module_from_spec(spec); spec.loader.exec_module(bdk)
from hybridrl.engines.kernels.attention import decode_attention_triton, decode_attention_torch, split_count
from hybridrl.engines.kernels import shared_prefix as sp
dev = torch.device("cuda")
res = []
for shape, B, HQ, HKV, D, P, G in (("1.5b", 256, 12, 2, 128, 128, 8), ("1.5b_p512", 256, 12, 2, 128, 512, 8),
                                   ("0.5b", 256, 14, 2, 64, 128, 8), ("1.5b_b128", 128, 12, 2, 128, 128, 8),
                                   ("1.5b_g16", 256, 12, 2, 128, 128, 16)):
    BS = 16
    for L in (P + 64, P + 256, P + 512):
        nb = -(-L // BS); pb = P // BS
        pool = B * nb + 64
        k = torch.randn(pool, HKV, BS, D, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
        q = torch.randn(B, HQ, D, device=dev, dtype=torch.bfloat16)
        perm = torch.randperm(pool, device=dev).int()
        table = perm[: B * nb].view(B, nb).contiguous()
        for g in range(B // G):
            table[g * G:(g + 1) * G, :pb] = table[g * G, :pb]
        lens = torch.full((B,), L, device=dev, dtype=torch.int32)
        spl = split_count(B, HKV, nb, BS, 132)
        members = sp.slot_members(HQ, HKV)
        groups = sp.prefix_groups(table.tolist(), [L] * B, BS, members)
        packed = torch.tensor(sp.pack_prefix(groups, B, members), dtype=torch.int32, device=dev)
        ns = B // 2
        prefix = sp.SharedPrefix(packed[: ns * (members + 1)].view(ns, members + 1), packed[ns * (members + 1):])
        ref = decode_attention_torch(q, k, v, table, lens, nb * BS, D ** -0.5)
        got = sp.shared_prefix_attention(q, k, v, table, lens, D ** -0.5, prefix)
        row = {"shape": shape, "L": L, "splits": spl, "slots_used": len(groups), "members": members,
               "max_abs_diff": (got.float() - ref.float()).abs().max().item(),
               "plain_us": bdk.graph_time_us(lambda: decode_attention_triton(q, k, v, table, lens, D ** -0.5, spl)),
               "plain_s2_us": bdk.graph_time_us(lambda: decode_attention_triton(q, k, v, table, lens, D ** -0.5, 2)),
               "shared_us": bdk.graph_time_us(lambda: sp.shared_prefix_attention(q, k, v, table, lens, D ** -0.5, prefix)),
               "shared_w8_us": bdk.graph_time_us(lambda: sp.shared_prefix_attention(q, k, v, table, lens, D ** -0.5, prefix, warps=8)),
               "shared_s2_us": bdk.graph_time_us(lambda: sp.shared_prefix_attention(q, k, v, table, lens, D ** -0.5, prefix, stages=2))}
        row["saved_us"] = row["plain_us"] - row["shared_us"]
        print(row, flush=True); res.append(row)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "prefix_exp2.json"), "w"), indent=1)
