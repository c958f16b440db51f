"""Scratch of session 21, kept as run (call 7; its copy of the row kernel since imported from attn_heads.py, the
same text; from the repo root on the device: PYTHONPATH=. python3 <this file>).
Split kernel vs row kernel at 1.5B shapes, timed over 4 KV caches in turn (no L2 reuse between calls)
against the same cache every call."""
import json, os, sys, statistics
sys.path.insert(0, "tools")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from attn_heads import row_attention  # session 21's row kernel, as run
from hybridrl.engines.kernels.attention import decode_attention_triton


def timed(fn, calls=20, replays=30):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3): fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls): fn(i)
    t = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); t.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(t[3:])

dev = torch.device("cuda")
hq, hkv, d, bs = 12, 2, 128, 16
res = []
for rows in (192, 256, 384):
    width = 40
    ids = 1 + torch.arange(rows * width).view(width, rows).t().contiguous()
    for g in range(0, rows, 8):
        ids[g:g + 8, :8] = ids[g, :8]
    table = ids.int().to(dev)
    caches = [(torch.randn(1 + rows * width, hkv, bs, d, device=dev, dtype=torch.bfloat16),
               torch.randn(1 + rows * width, hkv, bs, d, device=dev, dtype=torch.bfloat16)) for _ in range(4)]
    q = torch.randn(rows, hq, d, device=dev, dtype=torch.bfloat16)
    for keys in (384, 640):
        lens = torch.full((rows,), keys, dtype=torch.int32, device=dev)
        r = {"rows": rows, "keys": keys}
        for name, fn in (("split", lambda k, v: decode_attention_triton(q, k, v, table, lens, d**-0.5, 1)),
                         ("rows", lambda k, v: row_attention(q, k, v, table, lens, d**-0.5, 64, 8, 3))):
            r[name + "_same_us"] = timed(lambda i: fn(*caches[0]))
            r[name + "_rotated_us"] = timed(lambda i: fn(*caches[i % 4]))
        res.append(r)
        print(json.dumps(r), flush=True)
open(os.path.join(os.environ.get("OUT", "."), "attn_rotated.json"), "w").write(json.dumps(res, indent=1))
