"""Benchmark the native fused engine on random-init Qwen2.5 shapes; prints JSON.

    python -m benchmarks.engine --shape 0.5b --batch 64 --new-tokens 256                  # vs HF generate
    python -m benchmarks.engine --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512 --skip-hf
    python -m benchmarks.engine --case multiturn --shape 0.5b --trajectories 256 --turns 4 --tool-ms 50 --skip-hf
    python -m benchmarks.engine --shape tiny --device cpu --case all                        # a smoke check

Cases (all sample at temperature 1, no top-k/top-p, no EOS, so every sample runs to max_new_tokens):

- single: batch × prompt-len prompts, each sampled once; against transformers' `generate` on the same weights,
  and the log-probs of the engine's tokens against a trainer-style full forward (`parity`).
- grpo: prompts × samples sharing each prompt (prefilled once per prompt, its blocks shared).
- multiturn: trajectories × turns through `AsyncEngine` with a simulated tool of tool-ms between turns (its result
  `tool-tokens` tokens appended to the context), against the same number of tokens per trajectory generated in one
  turn; the ratio of the two throughputs is `vs_single_turn`. Two workloads: lockstep (equal turns: every trajectory
  calls its tool at the same step, so the device idles through each call; `lockstep_bound_vs_single_turn` is the
  best any engine can do there) and staggered (the same tokens cut at random points, as real turns fall), each with
  every `--join-wait` (engine.native.join_wait_steps) and every `--join-step-tokens` (0: each join prefills apart,
  the A/B of turns joining inside a step). `host_wait_s_runs` is the host's time blocked on step outputs.

Every case reports a `roofline`: the bytes one decode step must read (the weights, and the K/V the rows attend at the
mid-point of generation; `unique` counts a shared prompt once) over the H200's bandwidth (4.8 TB/s datasheet,
~4.3 TB/s measured copy), and the measured step time's ratio to that bound. The step time is the warm run's decode
time per step ((total - prefill-only run) / (new tokens - 1)); on GPU also one graph replay timed at the mid-point
(`step_parts`). `cold` timings include CUDA-graph capture (paid again after every sleep); `warm` reuse the graphs.

What a training step does around a rollout can be reproduced: `--model-dir` benches a saved model (the one
`bench_step.py --model-dir` wrote, or a real one), `--sleep-cycle` sleeps and wakes the engine before each grpo run
with the device's memory taken meanwhile, in one piece or fragmented; `--live-gb` keeps memory taken throughout;
`--heat-s` runs full-power GEMMs right before the reported runs; `--process-state` gives this process parts of
the step's state (its NCCL group, compiled layers, pinned buffers, an FSDP2 update, the actor role's own update phase
or part of it), and `--release-state` / `--stack-reset` / `--l2-reset` undo parts of it again. The grpo case's
`launch_timing` times one more run on the device, launch by launch: whether a slower run is the host falling behind
(gaps) or slower launches.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import functools
import json
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers

from benchmarks.device_monitor import DeviceMonitor  # noqa: E402
from hybridrl.engines.base import GenerationRequest, SamplingParams  # noqa: E402
from hybridrl.engines.config import NativeOptions  # noqa: E402
from hybridrl.engines.native.async_engine import AsyncEngine  # noqa: E402
from hybridrl.engines.native.engine import FusedEngine  # noqa: E402
from hybridrl.engines.native.kernels import attention as attention_kernels  # noqa: E402
from hybridrl.engines.native.runner import HostCopy  # noqa: E402
from hybridrl.reshard import ReshardConfig, Resharder  # noqa: E402

# Qwen2.5 shapes (hidden, layers, heads, kv heads, intermediate, vocab, tied)
SHAPES = {
    "tiny": (64, 2, 4, 2, 128, 1000, True),
    "0.5b": (896, 24, 14, 2, 4864, 151936, True),
    "1.5b": (1536, 28, 12, 2, 8960, 151936, True),
}
BANDWIDTH = {"datasheet": 4.8e12, "measured_copy": 4.3e12}  # H200 HBM3e, bytes/s
WARM_RUNS = 5  # warm generate runs per figure; the median is reported


def build_model(shape: str, dtype: torch.dtype, device: torch.device, model_dir: str | None = None) -> torch.nn.Module:
    """A randomly initialized Qwen2 causal LM of `shape` (transformers' own init), on `device`; or the checkpoint in
    `model_dir` (a real model, or the one a bench_step run saved)."""
    if model_dir:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
        return model.to(device).eval()
    h, n, heads, kv, inter, vocab, tied = SHAPES[shape]
    config = transformers.Qwen2Config(
        hidden_size=h,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=32768,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def build_engine(model, args, rows: int, kv_blocks: int = 0) -> FusedEngine:
    """The fused engine with `model`'s weights, cut by the resharder (as a run fills it); a KV cache of `kv_blocks`
    blocks, or sized by demand."""
    options = NativeOptions(
        max_batch_size=rows,
        cuda_graphs=not args.no_cuda_graphs,
        kernels=not args.no_kernels,
        kv_block_size=args.kv_block_size,
        kv_blocks=kv_blocks,
        join_step_tokens=max(args.join_step_tokens),
        pdl=(args.pdl or [NativeOptions.pdl])[0],
    )
    engine = FusedEngine(model.config, [], 0, device=model.device, dtype=model.dtype, options=options, seed=0)
    if args.no_skinny_gemm:
        engine.model.gemm_sms = 0
    if args.no_rope_attention:
        engine.model.rope_attention = False
    Resharder(ReshardConfig(), engine, model.config).sync(model)
    return engine


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[float, object]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def cuda_ms(fn, device: torch.device, reps: int = 50) -> float:
    """Mean milliseconds per call of `fn` (CUDA events; after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / reps


@contextmanager
def launch_timing(engine: FusedEngine) -> Iterator[dict]:
    """Device timestamps around every decode launch of `engine` inside the block (CUDA events on the stream, before
    and after the launch: its graph, any eager sampler, the output copy). `busy` is the device's time in a launch,
    `gap` its idle time from one launch's end to the next one's start. A host that falls behind the device shows as
    gaps; a device that reads its memory more slowly, as longer launches. The dict is filled when the block ends
    (on CPU it says only that nothing was measured)."""
    run, out, marks = engine.runner, {}, []
    if not run.on_gpu:
        out["available"] = False
        yield out
        return
    launch = run.launch

    def timed_launch(*args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy = launch(*args, **kwargs)
        end.record()
        marks.append((start, end))
        return copy

    run.launch = timed_launch  # an instance attribute: the scheduler's `run.launch(...)` finds it first
    try:
        yield out
    finally:
        del run.launch
    torch.cuda.synchronize(run.device)
    busy = [s.elapsed_time(e) for s, e in marks]
    gaps = [e.elapsed_time(s) for (_, e), (s, _) in zip(marks, marks[1:])]
    out.update(
        {
            "available": True,
            "launches": len(marks),
            "busy_ms_median": statistics.median(busy) if busy else 0.0,
            "busy_ms_total": sum(busy),
            "gap_ms_median": statistics.median(gaps) if gaps else 0.0,
            "gap_ms_total": sum(gaps),
            "gaps_over_0.05ms": sum(g > 0.05 for g in gaps),
        }
    )


def profile_table(fn, device: torch.device, path: str, rows: int = 30) -> None:
    """The profiler's table of one call of `fn` (CPU and CUDA), by total device time, to `path`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    Path(path).write_text(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)
    )


def timed_launches(
    engine: FusedEngine, prompts, params: SamplingParams, device: torch.device, profile: str | None = None
) -> dict:
    """One more warm run of `generate(prompts, params)` under `launch_timing` (its result), and with `profile` (GPU)
    another under the profiler, its table to that file; each run starts with an empty prefix table."""
    with launch_timing(engine) as launches:
        engine.cache.allocator.forget_prefixes() if engine.cache is not None else None
        timed(lambda: engine.generate(prompts, params), device)
    if profile and device.type == "cuda":
        engine.cache.allocator.forget_prefixes()
        profile_table(lambda: engine.generate(prompts, params), device, profile, rows=40)
    return launches


def heat(device: torch.device, seconds: float) -> None:
    """Keep the device at full power for `seconds` (bf16 GEMMs, as a training phase does) before a measured run: is
    a rollout slower on a device a trainer has just heated?"""
    n = 8192 if device.type == "cuda" else 256  # the CPU only checks the flag works
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        sync(device)


@functools.cache
def _cudart():
    """This process's own CUDA runtime library (the one torch loaded), through ctypes; None where none is loaded.
    Looked up once: every probe asks for it."""
    lib = (
        next((line.split()[-1] for line in open("/proc/self/maps") if "libcudart.so" in line), None)
        if Path("/proc/self/maps").exists()
        else None
    )
    return ctypes.CDLL(lib) if lib else None


def device_limits(device: torch.device) -> dict:
    """The CUDA context's limits as a probe starts (cudaDeviceGetLimit through the process's own libcudart): a
    kernel of the trainer's that needs a larger stack grows the local memory the context reserves, and an L2
    set-aside for persisting accesses shrinks the cache every later kernel shares; the device-wide L1/shared-memory
    preference; the processes with a context on the device (NVML). Also this process's threads."""
    out: dict[str, int] = {"threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0}
    if device.type != "cuda":
        return out
    cudart, value = _cudart(), ctypes.c_size_t()
    if cudart is None:
        return out
    for key, code in (
        ("stack_bytes", 0x00),
        ("printf_fifo_bytes", 0x01),
        ("malloc_heap_bytes", 0x02),
        ("max_l2_fetch_granularity", 0x05),
        ("persisting_l2_bytes", 0x06),
    ):
        if cudart.cudaDeviceGetLimit(ctypes.byref(value), code) == 0:
            out[key] = value.value
    config = ctypes.c_int()
    if cudart.cudaDeviceGetCacheConfig(ctypes.byref(config)) == 0:  # a library's L1/shared preference, device-wide
        out["cache_config"] = config.value
    try:  # another context on the device (a spawned process's) would share its time
        out["gpu_processes"] = torch.cuda.list_gpu_processes(device)
    except Exception as e:  # noqa: BLE001 - no NVML binding here
        out["gpu_processes"] = f"unavailable: {type(e).__name__}"
    return out


def reset_persisting_l2(device: torch.device) -> bool:
    """cudaCtxResetPersistingL2Cache: every line in the device's L2 held as persisting (an access-policy window's,
    or a kernel's `evict_last` hint) goes back to normal. Whether the trainer's kernels leave L2 partly held against
    the next rollout. True where it ran."""
    cudart = _cudart() if device.type == "cuda" else None
    if cudart is None:
        return False
    torch.cuda.synchronize(device)
    return cudart.cudaCtxResetPersistingL2Cache() == 0


def reset_stack_limit(device: torch.device) -> bool:
    """cudaDeviceSetLimit(cudaLimitStackSize) up by 1 KiB and back: the driver resizes the local memory it reserves
    for the context, which a kernel needing more of it (spilled registers) grew and which stays grown otherwise.
    True where both calls ran."""
    cudart = _cudart() if device.type == "cuda" else None
    if cudart is None:
        return False
    torch.cuda.synchronize(device)
    value = ctypes.c_size_t()
    if cudart.cudaDeviceGetLimit(ctypes.byref(value), 0x00) != 0:
        return False
    return (
        cudart.cudaDeviceSetLimit(0x00, ctypes.c_size_t(value.value + 1024)) == 0
        and cudart.cudaDeviceSetLimit(0x00, ctypes.c_size_t(value.value)) == 0
    )


_HELD: list[object] = []  # what --process-state keeps alive for the whole run
ACTOR_ARMS = {"actor": "update", "actor-eager": "update", "actor-logprob": "logprob", "actor-init": "init"}
"""--process-state's actor arms and how far each runs the role (`actor_update`'s `until`); one per process."""


def release_process_state(device: torch.device) -> bool:
    """Drop what --process-state kept (the roles, their compiled code through torch.compiler.reset), collect, and
    give the freed device memory back: whether holding it, rather than having run it, slows the engine."""
    import gc

    _HELD.clear()
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return True


def step_process_state(
    parts: list[str],
    model,
    device: torch.device,
    pinned_gb: float = 0.0,
    rollout: tuple[int, int, int, int] = (32, 8, 128, 512),
) -> dict:
    """Give this process what a training step's process has and the bench's has not, before the engine is built:
    `nccl`, the workers' default group (one rank, as bench_step's inline worker joins it); `compile`, the trainer's
    torch.compile of every decoder layer (GPU only, as `trainer.compile`), run forward and backward once; `backward`,
    the model's eager forward and backward over 16 × 1024 tokens, as the update's micro-batch; `adam`, one fused
    AdamW step over its parameters (random gradients; states freed after); `pinned`,
    `pinned_gb` GiB of page-locked host memory (mapped into the device's address space, as the offloaded state's
    buffers are), copied to the device and back once in 1 GiB pieces and kept; `nccl-avg`, one one-rank all-reduce
    that NCCL runs a kernel for; `fsdp`, the actor's update as the product runs it (`fsdp_update`), its state kept;
    `fsdp-backward`, the same up to its backward; `actor`, the product's actor role loaded from `model` and its update
    over a synthetic rollout of `rollout` (prompts, samples, prompt length, new tokens; `actor_update`), kept;
    `actor-eager` the same without compiled layers, `actor-logprob` only up to its log-prob pass, `actor-init` only
    the role loaded. Which of them makes the same decode graphs slower?"""
    done: dict[str, object] = {}
    if parts_need_group := {"nccl", "nccl-avg", "fsdp", "fsdp-backward", *ACTOR_ARMS} & set(parts):
        import torch.distributed as dist

        from hybridrl.workers.dist import init_process_group

        init_process_group(0, 1, device, timeout_s=120)
        done["nccl"] = dist.get_backend()
        done["group_for"] = sorted(parts_need_group)
    if "nccl-avg" in parts:
        # A one-rank all-reduce that must scale (AVG): NCCL runs its own kernel for it (a SUM in place runs none). The
        # product's update is where the step's process first meets NCCL kernels of this kind, if anywhere.
        done["nccl_avg"] = device.type == "cuda"
        if done["nccl_avg"]:
            t = torch.ones(1 << 20, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            sync(device)
    if "fsdp" in parts or "fsdp-backward" in parts:
        done["fsdp_grad_norm"] = fsdp_update(model, device, step="fsdp" in parts)
    if arm := next((a for a in ACTOR_ARMS if a in parts), None):
        done["actor_update"] = actor_update(
            model, device, *rollout, until=ACTOR_ARMS[arm], compile_layers=arm != "actor-eager"
        )
    if "compile" in parts:
        done["compile"] = device.type == "cuda"
        if done["compile"]:
            from hybridrl.training.fsdp import compile_layers

            compile_layers(model)
            model.train()
            ids = torch.randint(2, model.config.vocab_size, (4, 256), device=device)
            model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
            model.zero_grad(set_to_none=True)
            model.eval()
    if "backward" in parts or "adam" in parts:
        trainable = list(model.parameters())
        for p in trainable:
            p.requires_grad_(True)
        if "backward" in parts:
            model.train()
            shape = (16, 1024) if device.type == "cuda" else (2, 16)  # the CPU only checks the path runs
            ids = torch.randint(2, model.config.vocab_size, shape, device=device)
            model(input_ids=ids).logits.float().log_softmax(-1).mean().backward()
            model.eval()
            done["backward"] = True
        if "adam" in parts:
            for p in trainable:
                if p.grad is None:
                    p.grad = torch.randn_like(p) * 1e-3
            with torch.no_grad():
                saved = [p.detach().clone() for p in trainable]
                opt = torch.optim.AdamW(trainable, lr=1e-6, fused=device.type == "cuda")
                opt.step()
                for p, v in zip(trainable, saved):  # the engine runs the weights it would have: only the kernels ran
                    p.copy_(v)
                del opt, saved
            done["adam"] = True
        for p in trainable:
            p.grad = None
            p.requires_grad_(False)
        sync(device)
    if "pinned" in parts:
        done["pinned_gb"] = pinned_gb if device.type == "cuda" else 0.0
        if device.type == "cuda":
            piece = 2**30
            host = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(int(pinned_gb))]
            scratch = torch.empty(piece, dtype=torch.uint8, device=device)
            for buf in host:
                scratch.copy_(buf, non_blocking=True)
                buf.copy_(scratch, non_blocking=True)
            torch.cuda.synchronize(device)
            del scratch
            _HELD.append(host)  # the run's whole life, as the trainer keeps its buffers
    return done


def fsdp_update(model, device: torch.device, step: bool = True) -> float:
    """One update of a float32 copy of `model` as the actor's runs (needs the default group): FSDP2 over a one-rank
    mesh with the product's sharding and mixed precision (bfloat16 compute on GPU, float32 gradient reduction), a
    training forward and backward over 16 × 1024 tokens, then (`step`) the learner's own step (the DTensor gradient
    norm and its collective, the clip, fused AdamW). The copy, its gradients and the Adam state stay for the run, as
    the actor's do in the step's process. Returns the gradient norm (the learner's, or without `step` the plain
    norm of the local gradients)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from hybridrl.training.config import TrainerConfig
    from hybridrl.training.fsdp import Precision, shard_model
    from hybridrl.training.learner import FSDPLearner

    actor = copy.deepcopy(model).float().requires_grad_(True)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("fsdp",))
    shard_model(actor, mesh, Precision.for_device("auto", device).policy)
    learner = FSDPLearner(actor, TrainerConfig(), set(), device, total_optimizer_steps=10)
    actor.train()
    shape = (16, 1024) if device.type == "cuda" else (2, 16)  # the CPU only checks the path runs
    ids = torch.randint(2, model.config.vocab_size, shape, device=device)
    actor(input_ids=ids).logits.float().log_softmax(-1).mean().backward()
    if step:
        norm = learner.optimizer_step()
    else:  # no DTensor norm, no collective: the gradients' local shards, read directly
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in actor.parameters()]
        norm = torch.stack([g.float().norm() for g in grads if g is not None]).norm().item()
    sync(device)
    _HELD.append(learner)
    return norm


def actor_update(
    model,
    device: torch.device,
    prompts: int,
    samples: int,
    prompt_len: int,
    new_tokens: int,
    until: str = "update",
    compile_layers: bool = True,
) -> dict:
    """One update of the product's own actor role (needs the default group), as the step runs it: a `Trainer` loaded
    from a copy of `model` saved to a temporary folder (float32 master weights, compiled layers on GPU, FSDP2 at one
    rank, the default TrainerConfig and AlgorithmConfig: GRPO, PPO-clip, the KL to the reference in the loss), its
    no-grad log-prob pass over a synthetic rollout of the bench's GRPO shape (random responses of `new_tokens`, each
    group of `samples` sharing a prompt), the advantages from random scores through `estimation.estimate`, then
    `Trainer.update`: its micro-batches, the loss, the clip and fused AdamW. Where `fsdp_update` runs one plain
    backward, this is the step's update phase itself; its state stays for the run. `until` stops after the role is
    loaded (`init`) or after its log-prob pass (`logprob`); `compile_layers=False` runs the role eager. Returns the
    update's metrics (empty when it stopped before the update)."""
    import shutil
    import tempfile

    from torch.distributed.device_mesh import init_device_mesh

    from hybridrl.algorithms.config import AlgorithmConfig
    from hybridrl.batch import Batch
    from hybridrl.estimation import estimate
    from hybridrl.models.config import ModelConfig
    from hybridrl.training.config import TrainerConfig
    from hybridrl.training.trainer import Trainer

    folder = tempfile.mkdtemp(prefix="bench_actor_")
    try:
        model.save_pretrained(folder)
        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("fsdp",))
        algo = AlgorithmConfig(group_size=samples)
        actor = Trainer(
            folder,
            ModelConfig(name="hf", path=folder),
            TrainerConfig(compile=compile_layers),
            algo,
            device,
            mesh,
            pad_token_id=0,
            temperature=1.0,
            total_optimizer_steps=10,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the weights are in memory now
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    heads = [torch.randint(2, vocab, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    rows = prompts * samples
    batch = Batch(
        [heads[i // samples] for i in range(rows)],
        {
            "responses": torch.randint(2, vocab, (rows, new_tokens), generator=g),
            "response_mask": torch.ones(rows, new_tokens, dtype=torch.long),
        },
    )
    _HELD.append(actor)
    if until == "init":
        return {}
    old = actor.compute_logprobs(actor.micro_batches(batch))["old_logprobs"]
    sync(device)
    if until == "logprob":
        return {}
    batch["old_logprobs"], batch["ref_logprobs"], batch["engine_logprobs"] = old, old.clone(), old.clone()
    estimate(algo, batch, torch.rand(rows, generator=g).tolist(), {}, new_tokens)
    out = actor.update(batch)
    sync(device)
    return out


# -- what a decode step must read -------------------------------------------------------------------------------
def roofline(engine: FusedEngine, rows: int, context: float, unique_tokens: float, step_s: float) -> dict:
    """Bytes of one decode step (weights + the K/V of `rows` rows attending `context` positions each), its time
    at the H200's bandwidth, and the measured step time over that bound; `unique` counts shared K/V once."""
    m = engine.model
    weights = sum(p.numel() * p.element_size() for _, p in engine.named_weights())
    per_token = 2 * m.shape.num_layers * m.kv_heads * m.head_dim * torch.empty(0, dtype=m.dtype).element_size()
    out = {
        "weight_bytes": weights,
        "kv_bytes_per_token": per_token,
        "rows": rows,
        "attended_per_row": context,
        "step_ms": step_s * 1e3,
    }
    for name, tokens in (("attended", rows * context), ("unique", unique_tokens)):
        total = weights + tokens * per_token
        bounds = {k: total / bw * 1e3 for k, bw in BANDWIDTH.items()}
        out[name] = {
            "bytes": total,
            **{f"bound_ms_{k}": v for k, v in bounds.items()},
            **{f"step_over_bound_{k}": step_s * 1e3 / v for k, v in bounds.items()},
        }
    return out


def step_parts(engine: FusedEngine, prompts: list[list[int]], params: SamplingParams, device: torch.device) -> dict:
    """One graph-replayed decode step of the whole batch timed at the mid-point of generation, and the sampler as a
    fused kernel vs the torch path on logits of that batch's shape (with their agreement)."""
    from hybridrl.engines.sampling import sample_tokens

    s, run = engine.scheduler, engine.runner
    s.submit_all([GenerationRequest(p, i) for i, p in enumerate(prompts)], params)
    with torch.inference_mode():
        for _ in range(params.max_new_tokens // 2):
            s.step()
        sync(device)
        n = len(s.rows)
        saved = [t.clone() for t in (run.tokens, run.pos, run.steps)]
        forward = cuda_ms(lambda: run.launch(n, s.mode, engine.generator, run.width * engine.block_size), device)
        for t, v in zip((run.tokens, run.pos, run.steps), saved):
            t.copy_(v)
        attended = float(run.pos[:n].float().mean() + 1)
        s.abort()
        g = torch.Generator(device=device).manual_seed(0)
        logits = torch.randn(n, engine.vocab, device=device, generator=g).to(engine.model.dtype)
        keys = torch.arange(n, device=device, dtype=torch.int64) * 7919 + 11
        out = {
            "batch": n,
            "attended_mean": attended,
            "graphs_enabled": run.use_graphs,
            "step_ms": forward,
            "sampler_kernel_ms": cuda_ms(lambda: sample_tokens(logits, 1.0, keys=keys, step=3), device),
            "sampler_torch_ms": cuda_ms(lambda: sample_tokens(logits, 1.0, keys=keys, step=3, kernel=False), device),
        }
        same, lp_diff = 0, 0.0
        for step in range(20):
            tk, lk = sample_tokens(logits, 1.0, keys=keys, step=step)
            tt, lt = sample_tokens(logits, 1.0, keys=keys, step=step, kernel=False)
            same += int((tk == tt).sum())
            lp_diff = max(lp_diff, float((lk - lt).abs().max()))
    out["kernel_vs_torch"] = {"draws": 20 * n, "same_token": same / (20 * n), "max_abs_logprob_diff": lp_diff}
    return out


def parity(model, prompts: list[list[int]], outs, rows: int) -> dict:
    """Engine log-probs vs a full forward's, over the first `rows` samples: mean and max |Δ|."""
    diffs = []
    dev = next(model.parameters()).device
    with torch.inference_mode():
        for o in outs[:rows]:
            seq = torch.tensor([prompts[o.prompt_index] + o.token_ids], device=dev)
            logits = model(seq).logits[0, len(prompts[o.prompt_index]) - 1 : -1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(o.token_ids, device=dev)[:, None])[:, 0]
            diffs.append((ref.cpu() - torch.tensor(o.logprobs)).abs())
    d = torch.cat(diffs)
    return {"rows": len(diffs), "tokens": d.numel(), "mean_abs": d.mean().item(), "max_abs": d.max().item()}


def bench_hf(model, prompts: torch.Tensor, new_tokens: int, device: torch.device) -> dict:
    """transformers `generate` with its default dynamic cache, sampling, no early stop."""
    kw = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones_like(prompts),
    )
    with torch.inference_mode():
        model.generate(
            prompts[:, :8],
            **{**kw, "max_new_tokens": 4, "min_new_tokens": 4, "attention_mask": torch.ones_like(prompts[:, :8])},
        )  # warm-up
        seconds, out = timed(lambda: model.generate(prompts, **kw), device)
    tokens = (out.shape[1] - prompts.shape[1]) * out.shape[0]
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


# -- cases ------------------------------------------------------------------------------------------------------
def sleep_cycle(engine: FusedEngine, cycle: str, device: torch.device) -> None:
    """What a training step does to the engine between rollouts: sleep (weights parked on the host, the KV cache's
    memory given back), memory taken meanwhile (the trainer's, which takes the pages the engine gave back), wake, then
    that memory freed. `cycle` is "G" (G GiB in one piece) or "GxM" (G GiB, or "all": the free memory but 2 GiB, in
    M MiB pieces, every other one freed before the wake: the engine wakes into holes, as into a device that a trainer's
    allocations have fragmented). The engine keeps the layout it woke into until the next cycle."""
    gb, _, mb = cycle.partition("x")
    if gb == "all" and device.type != "cuda":
        raise SystemExit("--sleep-cycle all×M needs a CUDA device (it takes the device's free memory)")
    engine.sleep(1)
    # "all": so that the engine wakes into the holes and nowhere else
    total = torch.cuda.mem_get_info(device)[0] - 2**31 if gb == "all" else int(float(gb) * 2**30)
    piece = int(float(mb) * 2**20) if mb else total
    held = [torch.empty(piece, dtype=torch.uint8, device=device) for _ in range(total // piece)] if total else []
    if mb:
        del held[1::2]
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the freed pieces go back to the driver: holes between the kept ones
    engine.wake_up()
    held.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    sync(device)


def run_generate(engine: FusedEngine, prompts, n: int, new: int, device: torch.device, cycle: str | None = None):
    """Cold and warm timings of generate(prompts, n samples × new tokens), the prefill-only time, the decode step;
    returns (figures, the warm run's completions, its params). Each run starts with an empty prefix table, as a
    rollout after a weight update does; with `cycle`, after that `sleep_cycle`."""
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=new, seed=0)
    rows = len(prompts) * n

    def run(p: SamplingParams):
        if cycle is not None:
            sleep_cycle(engine, cycle, device)
        engine.cache.allocator.forget_prefixes() if engine.cache is not None else None
        before = engine.scheduler.prefilled_tokens
        seconds, outs = timed(lambda: engine.generate(prompts, p), device)
        return seconds, outs, engine.scheduler.prefilled_tokens - before

    cold, _, _ = run(params)
    # The first warm run captures the packed prefill's graph (a bucket is captured at its second use); the next
    # replay every graph, as a serving loop does: their median (the machine is noisy).
    warm_first, _, _ = run(params)
    warm_runs = [run(params) for _ in range(WARM_RUNS)]
    warm = statistics.median(r[0] for r in warm_runs)
    _, outs, prefilled = warm_runs[-1]
    prefill, _, _ = run(SamplingParams(n=n, max_new_tokens=1, seed=0))
    produced = sum(len(o.token_ids) for o in outs)
    out = {
        "rows": rows,
        "tokens": produced,
        "seconds_cold": cold,
        "seconds_warm_first": warm_first,
        "seconds_warm": warm,
        "seconds_warm_runs": [r[0] for r in warm_runs],
        "seconds_prefill": prefill,
        "tokens_per_s_cold": rows * new / cold,
        "tokens_per_s": rows * new / warm,
        "decode_step_ms": (warm - prefill) / max(1, new - 1) * 1e3,
        "prefilled_tokens": prefilled,
        "cuda_graphs": len(engine.runner.graphs),
        "graphs_enabled": engine.runner.use_graphs,
        "kv_cache_gb": engine.memory_stats()["engine_kv_cache_gb"],
    }
    if produced != rows * new:
        out["error"] = f"engine produced {produced} tokens, expected {rows * new}"
    return out, outs, params


def case_single(model, engine, args, device) -> dict:
    gen = torch.Generator().manual_seed(1)
    prompts_t = torch.randint(2, model.config.vocab_size, (args.batch, args.prompt_len), generator=gen)
    prompts = prompts_t.tolist()
    res, outs, params = run_generate(engine, prompts, 1, args.new_tokens, device)
    res["roofline"] = roofline(
        engine,
        args.batch,
        args.prompt_len + args.new_tokens / 2,
        args.batch * (args.prompt_len + args.new_tokens / 2),
        res["decode_step_ms"] / 1e3,
    )
    res["parity"] = parity(model, prompts, outs, args.parity_rows)
    if device.type == "cuda":
        res["step_parts"] = step_parts(engine, prompts, params, device)
        res["roofline_graph_step"] = roofline(
            engine,
            args.batch,
            res["step_parts"]["attended_mean"],
            args.batch * res["step_parts"]["attended_mean"],
            res["step_parts"]["step_ms"] / 1e3,
        )
        if args.profile:
            profile_table(lambda: engine.generate(prompts, params), device, args.profile)
    if device.type == "cuda" and engine.model.gemm_sms:
        # Side by side: every projection in F.linear (the split-K GEMMs, Triton and batched cuBLAS, off), then on.
        def warm_median(gemm_sms: int) -> float:
            engine.model.gemm_sms = gemm_sms
            engine.runner.drop_graphs()  # the graphs hold the kernels they were captured with
            engine.generate(prompts, params)
            return statistics.median(
                timed(lambda: engine.generate(prompts, params), device)[0] for _ in range(WARM_RUNS)
            )

        sms = engine.model.gemm_sms
        t_cublas, t_ours = warm_median(0), warm_median(sms)
        res["cublas_only"] = {
            "seconds_warm": t_cublas,
            "tokens_per_s": args.batch * args.new_tokens / t_cublas,
            "seconds_warm_skinny_again": t_ours,
            "speedup_skinny": t_cublas / t_ours,
        }
    if args.torch_sampler:
        engine.scheduler.sampler_kernel = False
        engine.generate(prompts, params)  # captures this sampler's graphs
        t_torch, _ = timed(lambda: engine.generate(prompts, params), device)
        engine.scheduler.sampler_kernel = True
        res["torch_sampler"] = {"seconds_warm": t_torch, "tokens_per_s": args.batch * args.new_tokens / t_torch}
    if not args.skip_hf:
        engine.sleep(2)  # give HF generate the memory
        res["hf_generate"] = bench_hf(model, prompts_t.to(device), args.new_tokens, device)
        res["speedup"] = res["tokens_per_s"] / res["hf_generate"]["tokens_per_s"]
    return res


def case_grpo(model, engine, args, device) -> dict:
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(2, model.config.vocab_size, (args.prompts, args.prompt_len), generator=gen).tolist()
    # The A/Bs: the same prompts with other values of a runner setting (the first value is the reported run's).
    # A value may come again (A B A B ...): each variant reports the median of its runs, interleaved with the others.
    settings = {
        "shared_prefix_tokens": args.shared_prefix_tokens,
        "long_keys": [None if v == "auto" else int(v) for v in args.long_keys or ["auto"]],
        "pdl_mode": args.pdl or [NativeOptions.pdl],
        "pdl_trigger": args.pdl_trigger or ["start"],
        "sleep_cycle": [None if v == "none" else v for v in args.sleep_cycle or ["none"]],
    }
    runs: dict[str, dict[str, list[dict]]] = {}
    if args.pdl_trial_pairs or args.pdl_trial_first != "on":
        engine.runner.pdl_trial_pairs = args.pdl_trial_pairs or engine.runner.pdl_trial_pairs
        engine.runner.pdl_trial_first = args.pdl_trial_first == "on"
        engine.runner.pdl_auto = False  # made again, with these settings, where `auto` is set below
    for name, values in settings.items():
        for value in values[1:]:
            if name == "sleep_cycle":  # not a runner setting: what happens between the runs
                v, _, _ = run_generate(engine, prompts, args.samples, args.new_tokens, device, value)
                runs.setdefault(name, {}).setdefault("none" if value is None else str(value), []).append(v)
                continue
            setattr(engine.runner, name, value)
            v, _, _ = run_generate(engine, prompts, args.samples, args.new_tokens, device)
            runs.setdefault(name, {}).setdefault("auto" if value is None else str(value), []).append(v)
        if name != "sleep_cycle":
            setattr(engine.runner, name, values[0])
    if args.heat_s:
        heat(device, args.heat_s)
    monitor = DeviceMonitor(device).start()
    monitor.tag = "generate"
    res, outs, _ = run_generate(engine, prompts, args.samples, args.new_tokens, device, settings["sleep_cycle"][0])
    monitor.stop()
    res["device_state"] = monitor.summary()  # SM clock, power, temperature over the reported runs (NVML)
    params = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    res["launch_timing"] = timed_launches(engine, prompts, params, device, args.profile)  # device time per launch, gaps
    for name, by_value in runs.items():
        res[name] = ("none" if name == "sleep_cycle" else "auto") if settings[name][0] is None else settings[name][0]
        res[f"{name}_variants"] = {
            value: {
                **{k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "decode_step_ms", "seconds_warm")},
                "tokens_per_s_runs": [r["tokens_per_s"] for r in rs],
            }
            for value, rs in by_value.items()
        }
    rows, half = args.prompts * args.samples, args.new_tokens / 2
    res["roofline"] = roofline(
        engine, rows, args.prompt_len + half, args.prompts * args.prompt_len + rows * half, res["decode_step_ms"] / 1e3
    )
    res["parity"] = parity(model, prompts, outs, args.parity_rows)
    return res


def turn_lengths(t: int, turns: int, new: int, staggered: bool, gen: torch.Generator) -> list[list[int]]:
    """Each trajectory's new tokens per turn, summing to `new`: equal turns (every trajectory reaches its tool call at
    the same step), or cut at random points (as real turns are: the tool calls of different trajectories fall at
    different steps)."""
    if not staggered:
        return [[new // turns] * turns for _ in range(t)]
    out = []
    for _ in range(t):
        cuts = sorted(torch.randperm(new - 1, generator=gen)[: turns - 1].add(1).tolist())
        out.append([b - a for a, b in zip([0, *cuts], [*cuts, new])])
    return out


def run_multiturn(engine, prompts, tools, lengths, args, device, profile: str | None = None) -> dict:
    """Cold and three warm timings (median) of every trajectory's turns through `AsyncEngine`, a `tool_ms` sleep between
    turns; the host time spent in prefill calls; with `profile` (GPU) a profiler table of one more run over the first
    64 trajectories, by CPU time."""
    t, turns = len(prompts), len(lengths[0])

    async def trajectory(i: int, agent: AsyncEngine) -> int:
        context, produced = list(prompts[i]), 0
        for k in range(turns):
            params = SamplingParams(temperature=1.0, max_new_tokens=lengths[i][k], seed=0)
            out = await agent.generate(GenerationRequest(context, i, k), params)
            produced += len(out.token_ids)
            if k < turns - 1:
                await asyncio.sleep(args.tool_ms / 1e3)  # the tool
                context = context + out.token_ids + tools[i][k]
        return produced

    async def all_trajectories() -> int:
        agent = AsyncEngine(engine)
        return sum(await asyncio.gather(*(trajectory(i, agent) for i in range(t))))

    sch, prefill, host = engine.scheduler, engine.prefill, {"prefill_s": 0.0, "wait_s": 0.0}
    result = HostCopy.result

    def timed_prefill(groups, mode):  # host time: launches, and any wait inside
        t0 = time.perf_counter()
        out = prefill(groups, mode)
        host["prefill_s"] += time.perf_counter() - t0
        return out

    def timed_result(copy):  # the host waiting for a step's outputs: the device's share of the run
        t0 = time.perf_counter()
        out = result(copy)
        host["wait_s"] += time.perf_counter() - t0
        return out

    cold, _ = timed(lambda: asyncio.run(all_trajectories()), device)
    engine.prefill, HostCopy.result = timed_prefill, timed_result
    warm, waits = [], []
    try:
        for _ in range(3):  # the median of three: single runs differ by up to a fifth on the H200 host
            engine.cache.allocator.forget_prefixes()  # each timed run finds only what it computed itself
            before = (sch.prefilled_tokens, sch.prefills, sch.step_joins, sch.steps, sch.row_steps)
            host["prefill_s"] = host["wait_s"] = 0.0
            seconds, produced = timed(lambda: asyncio.run(all_trajectories()), device)
            warm.append(seconds)
            waits.append(host["wait_s"])
    finally:
        del engine.prefill
        HostCopy.result = result
    prefilled, prefills, step_joins, steps, row_steps = (
        a - b for a, b in zip((sch.prefilled_tokens, sch.prefills, sch.step_joins, sch.steps, sch.row_steps), before)
    )
    if profile:  # over the first 64 trajectories: a full run's events took minutes to collect (seen on the H200)
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        engine.cache.allocator.forget_prefixes()
        t = min(t, 64)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            asyncio.run(all_trajectories())
            torch.cuda.synchronize(device)
        Path(profile).write_text(
            prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60)
        )
    seconds = statistics.median(warm)
    return {
        "join_wait_steps": sch.join_wait,
        "join_step_tokens": sch.join_step_tokens,
        "tokens": produced,
        "seconds_cold": cold,
        "seconds_warm": seconds,
        "seconds_warm_runs": warm,
        "tokens_per_s": produced / seconds,
        "prefilled_tokens": prefilled,
        "prefill_calls": prefills,
        "step_joins": step_joins,
        "prefill_host_s": host["prefill_s"],
        # Host seconds blocked on step outputs, per warm run: near the run's time when the device is the
        # bottleneck, near 0 when the host is.
        "host_wait_s_runs": waits,
        "engine_steps": steps,
        "mean_rows_per_step": row_steps / max(1, steps),
        "ms_per_engine_step": seconds / max(1, steps) * 1e3,
    }


def case_multiturn(model, engine, args, device) -> dict:
    """Lockstep turns (the bound: every trajectory waits for its tool at once, so the device idles through each
    call) and staggered turns (the same tokens, cut at random points), each with every --join-wait, against the
    same tokens per trajectory generated in one turn."""
    t, turns = args.trajectories, args.turns
    gen = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    prompts = torch.randint(2, vocab, (t, args.prompt_len), generator=gen).tolist()
    tools = torch.randint(2, vocab, (t, turns, args.tool_tokens), generator=gen).tolist()
    new = args.new_tokens // turns * turns
    single, _, _ = run_generate(engine, prompts, 1, new, device)
    res = {
        "trajectories": t,
        "rows": engine.options.max_batch_size,
        "turns": turns,
        "tool_ms": args.tool_ms,
        "tool_tokens": args.tool_tokens,
        "tool_wait_s_per_trajectory": (turns - 1) * args.tool_ms / 1e3,
        "single_turn": {k: single[k] for k in ("tokens", "seconds_warm", "tokens_per_s", "decode_step_ms")},
        # Lockstep: no engine can decode while every trajectory waits, so the ratio is at most this.
        "lockstep_bound_vs_single_turn": single["seconds_warm"]
        / (single["seconds_warm"] + (turns - 1) * args.tool_ms / 1e3),
        "variants": {},
    }
    for staggered in (False, True):
        lengths = turn_lengths(t, turns, new, staggered, gen)
        for ride in args.join_step_tokens:
            engine.scheduler.join_step_tokens = ride  # 0: every join prefills apart (the A/B)
            for wait in args.join_wait:
                engine.scheduler.join_wait = wait
                last = staggered and wait == args.join_wait[-1] and ride == args.join_step_tokens[-1]
                v = run_multiturn(
                    engine,
                    prompts,
                    tools,
                    lengths,
                    args,
                    device,
                    args.profile if last and device.type == "cuda" else None,
                )
                v["vs_single_turn"] = v["tokens_per_s"] / single["tokens_per_s"]
                name = f"{'staggered' if staggered else 'lockstep'}_join{wait}"
                res["variants"][name + (f"_ride{ride}" if len(args.join_step_tokens) > 1 else "")] = v
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=("single", "grpo", "multiturn", "all"), default="single")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--batch", type=int, default=64, help="single: prompts (one sample each)")
    ap.add_argument("--prompts", type=int, default=32, help="grpo: distinct prompts")
    ap.add_argument("--samples", type=int, default=8, help="grpo: samples per prompt")
    ap.add_argument("--trajectories", type=int, default=256, help="multiturn: concurrent trajectories")
    ap.add_argument("--turns", type=int, default=4, help="multiturn: turns per trajectory")
    ap.add_argument("--tool-ms", type=float, default=50.0, help="multiturn: simulated tool latency between turns")
    ap.add_argument("--tool-tokens", type=int, default=16, help="multiturn: tokens a tool result appends")
    ap.add_argument(
        "--max-rows",
        type=int,
        default=0,
        help="multiturn: the engine's rows (engine.native.max_batch_size); fewer than --trajectories keeps "
        "more trajectories in flight than rows, as agent RL runs do; 0 = one row per trajectory",
    )
    ap.add_argument(
        "--join-wait",
        type=int,
        nargs="+",
        default=[NativeOptions.join_wait_steps],
        help="multiturn: engine.native.join_wait_steps values to run (each variant with each)",
    )
    ap.add_argument(
        "--join-step-tokens",
        type=int,
        nargs="+",
        default=[NativeOptions.join_step_tokens],
        help="multiturn: engine.native.join_step_tokens values to run (0: joins prefill apart; each variant with each)",
    )
    ap.add_argument(
        "--long-keys",
        nargs="+",
        default=None,
        help="grpo: context lengths from which decode attention splits in two where the batch alone would "
        "not ('auto': the engine's measured rule, the default; 0: never), the first reported in full, "
        "the others (repeats allowed, run in this order) as long_keys_variants",
    )
    ap.add_argument(
        "--pdl",
        nargs="+",
        choices=("on", "off", "auto"),
        default=None,
        help="engine.native.pdl (on: the Triton kernels launch with programmatic dependent launch; auto: "
        "the decode graphs' kind chosen by timing both at the first rollout): the first value for "
        "every case; grpo also runs the others (repeats allowed), reported as pdl_mode_variants",
    )
    ap.add_argument(
        "--pdl-trial-pairs",
        type=int,
        default=0,
        help="grpo: with --pdl auto, the pairs of decode steps timed before the choice (0: the engine's "
        "default; 254 times a whole rollout of 512 new tokens, one pair at each length)",
    )
    ap.add_argument(
        "--pdl-trial-first",
        choices=("on", "off"),
        default="on",
        help="grpo: with --pdl auto, the kind of graph each choice times first, so captures first (off: "
        "the graphs without PDL)",
    )
    ap.add_argument(
        "--pdl-trigger",
        nargs="+",
        choices=("start", "completion"),
        default=None,
        help="grpo: where each PDL-launched kernel lets the next launch (the runner's pdl_trigger): at its "
        "start, or only at its completion; the first reported in full, the others (repeats allowed) "
        "as pdl_trigger_variants",
    )
    ap.add_argument(
        "--sleep-cycle",
        nargs="+",
        default=None,
        help="grpo: before every run, sleep the engine, take memory as the trainer does, wake it, free the "
        "memory: 'G' GiB in one piece, 'GxM' G GiB (all: the free memory less 2 GiB) in M MiB pieces "
        "with every other one freed before the wake (a fragmented device), 'none' no cycle; the first "
        "value reported in full, the others (repeats allowed) as sleep_cycle_variants: a rollout "
        "inside a step starts after a sleep. 'none' after a cycle keeps the layout that cycle left: "
        "compare an unfragmented engine in a process of its own",
    )
    ap.add_argument(
        "--heat-s",
        type=float,
        default=0.0,
        help="grpo: this many seconds of bf16 GEMMs at full power right before the reported runs",
    )
    ap.add_argument(
        "--process-state",
        nargs="*",
        default=[],
        choices=("nccl", "nccl-avg", "fsdp", "fsdp-backward", *ACTOR_ARMS, "compile", "pinned", "backward", "adam"),
        help="what a training step's process has, given to this one before the engine is built: the "
        "workers' NCCL group (gloo on CPU), the trainer's compiled decoder layers (GPU only), "
        "--pinned-gb of page-locked host memory copied to the device and back once, held "
        "throughout (an offloading trainer's host buffers; GPU only), a training forward and backward "
        "of the model (16 × 1024 tokens, eager), a fused AdamW step over it (states freed after); "
        "nccl-avg: a one-rank AVG all-reduce (a NCCL kernel); fsdp: the actor's update as the product "
        "runs it, FSDP2 at one rank on a float32 copy (state kept); fsdp-backward: the same without its "
        "optimizer step; actor: the product's actor role (Trainer) and its update over a synthetic "
        "rollout of the grpo case's shape (state kept); actor-eager: the same with compile off; "
        "actor-logprob / actor-init: the role only up to its log-prob pass / only loaded; then --l2-reset",
    )
    ap.add_argument(
        "--stack-reset",
        action="store_true",
        help="after --process-state: the stack limit set up and back (the context's local memory resized)",
    )
    ap.add_argument(
        "--release-state",
        action="store_true",
        help="after --process-state: drop what it kept (torch.compiler.reset, gc, empty_cache)",
    )
    ap.add_argument(
        "--l2-reset",
        action="store_true",
        help="after --process-state: cudaCtxResetPersistingL2Cache (lines a kernel left persisting in L2)",
    )
    ap.add_argument(
        "--pinned-gb",
        type=float,
        default=20.0,
        help="--process-state pinned: GiB (the 1.5B step's offloaded actor, Adam state and reference)",
    )
    ap.add_argument(
        "--live-gb",
        type=float,
        default=0.0,
        help="GiB held on the device for the whole run, taken before the engine is built (a trainer's "
        "resident state, in one piece): the footprint without the fragmentation of --sleep-cycle GxM",
    )
    ap.add_argument(
        "--shared-prefix-tokens",
        type=int,
        nargs="+",
        default=[NativeOptions.shared_prefix_tokens],
        help="grpo: engine.native.shared_prefix_tokens values to run, the first reported in full, the others "
        "as shared_prefix_tokens_variants (0: every row reads its shared prompt blocks itself)",
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--kv-block-size", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true", help="single: skip transformers generate (slow at large sizes)")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly")
    ap.add_argument("--no-kernels", action="store_true", help="torch ops instead of the Triton decode kernels")
    ap.add_argument(
        "--no-skinny-gemm",
        action="store_true",
        help="every projection in F.linear (no split-K Triton GEMMs, no batched cuBLAS splits)",
    )
    ap.add_argument(
        "--no-rope-attention",
        action="store_true",
        help="decode attention as rope_write then decode_attention (two kernels), not the one kernel",
    )
    ap.add_argument(
        "--attention-tile-keys",
        type=int,
        default=0,
        help="keys per step of the decode attention kernel's loop (0: the kernel's own choice)",
    )
    ap.add_argument("--torch-sampler", action="store_true", help="single: also time the torch sampler path")
    ap.add_argument("--parity-rows", type=int, default=8, help="samples checked against a full forward")
    ap.add_argument(
        "--profile",
        help="GPU: a profiler table to this file (single, grpo: one warm generate; "
        "multiturn: one staggered run with the last --join-wait, by CPU time)",
    )
    ap.add_argument(
        "--model-dir",
        help="a saved causal LM to load instead of a random one of --shape (e.g. the one "
        "benchmarks/step.py --model-dir wrote, to bench the step's own weights)",
    )
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    if len(set(ACTOR_ARMS) & set(args.process_state)) > 1:
        ap.error(f"--process-state: give one of {', '.join(ACTOR_ARMS)} (one role per process)")

    device = torch.device(args.device)
    if args.attention_tile_keys:
        attention_kernels.tile_keys = lambda head_dim: args.attention_tile_keys
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny shapes gain nothing from more; on a loaded machine OpenMP's waiting costs 10×
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype != "auto"
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    live = torch.empty(int(args.live_gb * 2**30), dtype=torch.uint8, device=device) if args.live_gb else None
    model = build_model(args.shape, dtype, device, args.model_dir)
    process_state = step_process_state(
        args.process_state,
        model,
        device,
        args.pinned_gb,
        (args.prompts, args.samples, args.prompt_len, args.new_tokens),
    )
    if args.release_state:
        process_state["released"] = release_process_state(device)
    if args.stack_reset:
        process_state["stack_reset"] = reset_stack_limit(device)
    if args.l2_reset:
        process_state["l2_reset"] = reset_persisting_l2(device)
    process_state["device_limits"] = device_limits(device)
    cases = ("single", "grpo", "multiturn") if args.case == "all" else (args.case,)
    rows = {
        "single": args.batch,
        "grpo": args.prompts * args.samples,
        "multiturn": min(args.max_rows or args.trajectories, args.trajectories),
    }
    result = {
        "shape": args.shape,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "kv_block_size": args.kv_block_size,
        "kernels": not args.no_kernels,
        "cuda_graphs": not args.no_cuda_graphs,
        "model_dir": args.model_dir,
        "live_gb": args.live_gb,
        "process_state": process_state,
    }
    # More trajectories than rows: room for every trajectory's whole context, so a turn back from its tool finds its
    # prefix still cached (by demand, the cache holds only the rows' sequences and evicts the waiting ones' prefixes).
    context = args.prompt_len + args.new_tokens + args.turns * args.tool_tokens
    kv_blocks = (
        1 + args.trajectories * -(-context // args.kv_block_size) if rows["multiturn"] < args.trajectories else 0
    )
    for case in cases:
        engine = build_engine(model, args, max(rows[c] for c in cases), kv_blocks if case == "multiturn" else 0)
        result[case] = {"single": case_single, "grpo": case_grpo, "multiturn": case_multiturn}[case](
            model, engine, args, device
        )
        result[case]["pdl_mode_final"] = engine.runner.pdl_mode
        choice = engine.runner.pdl_choice
        if choice is not None and choice.verdict is not None:  # `--pdl auto`'s last verdict
            v = choice.verdict
            result[case]["pdl_verdict"] = {
                "pdl": v.pdl,
                "on_ms": v.on_ms,
                "off_ms": v.off_ms,
                "gain": v.gain,
                "choices": choice.choices,
            }
        if device.type == "cuda":
            result[case]["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        engine.shutdown()
    del live
    if process_state.get("nccl"):
        import torch.distributed as dist

        dist.destroy_process_group()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
