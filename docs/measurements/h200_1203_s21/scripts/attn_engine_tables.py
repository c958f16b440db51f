"""For the next session (written in session 21, not yet run): do the kernel benches predict the engine once they time
attention on the engine's block tables? Session 21's row kernel (one program per row over both kv heads) beat the split
kernel alone on tables whose rows took their blocks in turn (`f_attn_rotated.json`) and lost in the engine, whose
scheduler gives each row one run of blocks (`bench_decode_kernels.engine_tables`). Here both kernels, 1.5B shape, GRPO
groups of 8 with 128-token prompts, on both layouts. If the row kernel loses on the engine's tables, the benches' old
tables explain session 21's (and session 8's) disagreement. From the repo root on the device:
PYTHONPATH=. python3 docs/measurements/h200_1203_s21/scripts/attn_engine_tables.py"""
import json, os, sys, statistics
sys.path.insert(0, "tools")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from attn_heads import row_attention  # session 21's row kernel, as run
from bench_decode_kernels import engine_tables, graph_time_us
from hybridrl.engines.kernels.attention import decode_attention_triton


dev = torch.device("cuda")
hq, hkv, d, bs = 12, 2, 128, 16
res = []
for rows in (192, 256, 384):
    engine = engine_tables(rows, 8, 128, 513, bs)
    width = engine.shape[1]
    turns = 1 + torch.arange(rows * width).view(width, rows).t().contiguous()  # rows take blocks in turn
    for g in range(0, rows, 8):
        turns[g:g + 8, :8] = turns[g, :8]
    q = torch.randn(rows, hq, d, device=dev, dtype=torch.bfloat16)
    for layout, table in (("engine", engine), ("in_turn", turns)):
        table = table.int().to(dev)
        k = torch.randn(int(table.max()) + 1, hkv, bs, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for keys in (200, 384, 640):
            lens = torch.full((rows,), keys, dtype=torch.int32, device=dev)
            r = {"rows": rows, "layout": layout, "keys": keys,
                 "split_us": graph_time_us(lambda: decode_attention_triton(q, k, v, table, lens, d**-0.5, 1)),
                 "rows_us": graph_time_us(lambda: row_attention(q, k, v, table, lens, d**-0.5, 64, 8, 3))}
            res.append(r)
            print(json.dumps(r), flush=True)
open(os.path.join(os.environ.get("OUT", "."), "attn_engine_tables.json"), "w").write(json.dumps(res, indent=1))
