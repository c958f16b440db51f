"""Launch sweeps of the native engine's decode kernels on one GPU, each op timed inside a CUDA graph (as the engine runs
it): 20 calls per graph, the median of replays, every configuration side by side in one process. Prints JSON; the
`gpu` field names the device the microseconds are from. Needs CUDA and Triton.

  linear     the projections: cuBLAS (F.linear) against the Triton skinny GEMM over tiles and K splits; per shape
             cuBLAS µs, the best Triton config (with one split, and overall), the weight-read bound, the largest
             difference from cuBLAS
  pairs      each skinny projection with the kernel that consumes it (qkv → rope_write, o_proj and down_proj →
             add_rms_norm), over K splits and the consumer's warps, against cuBLAS + the consumer
  attention  paged decode attention over key splits, keys per tile, warps and pipeline stages, on the block tables the
             engine's scheduler hands out (`engine_tables`); the engine's current choice beside the best, and the
             K/V-read bound
  batched    the batched cuBLAS split (`linear.linear_batched`: float32 K slices) against F.linear, each alone and
             with the `add_rms_norm` that consumes it, for the row-parallel projections at 128 and 256 rows
  rope       `rope_write` over heads per program and warps, with --rope-baseline FILE another module's timed beside
  blas       each projection (and the lm_head) in F.linear under each of torch's BLAS backends (cuBLAS, cuBLASLt)
  sampler    the fused sampler (`sampling_kernel.sample_counter`) over segments per row, blocks per step and warps,
             beside the torch path and, with --sampler-baseline FILE, another module's `sample_counter` (an A/B of
             a kernel change in one process)

    python -m benchmarks.kernels --what linear attention --shapes 0.5b 1.5b --out kernels.json

JSON: the device labels (`device`, `gpu`, versions) and one object per sweep keyed by model shape (`shapes` holds the
linear sweep's rows; `sampler` is keyed by decode rows) with its timings and, where it sweeps, the best.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import add_out_arg, device_info, emit
from hybridrl.engines.native.kernels import sampling as sampling_kernel
from hybridrl.engines.native.kernels.attention import decode_attention_triton, pipeline_stages, split_count, tile_keys
from hybridrl.engines.native.kernels.linear import batched_splits, linear_batched, linear_triton, skinny_plan
from hybridrl.engines.native.kernels.norms import add_rms_norm_triton
from hybridrl.engines.native.kernels.rope_cache import rope_write_triton

# (name, rows, N, K, bias): the fused projections of one layer at the benchmark's decode batch, and the lm_head.
SHAPES = {
    "0.5b": [
        ("qkv", 64, 1152, 896, True),
        ("o", 64, 896, 896, False),
        ("gate_up", 64, 9728, 896, False),
        ("down", 64, 896, 4864, False),
    ],
    "1.5b": [
        ("qkv", 256, 2048, 1536, True),
        ("o", 256, 1536, 1536, False),
        ("gate_up", 256, 17920, 1536, False),
        ("down", 256, 1536, 8960, False),
    ],
}
# (rows, q heads, kv heads, head dim, shortest and longest context, rows per prompt): the benchmarks' decode batches,
# the 0.5B's 64 distinct prompts and the 1.5B's GRPO groups of 8, all with 128-token prompts.
ATTENTION = {"0.5b": (64, 14, 2, 64, 128, 384, 1), "1.5b": (256, 12, 2, 128, 128, 640, 8)}
HBM_BYTES_PER_S = 4.8e12  # H200 datasheet


def graph_time_us(fn, calls: int = 20, replays: int = 30) -> float:
    """Median µs per call of fn() captured `calls` times in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(times[3:])


def bench_shape(name: str, m: int, n: int, k: int, bias: bool) -> dict:
    """One projection of `m` rows × `n` outputs × `k` inputs: cuBLAS against every Triton skinny-GEMM config."""
    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    b = torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None
    ref = F.linear(x, w, b)
    row = {
        "name": name,
        "rows": m,
        "n": n,
        "k": k,
        "bound_us": n * k * 2 / HBM_BYTES_PER_S * 1e6,
        "cublas_us": graph_time_us(lambda: F.linear(x, w, b)),
    }
    results = []
    # Few rows: narrow tiles and 4 warps (a weight-read-bound GEMM); more rows: the taller tiles and 8 warps of a
    # compute-bound one.
    block_ms, block_ns, block_ks, warp_set = (
        ([64], [16, 32, 64, 128], [64, 128, 256], [4]) if m <= 64 else ([64, 128], [64, 128, 256], [64, 128], [4, 8])
    )
    for bm, bn, bk, splits, stages, warps in itertools.product(
        block_ms, block_ns, block_ks, [1, 2, 4, 8], [3, 4], warp_set
    ):
        if bn * bk * 2 * stages + bm * bk * 2 * stages > 200_000 or (n // bn) * splits > 8192:
            continue
        kw = dict(splits=splits, block_n=bn, block_k=bk, block_m=bm, stages=stages, warps=warps)
        try:
            out = linear_triton(x, w, b, **kw)
            got = out if out.dim() == 2 else out.sum(0).to(x.dtype)
            err = (got.float() - ref.float()).abs().max().item()
            us = graph_time_us(lambda: linear_triton(x, w, b, **kw))
        except Exception as e:  # noqa: BLE001 - a config that does not fit the SM is skipped
            results.append({**kw, "error": type(e).__name__})
            continue
        results.append({**kw, "us": us, "max_abs_diff": err})
    ok = [r for r in results if "us" in r]
    best = min(ok, key=lambda r: r["us"])
    best1 = min((r for r in ok if r["splits"] == 1), key=lambda r: r["us"])
    row.update(
        best=best,
        best_one_split=best1,
        speedup=row["cublas_us"] / best["us"],
        speedup_one_split=row["cublas_us"] / best1["us"],
        configs=len(ok),
        top5=sorted(ok, key=lambda r: r["us"])[:5],
    )
    return row


def bench_pairs(shape: str) -> list[dict]:
    """Projection + consumer, timed together: F.linear then the consumer on its bf16 output, against the skinny
    kernel's partials summed by the consumer."""
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    hq, hkv, d = ATTENTION[shape][1:4]
    out = []
    for name, m, n, k, bias in SHAPES[shape]:
        if name == "gate_up":
            continue
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        b = torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None
        if name == "qkv":
            cache = [torch.zeros(m + 1, hkv, 16, d, device=dev, dtype=torch.bfloat16) for _ in range(2)]
            cos = torch.randn(4096, d, device=dev, dtype=torch.bfloat16)
            sin = torch.randn_like(cos)
            pos = torch.arange(m, device=dev) * 7
            slots = torch.arange(m, device=dev) * 16 + 16

            def consume(y, warps, cache=cache, cos=cos, sin=sin, pos=pos, slots=slots):
                rope_write_triton(y, hq, hkv, cos, sin, pos, slots, *cache, None, None, 1e-6, warps=warps)

            warp_set = [1, 2, 4] if m <= 64 else [2, 4]
        else:
            x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
            nw = torch.ones(n, device=dev, dtype=torch.bfloat16)

            def consume(y, warps, x=x, nw=nw):
                add_rms_norm_triton(x, y, nw, 1e-6, warps=warps)

            warp_set = [1, 2, 4, 8] if m <= 64 else [4, 8]
        plan = skinny_plan(m, n, k, sms)
        row = {
            "shape": shape,
            "name": name,
            "rows": m,
            "n": n,
            "k": k,
            "plan": plan._asdict() if plan else None,
            "cublas": {w_: graph_time_us(lambda w_=w_: consume(F.linear(a, w, b), w_)) for w_ in warp_set},
        }
        res = []
        # Few rows: the skinny tiles; more rows: taller tiles and 8 GEMM warps too.
        tiles = [(64, 32, 4), (64, 64, 4)] if m <= 64 else [(64, 64, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8)]
        for splits, (bm, bn, gemm_warps), warps in itertools.product([1, 2, 4, 8], tiles, warp_set):
            bk = 128 if k // splits >= 512 and bn <= 64 else 64
            kw = dict(splits=splits, block_n=bn, block_k=bk, block_m=bm, warps=gemm_warps)
            us = graph_time_us(lambda kw=kw, warps=warps: consume(linear_triton(a, w, b, **kw), warps))
            res.append({**kw, "consumer_warps": warps, "us": us})
        row["best"] = min(res, key=lambda r: r["us"])
        row["plan_us"] = {
            r["consumer_warps"]: r["us"]
            for r in res
            if plan and (r["splits"], r["block_n"], r["block_k"], r["block_m"], r["warps"]) == (*plan, 64, 4)
        }
        row["all"] = res
        out.append(row)
    return out


def engine_tables(rows: int, group: int, prompt_len: int, new_tokens: int, block_size: int) -> torch.Tensor:
    """Block tables [rows, blocks a row can write] as the fused engine's scheduler gives them to `rows` sequences
    admitted at once (`Scheduler._give_blocks`), `group` consecutive rows per prompt: a group's first row takes the
    prompt's full blocks (then shared by the group) and each row its own blocks (a partial prompt block, and every block
    its new tokens will fill) in one run, with ids ascending from 1 as the allocator's free list hands them out. Decode
    attention's speed depends on this layout: a shuffled table, or rows interleaved block by block, would time the
    kernels on memory the engine never reads."""
    full = prompt_len // block_size
    total = -(-(prompt_len + new_tokens - 1) // block_size)
    table = torch.zeros(rows, total, dtype=torch.int32)
    next_id = 1
    for r in range(rows):
        if r % group == 0:
            shared = torch.arange(next_id, next_id + full, dtype=torch.int32)
            next_id += full
        table[r, :full] = shared
        table[r, full:] = torch.arange(next_id, next_id + total - full, dtype=torch.int32)
        next_id += total - full
    return table


def bench_attention(shape: str, block_size: int = 16) -> dict:
    """The split kernel over its launch settings at the shape's decode batch, on the engine's block tables
    (`engine_tables`) with each row at a random context between the shortest and the longest."""
    rows, hq, hkv, d, shortest, longest, group = ATTENTION[shape]
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(shortest, longest + 1, (rows,), generator=gen)
    table = engine_tables(rows, group, shortest, longest - shortest + 1, block_size).to(dev)
    width = table.shape[1]
    k = torch.randn(int(table.max()) + 1, hkv, block_size, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(rows, hq, d, device=dev, dtype=torch.bfloat16)
    seq_lens = lens.to(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    current = split_count(rows, hkv, width, block_size, sms)
    ref = decode_attention_triton(q, k, v, table, seq_lens, d**-0.5, current)
    mean_len = lens.float().mean().item()
    row = {
        "shape": shape,
        "rows": rows,
        "q_heads": hq,
        "kv_heads": hkv,
        "head_dim": d,
        "mean_len": mean_len,
        "bound_us": rows * mean_len * hkv * d * 2 * 2 / HBM_BYTES_PER_S * 1e6,
        "current": {
            "splits": current,
            "tile_keys": tile_keys(d),
            "warps": 4,
            "stages": pipeline_stages(rows * hkv, sms),
        },
    }
    results = []
    # Splits only help when rows × kv heads leave SMs idle; at more rows the sweep tries pipeline depths instead.
    few = rows * hkv < sms
    split_set, warp_set, stage_set = (
        ([1, 2, 3, 4, 6, 8, 12], [1, 2, 4, 8], [3]) if few else ([1, 2], [2, 4, 8], [2, 3, 4])
    )
    for splits, tile, warps, stages in itertools.product(split_set, [32, 64, 128], warp_set, stage_set):
        kw = dict(n_splits=splits, keys=tile, warps=warps, stages=stages)
        try:
            err = (decode_attention_triton(q, k, v, table, seq_lens, d**-0.5, **kw).float() - ref.float()).abs().max()
            us = graph_time_us(lambda: decode_attention_triton(q, k, v, table, seq_lens, d**-0.5, **kw))
        except Exception as e:  # noqa: BLE001 - a config that does not fit is skipped
            results.append({**kw, "error": type(e).__name__})
            continue
        results.append({**kw, "us": us, "max_abs_diff": err.item()})
    ok = [r for r in results if "us" in r]
    row["current"]["us"] = next(
        r["us"]
        for r in ok
        if (r["n_splits"], r["keys"], r["warps"], r["stages"]) == (current, tile_keys(d), 4, row["current"]["stages"])
    )
    row["best"] = min(ok, key=lambda r: r["us"])
    row["speedup"] = row["current"]["us"] / row["best"]["us"]
    row["top8"] = sorted(ok, key=lambda r: r["us"])[:8]
    row["all"] = ok
    return row


def bench_batched(shape: str) -> list[dict]:
    """o_proj and down_proj (no bias, consumed by add_rms_norm) at 128 and 256 rows: F.linear against K slices."""
    dev = torch.device("cuda")
    out = []
    for name, _, n, k, bias in SHAPES[shape]:
        if name not in ("o", "down"):
            continue
        for m in (128, 256):
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
            x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
            nw = torch.ones(n, device=dev, dtype=torch.bfloat16)
            ref = F.linear(a, w).float()
            row = {
                "shape": shape,
                "name": name,
                "rows": m,
                "n": n,
                "k": k,
                "plan": batched_splits(m, n, k),
                "cublas_us": graph_time_us(lambda: F.linear(a, w)),
                "cublas_with_norm_us": graph_time_us(lambda: add_rms_norm_triton(x, F.linear(a, w), nw, 1e-6)),
            }
            for splits in (2, 4, 8):
                if k % (splits * 8):
                    continue
                got = linear_batched(a, w, splits).sum(0)
                row[f"split{splits}"] = {
                    "us": graph_time_us(lambda splits=splits: linear_batched(a, w, splits)),
                    "with_norm_us": graph_time_us(
                        lambda splits=splits: add_rms_norm_triton(x, linear_batched(a, w, splits), nw, 1e-6)
                    ),
                    "max_abs_diff": (got - ref).abs().max().item(),
                }
            out.append(row)
    return out


def bench_blas(shape: str) -> list[dict]:
    """F.linear per projection under `torch.backends.cuda.preferred_blas_library` cublas and cublaslt."""
    dev = torch.device("cuda")
    rows = SHAPES[shape][0][1]
    vocab_rows = 151936
    hidden = SHAPES[shape][1][2]
    out = []
    for name, m, n, k, bias in [*SHAPES[shape], ("lm_head", rows, vocab_rows, hidden, False)]:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        b = torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None
        row = {"name": name, "rows": m, "n": n, "k": k, "bound_us": n * k * 2 / HBM_BYTES_PER_S * 1e6}
        before = torch.backends.cuda.preferred_blas_library()
        try:
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                row[f"{lib}_us"] = graph_time_us(lambda: F.linear(a, w, b))
        finally:
            torch.backends.cuda.preferred_blas_library(before)
        out.append(row)
    return out


def load_module(path: str, name: str):
    """A module from a file (a previous version of one of ours, for an A/B in one process)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench_rope(shape: str, baseline_file: str | None) -> dict:
    """rope_write at the shape's decode batch (Qwen2: no q/k norm; 16-position blocks), on a bf16 qkv and, where the
    skinny GEMM plans qkv at that batch, on its float32 partials."""
    from hybridrl.engines.native.kernels import rope_cache

    rows, hq, hkv, d = ATTENTION[shape][:4]
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    n = (hq + 2 * hkv) * d
    qkv = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
    cos = torch.randn(4096, d, device=dev, dtype=torch.bfloat16)
    sin = torch.randn_like(cos)
    pos = torch.arange(rows, device=dev) * 7
    slots = torch.arange(rows, device=dev) * 16 + 16
    cache = [torch.zeros(rows + 1, hkv, 16, d, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    inputs = {"bf16": qkv}
    plan = skinny_plan(rows, n, SHAPES[shape][0][3], sms)
    if plan is not None and plan.splits > 1:  # the partials rope_write sums in the engine at this batch
        inputs[f"partials{plan.splits}"] = (qkv.float() / plan.splits).expand(plan.splits, rows, n).contiguous()
    base = load_module(baseline_file, "rope_baseline") if baseline_file else None
    out = {"shape": shape, "rows": rows, "heads": hq + 2 * hkv, "head_dim": d}
    for name, x in inputs.items():
        row = {}
        if base is not None:
            row["baseline_us"] = graph_time_us(
                lambda x=x: base.rope_write_triton(x, hq, hkv, cos, sin, pos, slots, *cache, None, None, 1e-6)
            )
        res = []
        for heads, warps in itertools.product([1, 2, 4, 8, 16, 32], [1, 2, 4]):
            kw = dict(heads=heads, warps=warps)
            res.append(
                {
                    **kw,
                    "us": graph_time_us(
                        lambda kw=kw, x=x: rope_cache.rope_write_triton(
                            x, hq, hkv, cos, sin, pos, slots, *cache, None, None, 1e-6, **kw
                        )
                    ),
                }
            )
        launch = rope_cache.rope_launch(x.dim() == 3)
        row["current"] = next(r for r in res if (r["heads"], r["warps"]) == launch)
        row["best"] = min(res, key=lambda r: r["us"])
        row["all"] = res
        out[name] = row
    return out


def bench_sampler(rows: int, baseline_file: str | None, vocab: int = 151936) -> dict:
    """The fused sampler at Qwen's vocabulary over bf16 logits (the engine's dtype), temperature 1."""
    from hybridrl.engines.sampling import sample_tokens, step_key

    dev = torch.device("cuda")
    logits = torch.randn(rows, vocab, device=dev).to(torch.bfloat16) * 3
    keys = (torch.arange(rows, device=dev, dtype=torch.int64) * 2654435761 + 97) ^ 0x5DEECE66D
    key = step_key(3)
    torch_tok, _ = sample_tokens(logits, 1.0, keys=keys, step=3, kernel=False)
    row = {
        "rows": rows,
        "vocab": vocab,
        "read_bound_us": rows * vocab * 2 / HBM_BYTES_PER_S * 1e6,
        "torch_path_us": graph_time_us(
            lambda: sample_tokens(logits, 1.0, keys=keys, step=3, kernel=False), calls=2, replays=10
        ),
    }
    if baseline_file:
        base = load_module(baseline_file, "sampler_baseline")
        tok, _ = base.sample_counter(logits, 1.0, keys, key)
        mine, mine_lp = sampling_kernel.sample_counter(logits, 1.0, keys, key)
        base_lp = base.sample_counter(logits, 1.0, keys, key)[1]
        row["baseline"] = {
            "us": graph_time_us(lambda: base.sample_counter(logits, 1.0, keys, key)),
            "same_tokens_as_torch": float((tok == torch_tok).float().mean()),
            "same_tokens_as_current": float((tok == mine).float().mean()),
            "logprob_max_diff_to_current": float((base_lp - mine_lp).abs().max()),
        }
    res = []
    for segments, sub, warps in itertools.product([4, 8, 16, 32], [1, 2, 4], [4, 8]):
        kw = dict(segments=segments, sub=sub, warps=warps)
        tok, _ = sampling_kernel.sample_counter(logits, 1.0, keys, key, **kw)
        res.append(
            {
                **kw,
                "us": graph_time_us(lambda kw=kw: sampling_kernel.sample_counter(logits, 1.0, keys, key, **kw)),
                "same_tokens_as_torch": float((tok == torch_tok).float().mean()),
            }
        )
    row["current"] = next(
        r
        for r in res
        if (r["segments"], r["sub"], r["warps"])
        == (sampling_kernel.segments_for(rows), sampling_kernel._SUB, sampling_kernel._WARPS)
    )
    # How often the kernel's draw is the torch path's over 16 steps (they round differently: see sampling_kernel).
    same = [
        (
            sample_tokens(logits, 1.0, keys=keys, step=s)[0]
            == sample_tokens(logits, 1.0, keys=keys, step=s, kernel=False)[0]
        )
        for s in range(16)
    ]
    row["same_tokens_as_torch_16_steps"] = float(torch.stack(same).float().mean())
    row["best"] = min(res, key=lambda r: r["us"])
    row["all"] = res
    return row


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m benchmarks.kernels`."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--what",
        nargs="+",
        default=["linear", "attention"],
        choices=("linear", "pairs", "attention", "sampler", "blas", "batched", "rope"),
        help="the sweeps to run (see above)",
    )
    ap.add_argument(
        "--shapes", nargs="+", default=["0.5b", "1.5b"], choices=sorted(SHAPES), help="the models' decode shapes"
    )
    ap.add_argument(
        "--sampler-baseline", metavar="FILE", help="a module file whose sample_counter is timed beside the current one"
    )
    ap.add_argument(
        "--rope-baseline", metavar="FILE", help="a module file whose rope_write_triton is timed beside the current one"
    )
    add_out_arg(ap)
    return ap


def main() -> None:
    """Run the benchmark the command line describes and print its JSON."""
    args = parser().parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks.kernels times Triton kernels in CUDA graphs: it needs a CUDA device (none is visible)"
        )
    report = {
        **device_info(torch.device("cuda", 0)),
        "shapes": {},
        "attention": {},
        "pairs": {},
        "sampler": {},
        "blas": {},
        "batched": {},
        "rope": {},
    }

    def save() -> None:  # after each sweep, so a run cut short keeps what it measured
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    if "sampler" in args.what:
        for rows in (64, 256):
            report["sampler"][rows] = bench_sampler(rows, args.sampler_baseline)
            save()
    # One report entry per shape, in this order.
    per_shape = {
        "blas": bench_blas,
        "batched": bench_batched,
        "rope": lambda s: bench_rope(s, args.rope_baseline),
        "attention": bench_attention,
        "pairs": bench_pairs,
    }
    for s in args.shapes:
        for what, bench in per_shape.items():
            if what in args.what:
                report[what][s] = bench(s)
                save()
        if "linear" in args.what:
            for shape in SHAPES[s]:
                report["shapes"].setdefault(s, []).append(bench_shape(*shape))
                save()
    emit(report, args.out)


if __name__ == "__main__":
    main()
