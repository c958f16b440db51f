"""Benchmark the resharding manager on random-init Qwen2.5 shapes, against a plain state_dict copy; prints JSON.

    python tools/bench_reshard.py --shape 0.5b --device cpu --style fused --tp-size 2 --repeat 3
    python tools/bench_reshard.py --shape 7b --device cuda --style hf

The model (bf16) is built on the device (meta → to_empty → random init), wrapped with fully_shard at world size
1 (per decoder layer + root), and synced into a stand-in engine that holds preallocated destination tensors on the
same device. Baseline: `state_dict()`, `.full_tensor()` and `copy_` of every tensor into HF-named destinations.
On CPU use --shape tiny or 0.5b.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridrl.reshard import ReshardConfig, Resharder, build_layout  # noqa: E402
from hybridrl.reshard.testing import TensorDictEngine  # noqa: E402

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
    config = transformers.Qwen2Config(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads,
                                      num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                                      tie_word_embeddings=tied)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device=device)  # no forward is run, so meta-built buffers (rotary) need no re-init
    if tied:  # to_empty gives each module its own tensor; restore the tie
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05)
    return model


def wrap_fsdp(model: torch.nn.Module, device: torch.device) -> None:
    """fully_shard per decoder layer + root on a 1-rank mesh."""
    mesh = init_device_mesh(device.type, (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


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
    return {k: statistics.median(r[k] for r in runs) if isinstance(runs[0][k], (int, float)) and runs[0][k] is not None
            else runs[0][k] for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--style", choices=["hf", "fused"], default="fused")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--verify", action="store_true", help="after timing, run one sync with verify=True")
    args = ap.parse_args()

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = tempfile.mktemp(prefix="bench_reshard_store_")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            store=dist.FileStore(store, 1), rank=0, world_size=1)
    t0 = time.perf_counter()
    model = build_model(args.shape, device)
    n_params = sum(p.numel() for p in model.parameters())
    wrap_fsdp(model, device)
    build_s = time.perf_counter() - t0

    config = model.config
    layout = build_layout(config, args.style, args.tp_rank, args.tp_size)
    engine = TensorDictEngine.from_layout(layout, dtype=torch.bfloat16, device=device, fill=0.0)
    resharder = Resharder(ReshardConfig(bucket_mb=args.bucket_mb), engine, config,
                          tp_rank=args.tp_rank, tp_size=args.tp_size, style=args.style)
    hf_dst = {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in layout.shape.hf_shapes().items()}

    resharder.sync(model)  # warm-up (allocator, first collective)
    baseline(model, hf_dst, device)
    runs, base_runs = [], []
    for _ in range(args.repeat):  # interleaved, so both see the same machine load
        runs.append(resharder.sync(model).as_dict())
        base_runs.append(baseline(model, hf_dst, device))
    r, b = median_dict(runs), median_dict(base_runs)
    result = {
        "shape": args.shape, "device": str(device), "style": args.style, "tp_size": args.tp_size,
        "bucket_mb": args.bucket_mb, "dtype": "bfloat16", "params": n_params, "repeat": args.repeat,
        "build_s": round(build_s, 2),
        "reshard": {
            "seconds": r["total_s"], "bytes_moved": r["bytes_moved"], "gb_per_s": r["bytes_moved"] / r["total_s"] / 1e9,
            "peak_extra_bytes": r["peak_extra_bytes"], "cuda_peak_delta_bytes": r["cuda_peak_delta_bytes"],
            "pushes": r["pushes"], "tensors": r["tensors"],
            "phases_s": {k: r[k] for k in ("gather_s", "fuse_split_s", "deliver_s")},
        },
        "baseline_state_dict_copy": {**b, "gb_per_s": b["bytes"] / b["seconds"] / 1e9},
        "ratio_reshard_over_baseline": r["total_s"] / b["seconds"],
    }
    if args.verify:
        resharder.config.verify = True
        result["verify_s"] = resharder.sync(model).verify_s
        result["verified"] = True
    print(json.dumps(result, indent=2))
    dist.destroy_process_group()
    os.unlink(store) if os.path.exists(store) else None
    sys.stdout.flush()
    os._exit(0)  # processes that used DeviceMesh sometimes abort at interpreter exit


if __name__ == "__main__":
    main()
