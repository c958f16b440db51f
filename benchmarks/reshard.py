"""Benchmark the resharding manager on random-init Qwen2.5 shapes, against a plain state_dict copy; prints JSON.

    python -m benchmarks.reshard --shape 0.5b --device cpu --style fused --tp-size 2 --repeat 3
    python -m benchmarks.reshard --shape 7b --device cuda --style hf
    python -m benchmarks.reshard --shape 7b --device cuda --workers 2 --tp-size 2    # FSDP over 2 GPUs → TP 2

The model (bf16) is built on each device (meta → to_empty → random init, the same values on every rank), sharded
the way the trainer shards it (`training.fsdp.shard_model` over the run's `Topology`: per decoder layer + root on
several ranks, the root alone on one), and synced into a stand-in engine that holds this rank's preallocated
destination tensors of its engine TP rank. With --workers 1 and --tp-size > 1 one rank plays TP rank --tp-rank
(the layout cut only). Baseline: `state_dict()`, `.full_tensor()` and `copy_` of every tensor into HF-named
destinations. On CPU use --shape tiny or 0.5b. Rank 0 prints the JSON (the slowest rank's seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

from hybridrl.reshard import ReshardConfig, Resharder, build_layout  # noqa: E402
from hybridrl.reshard.testing import TensorDictEngine  # noqa: E402
from hybridrl.topology import Topology  # noqa: E402
from hybridrl.training.fsdp import shard_model  # noqa: E402

# Qwen2.5 shapes (hidden, layers, heads, kv heads, intermediate, vocab, tied)
SHAPES = {
    "tiny": (64, 2, 4, 2, 128, 1000, True),
    "0.5b": (896, 24, 14, 2, 4864, 151936, True),
    "1.5b": (1536, 28, 12, 2, 8960, 151936, True),
    "7b": (3584, 28, 28, 4, 18944, 152064, False),
}


def build_model(shape: str, device: torch.device) -> torch.nn.Module:
    """A random bf16 Qwen2 model of `shape`, allocated directly on `device`."""
    h, n, heads, kv, inter, vocab, tied = SHAPES[shape]
    config = transformers.Qwen2Config(
        hidden_size=h,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab,
        tie_word_embeddings=tied,
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device=device)  # no forward is run, so meta-built buffers (rotary) need no re-init
    if tied:  # to_empty gives each module its own tensor; restore the tie
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05)
    return model


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def baseline(model: torch.nn.Module, dst: dict[str, torch.Tensor], device: torch.device) -> dict:
    """state_dict() full gather + copy_ of every tensor the engine holds."""
    if device.type == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    sync_device(device)
    t0 = time.perf_counter()
    moved = 0
    for name, t in model.state_dict().items():
        if name not in dst:  # a tied lm_head
            continue
        full = t.full_tensor() if isinstance(t, DTensor) else t
        dst[name].copy_(full)
        moved += full.numel() * full.element_size()
    sync_device(device)
    out = {"seconds": time.perf_counter() - t0, "bytes": moved}
    if device.type == "cuda":
        out["cuda_peak_delta_bytes"] = torch.cuda.max_memory_allocated() - base
    return out


def median_dict(runs: list[dict]) -> dict:
    return {
        k: statistics.median(r[k] for r in runs)
        if isinstance(runs[0][k], (int, float)) and runs[0][k] is not None
        else runs[0][k]
        for k in runs[0]
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--style", choices=["hf", "fused"], default="fused")
    ap.add_argument("--workers", type=int, default=1, help="ranks (processes), one device each on cuda")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--tp-rank", type=int, default=0, help="with --workers 1: which TP rank's shard to cut")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--verify", action="store_true", help="after timing, run one sync with verify=True")
    args = ap.parse_args()
    store = tempfile.mktemp(prefix="bench_reshard_store_")
    if args.workers == 1:
        run_rank(0, args, store)
    else:
        import torch.multiprocessing as mp

        mp.spawn(run_rank, args=(args, store), nprocs=args.workers, join=True)
    if os.path.exists(store):
        os.unlink(store)
    sys.stdout.flush()
    os._exit(0)  # processes that used DeviceMesh sometimes abort at interpreter exit


def run_rank(rank: int, args, store: str) -> None:
    """One rank: its shards of the model, its engine TP rank's destination tensors, the timed syncs."""
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.workers))
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.FileStore(store, args.workers),
        rank=rank,
        world_size=args.workers,
    )
    topology = Topology(args.workers, args.tp_size, rank)
    tp_rank = topology.engine_tp_rank if args.workers > 1 else args.tp_rank
    t0 = time.perf_counter()
    torch.manual_seed(0)  # the same random weights on every rank, as a checkpoint load would give
    model = build_model(args.shape, device)
    n_params = sum(p.numel() for p in model.parameters())
    shard_model(model, topology.fsdp_mesh(device.type), None)
    build_s = time.perf_counter() - t0

    config = model.config
    layout = build_layout(config, args.style, tp_rank, args.tp_size)
    engine = TensorDictEngine.from_layout(layout, dtype=torch.bfloat16, device=device, fill=0.0)
    resharder = Resharder(
        ReshardConfig(bucket_mb=args.bucket_mb), engine, config, tp_rank=tp_rank, tp_size=args.tp_size, style=args.style
    )
    hf_dst = {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in layout.shape.hf_shapes().items()}

    resharder.sync(model)  # warm-up (allocator, first collective)
    baseline(model, hf_dst, device)
    runs, base_runs = [], []
    for _ in range(args.repeat):  # interleaved, so both see the same machine load
        dist.barrier()
        runs.append(resharder.sync(model).as_dict())
        base_runs.append(baseline(model, hf_dst, device))
    slowest = [None] * args.workers
    dist.all_gather_object(slowest, (median_dict(runs), median_dict(base_runs)))
    r = max((x[0] for x in slowest), key=lambda d: d["total_s"])
    b = max((x[1] for x in slowest), key=lambda d: d["seconds"])
    result = {
        "shape": args.shape,
        "device": str(device),
        "style": args.style,
        "workers": args.workers,
        "tp_size": args.tp_size,
        "bucket_mb": args.bucket_mb,
        "dtype": "bfloat16",
        "params": n_params,
        "repeat": args.repeat,
        "build_s": round(build_s, 2),
        "reshard": {
            "seconds": r["total_s"],
            "bytes_moved_per_rank": r["bytes_moved"],
            "gb_per_s_per_rank": r["bytes_moved"] / r["total_s"] / 1e9,
            "peak_extra_bytes": r["peak_extra_bytes"],
            "cuda_peak_delta_bytes": r["cuda_peak_delta_bytes"],
            "pushes": r["pushes"],
            "tensors": r["tensors"],
            "phases_s": {k: r[k] for k in ("gather_s", "fuse_split_s", "deliver_s")},
        },
        "baseline_state_dict_copy": {**b, "gb_per_s": b["bytes"] / b["seconds"] / 1e9},
        "ratio_reshard_over_baseline": r["total_s"] / b["seconds"],
    }
    if args.verify:
        resharder.config.verify = True
        result["verify_s"] = resharder.sync(model).verify_s
        result["verified"] = True
    if rank == 0:
        text = json.dumps(result, indent=2)
        print(text)
        if os.environ.get("OUT"):
            Path(
                os.environ["OUT"], f"bench_reshard_{args.shape}_w{args.workers}_tp{args.tp_size}_{args.style}.json"
            ).write_text(text)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
