"""LoRA against full fine-tuning on one device: peak memory and time of a GRPO step, and the reshard with the LoRA
merge against the plain reshard of the same weights; JSON out.

    python -m benchmarks.lora --shape 7b --device cuda --rank 64          # 7B on one GPU: full fine-tuning estimated
    python -m benchmarks.lora --shape 1.5b --device cuda --full run       # both measured: checks the estimate
    python -m benchmarks.lora --shape tiny --device cpu --prompts 4 --group 4 --new-tokens 8   # a smoke check

Each variant is the run's own controller (`benchmarks.common.bench_controller`, built by `build_components`) on random
prompts: `Controller.train_step` as `python -m hybridrl model.lora.rank=R ...` runs it, peak device memory taken
over each timed step (`torch.cuda.max_memory_allocated`, reset at the step's start). The LoRA variant builds no
reference copy (its base with adapters off is the reference); the full variant does, as a run with a KL term does.

Full fine-tuning of a 7B shape does not fit one H200 (float32 master + gradients + Adam = 16 bytes/parameter), so
with `--full auto` it runs only when its estimate fits; otherwise the JSON gives the estimate: the LoRA step's peak
minus the LoRA trainer's resident state plus the full trainer's (master, gradients, Adam, and the bf16 reference
copy), activations taken as equal. `--full run` at 1.5b measures both, which checks that estimate.

Reshard: on the LoRA worker, `rollout.sync(actor.model)` (gather → merge W + (alpha/rank)·B·A → fuse → split →
deliver), interleaved with the same sync inside `disable_adapter()` (the same bf16 base streamed without a merge:
the plain reshard of the same bytes); median of --reshard-repeat each. The JSON's ratios (`lora_peak_over_full`,
`lora_step_over_full`, `reshard_merge_over_plain`) compare the two in this process; times and GiB are the device's
named in `gpu`.

JSON: the labels (`shape`, `device`, `gpu`, versions, `base_params`, `lora_rank`, `lora_alpha`, `trainer_offload`,
`overrides`, `rollout`), `lora` and, where run, `full` (each: step_s_median, peak_gb, trainer_state_gb, memory_roles,
per_step; lora also `reshard`), `full_estimate` (GPU), and the ratios above.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from benchmarks.common import (
    add_model_args,
    add_run_args,
    bench_config,
    bench_controller,
    device_info,
    emit,
    exit_now,
    make_model_dir,
    model_vocab,
    note,
    pick_device,
    random_prompts,
    sync,
)

GIB = 2**30


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def trainer_state_bytes(roles) -> dict[str, int]:
    """Bytes this rank's trainer roles keep between steps: parameters (trainable / frozen), fp32 gradients of the
    trainable ones, optimizer state, and the reference copy."""
    actor = roles.actor
    local = [(p.to_local() if hasattr(p, "to_local") else p, p.requires_grad) for p in actor.model.parameters()]
    trainable = sum(t.numel() * t.element_size() for t, g in local if g)
    frozen = sum(t.numel() * t.element_size() for t, g in local if not g)
    optim = sum(
        v.to_local().numel() * v.element_size() if hasattr(v, "to_local") else v.numel() * v.element_size()
        for st in actor.optimizer.state.values()
        for v in st.values()
        if torch.is_tensor(v) and v.ndim
    )
    ref = 0 if roles.ref is None else sum(p.numel() * p.element_size() for p in roles.ref.model.parameters())
    return {"trainable_params": trainable, "frozen_params": frozen, "grads": trainable, "optimizer": optim, "ref": ref}


PHASES = ("wake", "generate", "sleep", "logprob", "reward", "update", "reshard")


def record_phase_peaks(worker, device: torch.device) -> dict[str, dict[str, float]]:
    """Wrap the inline worker's phase methods so each records its peak device memory (GiB) into the dict the
    returned holder's "peaks" names at the time (measurement only: the phases run unchanged)."""
    holder: dict[str, dict[str, float]] = {"peaks": {}}
    for phase in PHASES:
        method = getattr(worker, phase)

        def measured(*a, _m=method, _p=phase, **kw):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            out = _m(*a, **kw)
            if device.type == "cuda":
                peaks = holder["peaks"]
                peaks[_p] = max(peaks.get(_p, 0.0), torch.cuda.max_memory_allocated(device) / GIB)
            return out

        setattr(worker, phase, measured)
    return holder


def run_variant(name: str, cfg, prompts, device: torch.device, warmup: int, steps: int) -> tuple[dict, object]:
    """Warm-up then timed GRPO steps of `cfg`; returns the figures and the controller (still alive)."""
    controller = bench_controller(cfg, prompts)
    holder = record_phase_peaks(controller.group.worker, device)
    per_step = []
    for step in range(1, warmup + steps + 1):
        peaks = holder["peaks"] = {}
        t0 = time.perf_counter()
        metrics = controller.train_step(step)
        sync(device)
        wall = time.perf_counter() - t0
        if step > warmup:
            per_step.append(
                {
                    "step_s": wall,
                    "peak_gb": max(peaks.values()) if peaks else None,
                    "phase_peak_gb": peaks,
                    **{k: v for k, v in metrics.items() if k.startswith(("time/", "reshard/"))},
                }
            )
    roles = controller.group.worker.roles
    state = trainer_state_bytes(roles)
    out = {
        "variant": name,
        "step_s_median": statistics.median(s["step_s"] for s in per_step),
        "peak_gb": max(s["peak_gb"] for s in per_step) if device.type == "cuda" else None,
        "trainer_state_gb": {k: v / GIB for k, v in state.items()},
        "memory_roles": {k: v for k, v in metrics.items() if k.startswith("memory/roles/")},
        "per_step": per_step,
    }
    note(f"{name}: step {out['step_s_median']:.2f} s, peak {out['peak_gb']} GiB")
    return out, controller


def reshard_times(controller, device: torch.device, repeat: int) -> dict:
    """The LoRA worker's sync with the merge, and the same sync with the adapters off (no merge), interleaved."""
    roles = controller.group.worker.roles
    rollout, actor = roles.rollout, roles.actor
    merged, plain, stats = [], [], None
    for _ in range(repeat + 1):  # the first of each is a warm-up
        sync(device)
        t0 = time.perf_counter()
        stats = rollout.resharder.sync(actor.model)
        sync(device)
        merged.append(time.perf_counter() - t0)
        with actor.peft.disable_adapter():
            t0 = time.perf_counter()
            rollout.resharder.sync(actor.model)
            sync(device)
            plain.append(time.perf_counter() - t0)
    rollout.resharder.sync(actor.model)  # leave the engine with the policy's weights
    m, p = statistics.median(merged[1:]), statistics.median(plain[1:])
    return {
        "merge_s": m,
        "plain_s": p,
        "ratio": m / p,
        "phases_s": {k: getattr(stats, k) for k in ("gather_s", "merge_s", "fuse_split_s", "deliver_s")},
        "lora_merged": stats.lora_merged,
        "bytes_moved": stats.bytes_moved,
        "peak_extra_bytes": stats.peak_extra_bytes,
        "cuda_peak_delta_bytes": stats.cuda_peak_delta_bytes,
    }


#: Bytes per parameter that full fine-tuning keeps on the device during its update (one rank, bf16 compute):
#: float32 master, float32 gradients, Adam's two float32 moments, the bf16 gradients before their float32 reduce,
#: and the reference's bf16 copy (its offload completes at the next wake). The unsharded bf16 parameters of the
#: forward/backward exist in both variants and are in the measured LoRA peak already.
FULL_UPDATE_BYTES = {"master": 4, "grads_fp32": 4, "adam": 8, "grads_bf16": 2, "ref": 2}


def full_estimate_gb(lora: dict, n_params: int) -> dict:
    """The update-phase peak of full fine-tuning from the LoRA one's: the LoRA trainer's resident state (bf16 base,
    adapters, their gradients and Adam state) swapped for the full trainer's; activations taken as measured."""
    s = lora["trainer_state_gb"]
    lora_state = s["trainable_params"] + s["frozen_params"] + s["grads"] + s["optimizer"] + s["ref"]
    full_state = n_params * sum(FULL_UPDATE_BYTES.values()) / GIB
    update_peak = max(st["phase_peak_gb"].get("update", 0.0) for st in lora["per_step"])
    return {
        "peak_gb": update_peak - lora_state + full_state,
        "lora_update_peak_gb": update_peak,
        "lora_state_gb": lora_state,
        "full_state_gb": full_state,
        "bytes_per_param": FULL_UPDATE_BYTES,
        "method": "LoRA update-phase peak - LoRA trainer state + full trainer state",
    }


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m benchmarks.lora`."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.lora", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(ap, "7b")
    ap.add_argument("--rank", type=int, default=64, help="model.lora.rank")
    ap.add_argument("--alpha", type=float, default=128.0, help="model.lora.alpha")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (data.train_batch_size)")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (algorithm.group_size)")
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--new-tokens", type=int, default=256, help="most new tokens per sample (engine.max_new_tokens)")
    ap.add_argument("--micro", type=int, default=4, help="trainer.micro_batch_size (sequences)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per variant, after the warm-up steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--reshard-repeat", type=int, default=5, help="timed reshards of each kind (median)")
    ap.add_argument(
        "--full",
        choices=["auto", "run", "estimate", "skip"],
        default="auto",
        help="full fine-tuning: run it when its estimate fits the device (auto), always (run), never but estimate "
        "it (estimate), or leave it out (skip)",
    )
    ap.add_argument(
        "--offload",
        default="params,optimizer",
        help="trainer.offload on the GPU: params,optimizer / params / none (on the CPU always none)",
    )
    add_run_args(ap)
    return ap


def main() -> None:
    """Run the benchmark the command line describes and print its JSON."""
    args = parser().parse_args()
    device = pick_device(args.device)
    path = make_model_dir(args.shape, device, args.model_dir)
    offload = args.offload if device.type == "cuda" else "none"
    common = [
        f"data.train_batch_size={args.prompts}",
        f"algorithm.group_size={args.group}",
        f"engine.max_new_tokens={args.new_tokens}",
        f"engine.native.max_batch_size={max(256, args.prompts * args.group)}",
        f"trainer.micro_batch_size={args.micro}",
        f"trainer.offload={offload}",
        f"trainer.steps={args.warmup + args.steps}",
        "reward.name=format",
        *args.set,
    ]
    prompts = random_prompts(args.prompts * 4, args.prompt_len, model_vocab(path))
    lora_cfg = bench_config(
        path, device, [*common, "trainer.lr=1e-5", f"model.lora.rank={args.rank}", f"model.lora.alpha={args.alpha}"]
    )
    lora, controller = run_variant("lora", lora_cfg, prompts, device, args.warmup, args.steps)
    n_params = sum(p.numel() for p in controller.group.worker.roles.actor.model.parameters() if not p.requires_grad)
    lora["reshard"] = reshard_times(controller, device, args.reshard_repeat)
    controller.cleanup()
    del controller
    _free(device)

    result = {
        "shape": args.shape,
        "model_dir": args.model_dir,
        **device_info(device),
        "base_params": n_params,
        "lora_rank": args.rank,
        "lora_alpha": args.alpha,
        "trainer_offload": offload,
        "overrides": args.set,
        "rollout": {
            "prompts": args.prompts,
            "group": args.group,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "micro": args.micro,
        },
        "lora": lora,
    }
    if device.type == "cuda" and args.full != "skip":
        estimate = full_estimate_gb(lora, n_params)
        result["full_estimate"] = estimate
        total = torch.cuda.get_device_properties(device).total_memory / GIB
        run_full = args.full == "run" or (args.full == "auto" and estimate["peak_gb"] < 0.9 * total)
    else:
        run_full = args.full in ("auto", "run")
    if run_full:
        # --full decides (auto: by the estimate above), not the run's memory plan: `run` is there to see where it fails.
        full_cfg = bench_config(path, device, [*common, "trainer.lr=1e-6", "trainer.check_fit=false"])
        full, controller = run_variant("full", full_cfg, prompts, device, args.warmup, args.steps)
        controller.cleanup()
        result["full"] = full
    reference_peak = result["full"]["peak_gb"] if "full" in result else result.get("full_estimate", {}).get("peak_gb")
    if reference_peak:
        result["lora_peak_over_full"] = lora["peak_gb"] / reference_peak
    if "full" in result:
        result["lora_step_over_full"] = lora["step_s_median"] / result["full"]["step_s_median"]
    result["reshard_merge_over_plain"] = lora["reshard"]["ratio"]
    emit(result, args.out)
    exit_now()  # processes that used a DeviceMesh sometimes abort at interpreter exit


if __name__ == "__main__":
    main()
