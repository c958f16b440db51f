"""Trainer throughput: our FSDP2 update (in several configurations) against a plain FSDP2 step, one process; JSON.

    python -m benchmarks.trainer --shape 1.5b --variants default,eager,eager+unfused_logprobs,eager+foreach,chunk
    python -m benchmarks.trainer --shape tiny --device cpu --batch 2 --seq 64 --variants default,chunk
    python -m benchmarks.trainer --shape 1.5b --batch 128 --micro 16 --seq 768 --prompt-len 256 --variants default \
        --lengths lognormal --max-tokens 12288        # issue 46's mixes: real-token throughput, peak, padding

Every variant trains on the same batch × seq tokens (prompt-len of prompt, the rest response, all trained on)
and is timed over --iters updates after --warmup ones (median). The plain baseline — HF model, fully_shard per
layer + root, bf16 mixed precision, HF's own loss, AdamW — runs first and again last, so drift shows; the ratio
is against the median of its runs. --profile DIR also writes torch.profiler tables (top kernels by device time)
of one update of the baseline and of each variant. With --lengths the responses take a drawn mix of lengths
(benchmarks/lengths.py) instead of all running to the end: throughput then counts real (unpadded) tokens, of the
update and of the log-prob pass, and --micro / --max-tokens split the rows by count or by token budget.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch  # noqa: E402

from benchmarks.common import (
    add_model_args,
    bench_config,
    bench_worker,
    gpu_peak_flops,
    init_single_process,
    make_model_dir,
)  # noqa: E402
from benchmarks.lengths import LENGTHS, draw_lengths  # noqa: E402
from hybridrl.batch import Batch  # noqa: E402
from hybridrl.models.config import ModelConfig  # noqa: E402
from hybridrl.models.loading import load_causal_lm  # noqa: E402

# Named trainer configurations (config overrides, as on the command line); "a+b" combines them.
VARIANTS = {
    "default": [],
    "foreach": ["trainer.fused_optimizer=false"],
    "unfused_logprobs": ["trainer.fused_logprobs=false"],
    "chunk": ["trainer.logprob_chunk_size=2048"],
    "eager": ["trainer.compile=false"],
    "padded": ["trainer.padding_free=false"],
    "mask": ["trainer.packed_attention=model"],  # transformers' block-diagonal mask (sdpa) instead of varlen
}


def variant_overrides(name: str) -> list[str]:
    out: list[str] = []
    for part in name.split("+"):
        if part not in VARIANTS:
            raise SystemExit(f"unknown variant {part!r}; known: {sorted(VARIANTS)}")
        out += VARIANTS[part]
    return out


def throughput_batch(batch: int, seq: int, prompt: int, vocab: int, lengths: list[int] | None = None) -> Batch:
    """`batch` rows of `seq` tokens: `prompt` of prompt, the rest response, all trained on; with `lengths`, row i's
    response ends after lengths[i] tokens."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(300, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq - prompt)
    if lengths is not None:
        mask = (torch.arange(seq - prompt)[None] < torch.tensor(lengths)[:, None]).float()
    b = Batch(
        [r[:prompt].tolist() for r in ids],
        {
            "responses": ids[:, prompt:].clone(),
            "response_mask": mask,
            "engine_logprobs": torch.full((batch, seq - prompt), -11.0),
        },
    )
    b["old_logprobs"] = torch.full((batch, seq - prompt), -11.0)
    b["ref_logprobs"] = torch.full((batch, seq - prompt), -11.0)
    b["advantages"] = torch.linspace(-1, 1, batch)
    return b


def logprob_pass(trainer, batch: Batch) -> None:
    """The actor's no-grad log-prob pass over `batch`, as the logprob phase runs it."""
    trainer.compute_logprobs(trainer.micro_batches(batch))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_runs(step, device: torch.device, warmup: int, iters: int) -> list[float]:
    times = []
    for i in range(warmup + iters):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _profile_table(step, device: torch.device, rows: int = 30) -> str:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        _sync(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def plain_fsdp_step(path: str, device: torch.device, batch: int, seq: int, vocab: int):
    """The baseline's step function (HF model, fully_shard + bf16 mixed precision, HF loss, AdamW) and its parts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = load_causal_lm(path, ModelConfig(name="hf", path=path), torch.float32, device)
    mesh = init_device_mesh(device.type, (1,))
    kw = {"mesh": mesh}
    if device.type == "cuda":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(300, vocab, (batch, seq), device=device)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, (model, opt)


def plain_fsdp_tok_s(
    path: str,
    device: torch.device,
    batch: int,
    seq: int,
    vocab: int,
    iters: int,
    profiles: dict[str, str] | None = None,
) -> float:
    """Tokens/s of the plain FSDP2 baseline (median of `iters` steps after one warm-up); with `profiles`,
    also its profiler table under "plain"."""
    step, keep = plain_fsdp_step(path, device, batch, seq, vocab)
    times = _timed_runs(step, device, 1, iters)
    if profiles is not None:
        profiles["plain"] = _profile_table(step, device)
    del step, keep
    _free(device)
    return batch * seq / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "1.5b")
    ap.add_argument("--batch", type=int, default=8, help="sequences per update (one micro-batch)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--variants", default="default,eager,eager+unfused_logprobs,eager+foreach,chunk")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--profile", default=None, help="folder for profiler tables")
    ap.add_argument("--lengths", choices=LENGTHS, default="fixed", help="response lengths (benchmarks/lengths.py)")
    ap.add_argument("--micro", type=int, default=0, help="trainer.micro_batch_size (default: --batch)")
    ap.add_argument("--max-tokens", type=int, default=0, help="trainer.max_tokens_per_micro_batch (0: rows)")
    args = ap.parse_args()

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    init_single_process(device)
    path = make_model_dir(args.shape, device, args.model_dir)
    lengths = draw_lengths(args.lengths, args.seq - args.prompt_len, args.batch)
    tokens = args.batch * args.prompt_len + sum(lengths)  # real tokens (all of them with --lengths fixed)
    profiles: dict[str, str] = {}
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    plain = [
        plain_fsdp_tok_s(path, device, args.batch, args.seq, vocab, args.iters, profiles if args.profile else None)
    ]
    results = {}
    n_params = None
    for name in args.variants.split(","):
        cfg = bench_config(
            path,
            device,
            [
                "trainer.lr=1e-6",
                f"trainer.micro_batch_size={args.micro or args.batch}",
                f"trainer.max_tokens_per_micro_batch={args.max_tokens}",
                "trainer.steps=1000",
                "data.train_batch_size=1",
                *variant_overrides(name),
            ],
        )
        t_build = time.perf_counter()
        trainer = bench_worker(cfg, device, with_engine=False).actor
        n_params = sum(p.numel() for p in trainer.model.parameters())
        batch = throughput_batch(args.batch, args.seq, args.prompt_len, vocab, lengths)
        t_first = time.perf_counter()
        update = functools.partial(trainer.update, batch)
        times = _timed_runs(update, device, args.warmup, args.iters)
        warm_s = time.perf_counter() - t_first - sum(times)
        pad_frac = trainer.meter.metrics().get("perf/pad_frac")
        logprob_times = _timed_runs(functools.partial(logprob_pass, trainer, batch), device, 1, args.iters)
        results[name] = {
            "overrides": variant_overrides(name),
            "tok_s": tokens / statistics.median(times),
            "step_s_median": statistics.median(times),
            "steps_s": times,
            "build_s": t_first - t_build,
            "warmup_s": warm_s,
            "logprob_tok_s": tokens / statistics.median(logprob_times),
            "pad_frac": pad_frac,
        }
        if device.type == "cuda":
            results[name]["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
        print(
            f"variant {name}: {results[name]['tok_s']:.0f} tok/s (plain first run {plain[0]:.0f}), "
            f"warm-up {warm_s:.1f} s",
            flush=True,
        )
        if args.profile:
            profiles[name] = _profile_table(update, device)
        del trainer, update
        _free(device)
    plain.append(plain_fsdp_tok_s(path, device, args.batch, args.seq, vocab, args.iters))
    base = statistics.median(plain)
    peak = gpu_peak_flops()
    for r in results.values():
        r["ratio_vs_plain"] = r["tok_s"] / base
        if device.type == "cuda":
            r["mfu"] = 6 * n_params * r["tok_s"] / peak
    out = {
        "shape": args.shape,
        "device": str(device),
        "params": n_params,
        "batch": args.batch,
        "seq": args.seq,
        "lengths": args.lengths,
        "real_tokens": tokens,
        "micro_batch_size": args.micro or args.batch,
        "max_tokens_per_micro_batch": args.max_tokens,
        "plain_fsdp2_tok_s": plain,
        "plain_median_tok_s": base,
        "variants": results,
        "torch": torch.__version__,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"bench_trainer_{args.shape}_{args.lengths}.json").write_text(text)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        Path(args.profile, f"profile_trainer_{args.shape}.txt").write_text(
            "\n\n".join(f"===== {k} =====\n{v}" for k, v in profiles.items())
        )
    sys.stdout.flush()
    os._exit(0)  # processes that used DeviceMesh sometimes abort at interpreter exit


if __name__ == "__main__":
    main()
