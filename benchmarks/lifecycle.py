"""Seconds, GB/s and memory freed for every phase switch of the hybrid engine; JSON out.

    python -m benchmarks.lifecycle --shape 1.5b --device cuda
    python -m benchmarks.lifecycle --shape tiny --device cpu      # mechanics only: CPU frees nothing

Measured on one device, each switch after a warm-up round: engine sleep(1) / wake(weights) /
wake(kv_cache), sleep(2) / wake(weights) + reshard / wake(kv_cache), trainer offload / onload of
parameters and optimizer state. "freed" is the drop in allocated device memory, compared with the
engine's footprint (weights + KV cache) and the trainer's (parameter shards + Adam state).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch  # noqa: E402

from benchmarks.common import Timer, add_model_args, bench_config, bench_worker, make_model_dir, random_prompts  # noqa: E402
from hybridrl.engines.base import SamplingParams  # noqa: E402
from hybridrl.engines.native.fixed_memory import mapped_bytes  # noqa: E402


def allocated(device) -> int:
    """Device memory held by tensors: torch's allocator and the native engine's fixed-address memory."""
    return torch.cuda.memory_allocated(device) + mapped_bytes(device) if device.type == "cuda" else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "1.5b")
    ap.add_argument("--batch", type=int, default=64, help="sequences in the warm-up generate (sizes the KV cache)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args()

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    path = make_model_dir(args.shape, device, args.model_dir)
    offload = "params,optimizer" if device.type == "cuda" else "none"
    cfg = bench_config(
        path,
        device,
        [
            f"trainer.offload={offload}",
            "algorithm.kl_coef=0",
            f"engine.max_new_tokens={args.new_tokens}",
            f"engine.native.impl={args.impl}",
            f"engine.native.max_batch_size={max(256, args.batch)}",
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
        "device": str(device),
        "engine": type(engine).__name__,
        "engine_impl": getattr(engine, "impl", args.impl),
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
    print(json.dumps(result, indent=2))
    out = os.environ.get("OUT")
    if out:
        Path(out, f"bench_lifecycle_{args.shape}.json").write_text(json.dumps(result, indent=2))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
