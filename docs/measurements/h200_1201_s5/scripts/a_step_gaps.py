# Experiment of call a_ (docs/measurements/README.md, fifth 2026-12-01 session), kept as run. From the repo root
# on the device: PYTHONPATH=. python3 docs/measurements/h200_1201_s5/scripts/a_step_gaps.py
"""Where a 1.5B decode step's time goes at 256 rows: every kernel inside the graph replays of one warm GRPO-shaped
generate (32 prompts x 8 samples, prompt 128, N new tokens), from the profiler's CUDA events: per kernel name the
count and mean time, and over the decode phase the span, the busy time and the idle gaps between kernels."""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(root / "tools"))
sys.path.insert(0, str(root))
import bench_engine as be  # noqa: E402
from hybridrl.engines.base import SamplingParams  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--new", type=int, default=96)
ap.add_argument("--out", required=True)
a = ap.parse_args()
dev = torch.device("cuda")
model = be.build_model("1.5b", torch.bfloat16, dev)
# no_rope_attention: added after the run, when bench_engine gained --no-rope-attention (False: the engine's default).
args = argparse.Namespace(no_cuda_graphs=False, no_kernels=False, kv_block_size=16, no_skinny_gemm=False,
                          no_rope_attention=False)
engine = be.build_engine(model, args, 256)
gen = torch.Generator().manual_seed(2)
prompts = torch.randint(2, model.config.vocab_size, (32, 128), generator=gen).tolist()
params = SamplingParams(n=8, temperature=1.0, max_new_tokens=a.new, seed=0)
for _ in range(3):
    engine.cache.allocator.forget_prefixes() if engine.cache is not None else None
    engine.generate(prompts, params)
torch.cuda.synchronize()
engine.cache.allocator.forget_prefixes()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    engine.generate(prompts, params)
    torch.cuda.synchronize()
ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
ev = sorted(ev, key=lambda e: e.time_range.start)
starts = [i for i, e in enumerate(ev) if "_segment_kernel" in e.name]
# Decode steps: from the kernel after one sampler's combine to the next combine (the middle steps only).
combines = [i for i, e in enumerate(ev) if "_combine_kernel" in e.name]
steps = []
for i0, i1 in zip(combines[4:-4], combines[5:-3]):
    ks = ev[i0 + 1: i1 + 1]
    span = ks[-1].time_range.end - ev[i0].time_range.end
    busy = sum(k.time_range.end - k.time_range.start for k in ks)
    steps.append({"kernels": len(ks), "span_us": span, "busy_us": busy})
by = defaultdict(list)
for i0, i1 in zip(combines[4:-4], combines[5:-3]):
    for k in ev[i0 + 1: i1 + 1]:
        by[k.name[:90]].append(k.time_range.end - k.time_range.start)
n = len(steps)
table = sorted(({"name": k, "per_step": len(v) / n, "mean_us": sum(v) / len(v), "us_per_step": sum(v) / n}
                for k, v in by.items()), key=lambda r: -r["us_per_step"])
gaps = []
for i0, i1 in zip(combines[4:-4], combines[5:-3]):
    ks = ev[i0: i1 + 1]
    gaps += [b.time_range.start - p.time_range.end for p, b in zip(ks, ks[1:])]
gaps.sort()
med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
res = {"steps": n, "span_us_median": med([s["span_us"] for s in steps]),
       "busy_us_median": med([s["busy_us"] for s in steps]), "kernels_per_step": med([s["kernels"] for s in steps]),
       "gap_us_median": gaps[len(gaps) // 2], "gap_us_p90": gaps[int(len(gaps) * 0.9)],
       "gap_us_sum_per_step": sum(gaps) / n, "table": table}
Path(a.out).write_text(json.dumps(res, indent=1))
print(json.dumps({k: v for k, v in res.items() if k != "table"}, indent=1))
for r in table[:25]:
    print(f"{r['us_per_step']:8.1f} us/step  {r['per_step']:5.1f}x  {r['mean_us']:7.2f} us  {r['name']}")
