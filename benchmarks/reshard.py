"""The run's reshard phase (the actor's updated weights into the engine), against a plain state_dict copy; JSON out.

    python -m benchmarks.reshard --shape 7b --device cuda
    python -m benchmarks.reshard --shape 7b --device cuda --workers 2 --tp 2      # FSDP over 2 GPUs → engine TP 2
    python -m benchmarks.reshard --shape tiny --device cpu --workers 2 --tp 2     # the same mechanics on the CPU

Every rank builds its roles with the run's builder (`build_components`: the FSDP2 actor with its float32 master
weights, the engine of engine.name / engine.native.* and its resharder, as reshard.* sets it) and times the reshard
phase as a run calls it (`Rollout.sync(actor.model)`: the engine's weights woken, then gather → fuse → split → deliver,
layer by layer). The baseline is the plain way to move the same weights: `state_dict()`, `.full_tensor()` and `copy_`
of every tensor into full HF-named destinations of the engine's dtype. The two alternate, --repeat times each after one
warm-up of both, and the medians are compared (`ratio_reshard_over_baseline`). With --workers N the ranks are N
processes (one GPU each on cuda, gloo on the CPU); rank 0 prints the JSON with the slowest rank's medians. Times and
GB/s are the device's named in `gpu`.

JSON: the labels (`shape`, `device`, `gpu`, versions, `workers`, `tp_size`, `engine`, `style`: the engine's weight
layout, `bucket_mb`, `overrides`, `params`, `repeat`, `build_s`), `reshard` (seconds, bytes and GB/s per rank, and the
phase's `reshard/*` metrics), `baseline_state_dict_copy` (seconds, bytes, GB/s), `ratio_reshard_over_baseline`, and
with --verify `verify_s`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from benchmarks.common import (
    add_model_args,
    add_run_args,
    bench_config,
    device_info,
    emit,
    exit_now,
    make_model_dir,
    pick_device,
    sync,
)
from hybridrl.cpu_threads import configure_threads
from hybridrl.engines import engine_dtype
from hybridrl.workers.build import build_components
from hybridrl.workers.dist import STORE_FILE_ENV, init_process_group


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m benchmarks.reshard`."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.reshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(ap, "1.5b")
    ap.add_argument("--workers", type=int, default=1, help="ranks (processes), one device each on cuda")
    ap.add_argument("--tp", type=int, default=1, help="engine.tp_size")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each (the median is reported)")
    ap.add_argument("--verify", action="store_true", help="after timing, one more sync with reshard.verify=true")
    add_run_args(ap)
    return ap


def baseline_copy(model: torch.nn.Module, dst: dict[str, torch.Tensor], device: torch.device) -> dict:
    """`state_dict()`, a full gather and `copy_` of every tensor into `dst`; seconds and bytes moved."""
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0 = time.perf_counter()
    moved = 0
    for name, t in model.state_dict().items():
        if name not in dst:  # a tied lm_head
            continue
        full = t.full_tensor() if isinstance(t, DTensor) else t
        dst[name].copy_(full)
        moved += full.numel() * full.element_size()
    sync(device)
    out = {"seconds": time.perf_counter() - t0, "bytes": moved}
    if device.type == "cuda":
        out["cuda_peak_delta_bytes"] = torch.cuda.max_memory_allocated(device) - base
    return out


def baseline_destinations(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """A full tensor of `dtype` per weight of `model`, by its HF name (the tied lm_head once, as its embedding)."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    return {
        name: torch.zeros(t.shape, dtype=dtype, device=device)
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }


def median_dict(runs: list[dict]) -> dict:
    """The median of every numeric field over `runs` (others from the first run)."""
    return {
        k: statistics.median(r[k] for r in runs) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
        for k, v in runs[0].items()
    }


def run_rank(rank: int, args, path: str) -> None:
    """One rank: its roles from the builder, the alternating timed syncs and baseline copies, the JSON on rank 0."""
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    overrides = [
        f"cluster.name={'inline' if args.workers == 1 else 'local'}",
        f"cluster.workers_per_node={args.workers}",
        f"engine.tp_size={args.tp}",
        "algorithm.kl_coef=0",  # no reference model: the reshard reads the actor only
        *args.set,
    ]
    cfg = bench_config(path, device, overrides)
    configure_threads(cfg.cluster.cpu_threads, workers_on_node=args.workers, model_path=path)  # as a run's worker
    init_process_group(rank, args.workers, device, cfg.cluster.collective_timeout_s)
    t0 = time.perf_counter()
    roles = build_components(cfg, dataclasses.replace(cfg.topology(), rank=rank), device)
    build_s = time.perf_counter() - t0
    actor, rollout = roles.actor, roles.rollout
    n_params = sum(p.numel() for p in actor.model.parameters())
    dst = baseline_destinations(actor.model, engine_dtype(cfg.engine, device), device)

    rollout.sync(actor.model)  # warm-up of both (allocator, first collectives)
    baseline_copy(actor.model, dst, device)
    runs, base_runs = [], []
    for _ in range(args.repeat):  # alternating, so both see the same machine load
        dist.barrier()
        runs.append(rollout.sync(actor.model))
        base_runs.append(baseline_copy(actor.model, dst, device))
    slowest = [None] * args.workers
    dist.all_gather_object(slowest, (median_dict(runs), median_dict(base_runs)))
    r = max((x[0] for x in slowest), key=lambda d: d["reshard/seconds"])
    b = max((x[1] for x in slowest), key=lambda d: d["seconds"])
    result = {
        "shape": args.shape,
        "model_dir": args.model_dir,
        **device_info(device),
        "workers": args.workers,
        "tp_size": args.tp,
        "engine": type(rollout.engine).__name__,
        "style": rollout.engine.weight_layout_style,
        "bucket_mb": cfg.reshard.bucket_mb,
        "overrides": args.set,
        "params": n_params,
        "repeat": args.repeat,
        "build_s": build_s,
        "reshard": {
            "seconds": r["reshard/seconds"],
            "bytes_moved_per_rank": r["reshard/bytes_moved"],
            "gb_per_s_per_rank": r["reshard/bytes_moved"] / r["reshard/seconds"] / 1e9,
            "metrics": r,
        },
        "baseline_state_dict_copy": {**b, "gb_per_s": b["bytes"] / b["seconds"] / 1e9},
        "ratio_reshard_over_baseline": r["reshard/seconds"] / b["seconds"],
    }
    if args.verify:
        rollout.resharder.config.verify = True
        result["verify_s"] = rollout.sync(actor.model)["reshard/verify_s"]
        result["verified"] = True
    if rank == 0:
        emit(result, args.out)
    dist.barrier()
    roles.shutdown()
    dist.destroy_process_group()
    if args.workers > 1:  # a spawned rank skips the interpreter's teardown too, as the run's workers do
        exit_now()


def main() -> None:
    """Run the benchmark the command line describes and print its JSON."""
    args = parser().parse_args()
    device = pick_device(args.device)
    path = make_model_dir(args.shape, device, args.model_dir)
    if args.workers == 1:
        run_rank(0, args, path)
    else:
        import torch.multiprocessing as mp

        if device.type == "cuda" and torch.cuda.device_count() < args.workers:
            raise SystemExit(f"--workers {args.workers}: only {torch.cuda.device_count()} GPUs are visible")
        with tempfile.TemporaryDirectory(prefix="bench_reshard_") as tmp:
            os.environ[STORE_FILE_ENV] = os.path.join(tmp, "store")  # the local workers' rendezvous, as a run's
            mp.spawn(run_rank, args=(args, path), nprocs=args.workers, join=True)
    exit_now()  # processes that used a DeviceMesh sometimes abort at interpreter exit


if __name__ == "__main__":
    main()
