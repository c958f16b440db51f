"""Seconds, GB/s and memory freed for every phase switch of the hybrid engine; JSON out.

    python -m benchmarks.lifecycle --shape 1.5b --device cuda
    python -m benchmarks.lifecycle --shape tiny --device cpu      # mechanics only: the CPU frees nothing

One device's roles, built by the run's builder (`build_components`, trainer.offload=[params,optimizer] on the GPU),
each switch timed after a warm-up round of it: the engine's sleep(1) / wake(weights) / wake(kv_cache), sleep(2) /
wake(weights) + reshard / wake(kv_cache), and the trainer's offload / onload of parameters and optimizer state. A
generate of --batch prompts × --new-tokens before each engine round fills the KV cache, as a rollout leaves it.
"freed" is the drop in allocated device memory (torch's allocator and the native engine's fixed-address memory),
compared with the engine's footprint (weights + KV cache) and the trainer's (parameter shards + Adam state). Times and
GB/s are the device's named in `gpu`.

JSON: the labels (`shape`, `device`, `gpu`, versions, `engine`, `overrides`); `sleep1` and `sleep2`, each with the
engine's footprint, the GB it freed and their share, `seconds` per switch and `memory_after` it (GPU), plus the weight
wake-up's GB/s (sleep1) or the reshard's GB and GB/s (sleep2); `trainer`: the offload and onload figures and the GB
the offload freed.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import (
    Timer,
    add_model_args,
    add_run_args,
    bench_config,
    bench_worker,
    device_info,
    emit,
    exit_now,
    make_model_dir,
    pick_device,
    random_prompts,
)
from hybridrl.engines.base import SamplingParams
from hybridrl.workers.dist import memory_snapshot


def allocated(device: torch.device) -> int:
    """Device memory held by tensors, as the run's memory metrics count it (torch's allocator and the native engine's
    fixed-address memory); 0 on the CPU."""
    return int(memory_snapshot(device)["allocated_gb"] * 2**30) if device.type == "cuda" else 0


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m benchmarks.lifecycle`."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.lifecycle", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(ap, "1.5b")
    ap.add_argument(
        "--batch", type=int, default=64, help="sequences of the generate before each round (fill the KV cache)"
    )
    ap.add_argument("--new-tokens", type=int, default=256, help="new tokens per sequence of that generate")
    add_run_args(ap)
    return ap


def main() -> None:
    """Run the benchmark the command line describes and print its JSON."""
    args = parser().parse_args()
    device = pick_device(args.device)
    path = make_model_dir(args.shape, device, args.model_dir)
    offload = "params,optimizer" if device.type == "cuda" else "none"
    cfg = bench_config(
        path,
        device,
        [
            f"trainer.offload={offload}",
            "algorithm.kl_coef=0",
            f"engine.max_new_tokens={args.new_tokens}",
            f"engine.native.max_batch_size={max(256, args.batch)}",
            *args.set,
        ],
    )
    roles = bench_worker(cfg, device)
    trainer, engine, rollout = roles.actor, roles.rollout.engine, roles.rollout
    # Adam state exists only after a step: take one so the optimizer footprint is real.
    for p in trainer.model.parameters():
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    base = allocated(device) - sum(p.numel() * p.element_size() for _, p in engine.named_weights())
    prompts = random_prompts(args.batch, 128, trainer.model.config.vocab_size)
    params = SamplingParams(n=1, max_new_tokens=args.new_tokens, seed=0)

    def round_trip(level: int, t: Timer) -> dict:
        engine.generate(prompts, params)  # KV cache in use, as after a rollout
        if device.type == "cuda":
            torch.cuda.synchronize()
        footprint = allocated(device) - base
        before = allocated(device)
        with t(f"sleep{level}"):
            engine.sleep(level)
        freed = before - allocated(device)
        with t(f"wake_weights_after_sleep{level}"):
            engine.wake_up(["weights"])
        if level == 2:
            with t("reshard"):
                stats = rollout.resharder.sync(trainer.model)
        with t(f"wake_kv_after_sleep{level}"):
            engine.wake_up(["kv_cache"])
        out = {
            "engine_footprint_gb": footprint / 1e9,
            "freed_gb": freed / 1e9,
            "freed_share": freed / footprint if footprint else None,
        }
        if level == 2:
            out["reshard_gb"] = stats.bytes_moved / 1e9
        return out

    result = {
        "shape": args.shape,
        "model_dir": args.model_dir,
        **device_info(device),
        "engine": type(engine).__name__,
        "overrides": args.set,
    }
    for level in (1, 2):
        round_trip(level, Timer(device))  # warm-up
        t = Timer(device)
        info = round_trip(level, t)
        result[f"sleep{level}"] = {**info, "seconds": dict(t.times), "memory_after": dict(t.memory)}
        if level == 1:
            weights = sum(p.numel() * p.element_size() for _, p in engine.named_weights())
            result["sleep1"]["wake_weights_gb_per_s"] = weights / 1e9 / t.times["wake_weights_after_sleep1"]
        else:
            result["sleep2"]["reshard_gb_per_s"] = info["reshard_gb"] / t.times["reshard"]

    # Trainer offload / onload (pinned host memory, side stream).
    trainer.offload()
    trainer.onload_params()
    trainer.onload_optimizer()  # warm-up: pinned buffers allocated once
    before = allocated(device)
    off = trainer.offload()
    freed = before - allocated(device)
    on = {**trainer.onload_params(), **trainer.onload_optimizer()}
    result["trainer"] = {"offload": off, "onload": on, "freed_gb": freed / 1e9}
    emit(result, args.out)
    exit_now()  # processes that used a DeviceMesh sometimes abort at interpreter exit


if __name__ == "__main__":
    main()
