"""Trainer throughput: the actor's update (in several configurations) against a plain FSDP2 step, in one process; JSON.

    python -m benchmarks.trainer --shape 1.5b --variants default,eager,eager+unfused_logprobs,eager+foreach,chunk
    python -m benchmarks.trainer --shape tiny --device cpu --batch 2 --seq 64 --variants default,chunk
    python -m benchmarks.trainer --shape 1.5b --batch 128 --seq 1280 --prompt-len 256 --lengths lognormal \
        --max-tokens 12288 --variants default,mask

Each variant is the run's actor role (`build_components`, the config's trainer.* settings plus the variant's
overrides, --variants names them; `a+b` combines two), training on the same batch × seq tokens (prompt-len of prompt,
the rest response, all trained on), timed over --iters updates after --warmup ones (median). The plain baseline — the
HF model, fully_shard per layer + root, bf16 mixed precision on the GPU, the model's own loss, AdamW — runs first and
again last, so drift shows; `ratio_vs_plain` is against the median of its runs, `mfu` (GPU) is 6·N·tokens/s over the
dense bf16 peak. --profile DIR also writes torch.profiler tables (top ops by device time) of one update of the
baseline and of each variant. Times are the device's named in `gpu` (or the CPU's). With --lengths the responses
take a drawn mix of lengths (benchmarks/lengths.py) instead of all running to the end: throughput then counts real
(unpadded) tokens, of the update and of the log-prob pass, and --micro / --max-tokens split the rows by count or by
token budget; `pad_frac` is the padding share of the positions the trainer computed.

JSON: the labels (`shape`, `device`, `gpu`, versions, `params`, `batch`, `seq`, `lengths`, `micro_batch_size`,
`max_tokens_per_micro_batch`, `overrides`), `plain_fsdp2_tok_s` (its first and last runs) and `plain_median_tok_s`,
and `variants`: {name: overrides, tok_s, logprob_tok_s, pad_frac, step_s_median, steps_s, build_s, warmup_s,
ratio_vs_plain, and on the GPU peak_memory_gb and mfu}.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import (
    add_model_args,
    add_run_args,
    bench_config,
    bench_worker,
    device_info,
    emit,
    exit_now,
    gpu_peak_flops,
    init_single_process,
    make_model_dir,
    model_vocab,
    note,
    pick_device,
    sync,
)
from benchmarks.lengths import LENGTHS, draw_lengths
from hybridrl.batch import Batch
from hybridrl.models.config import ModelConfig
from hybridrl.models.loading import load_causal_lm

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
    """The config overrides of a variant name (`a+b`: both parts')."""
    out: list[str] = []
    for part in name.split("+"):
        if part not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {part!r}; known: {', '.join(VARIANTS)} (or a+b)")
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


def _timed_runs(step, device: torch.device, warmup: int, iters: int) -> list[float]:
    """Seconds of each of `iters` calls of `step` after `warmup` untimed ones."""
    times = []
    for i in range(warmup + iters):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _profile_table(step, device: torch.device, rows: int = 30) -> str:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        sync(device)
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


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m benchmarks.trainer`."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.trainer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(ap, "1.5b")
    ap.add_argument("--batch", type=int, default=8, help="sequences per update (one micro-batch)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of each sequence (not trained on)")
    ap.add_argument(
        "--variants",
        default="default,eager,eager+unfused_logprobs,eager+foreach,chunk",
        help=f"comma-separated trainer configurations to time, each one of {', '.join(VARIANTS)} or a+b: "
        + "; ".join(f"{k}: {' '.join(v) or 'the config as it is'}" for k, v in VARIANTS.items()),
    )
    ap.add_argument("--warmup", type=int, default=2, help="untimed updates first (compiles, allocator, Adam state)")
    ap.add_argument("--iters", type=int, default=5, help="timed updates per variant (the median is reported)")
    ap.add_argument("--profile", metavar="DIR", help="also write profiler tables of one update of each to DIR")
    ap.add_argument(
        "--lengths",
        choices=LENGTHS,
        default="fixed",
        help="response lengths (benchmarks/lengths.py); throughput then counts real (unpadded) tokens",
    )
    ap.add_argument("--micro", type=int, default=0, help="trainer.micro_batch_size (default: --batch)")
    ap.add_argument("--max-tokens", type=int, default=0, help="trainer.max_tokens_per_micro_batch (0: rows)")
    ap.add_argument(
        "--skip-plain",
        action="store_true",
        help="time no plain FSDP2 baseline (it runs --batch rows as one batch, which a long batch may not fit)",
    )
    add_run_args(ap)
    return ap


def time_variant(name: str, path: str, device: torch.device, args, vocab: int) -> tuple[dict, int, str | None]:
    """One variant's actor, built by the run's builder, timed on the bench's batch; its figures, the policy's
    parameter count, and with --profile its profiler table."""
    overrides = [
        "trainer.lr=1e-6",
        f"trainer.micro_batch_size={args.micro or args.batch}",
        f"trainer.max_tokens_per_micro_batch={args.max_tokens}",
        "trainer.steps=1000",
        "data.train_batch_size=1",
        *args.set,
        *variant_overrides(name),
    ]
    cfg = bench_config(path, device, overrides)
    t_build = time.perf_counter()
    trainer = bench_worker(cfg, device, with_engine=False).actor
    params = sum(p.numel() for p in trainer.model.parameters())
    t_first = time.perf_counter()
    lengths = draw_lengths(args.lengths, args.seq - args.prompt_len, args.batch)
    tokens = args.batch * args.prompt_len + sum(lengths)  # real tokens (all of them with --lengths fixed)
    batch = throughput_batch(args.batch, args.seq, args.prompt_len, vocab, lengths)
    update = functools.partial(trainer.update, batch)
    times = _timed_runs(update, device, args.warmup, args.iters)
    warmup_s = time.perf_counter() - t_first - sum(times)
    pad_frac = trainer.meter.metrics().get("perf/pad_frac")
    logprob_times = _timed_runs(functools.partial(logprob_pass, trainer, batch), device, 1, args.iters)
    out = {
        "overrides": variant_overrides(name),
        "tok_s": tokens / statistics.median(times),
        "step_s_median": statistics.median(times),
        "steps_s": times,
        "build_s": t_first - t_build,
        "warmup_s": warmup_s,
        "logprob_tok_s": tokens / statistics.median(logprob_times),
        "pad_frac": pad_frac,
    }
    if device.type == "cuda":
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    table = _profile_table(update, device) if args.profile else None
    del trainer, update
    _free(device)
    return out, params, table


def main() -> None:
    """Run the benchmark the command line describes and print its JSON."""
    args = parser().parse_args()
    device = pick_device(args.device)
    names = args.variants.split(",")
    for name in names:
        variant_overrides(name)  # an unknown name fails before any model loads
    init_single_process(device)
    path = make_model_dir(args.shape, device, args.model_dir)
    vocab = model_vocab(path)
    profiles: dict[str, str] = {}
    baseline = functools.partial(plain_fsdp_tok_s, path, device, args.batch, args.seq, vocab, args.iters)
    plain = [] if args.skip_plain else [baseline(profiles if args.profile else None)]
    results, params = {}, 0
    for name in names:
        results[name], params, table = time_variant(name, path, device, args, vocab)
        if table is not None:
            profiles[name] = table
        note(f"variant {name}: {results[name]['tok_s']:.0f} tok/s")
    if plain:
        plain.append(baseline())
    base = statistics.median(plain) if plain else None
    for r in results.values():
        r["ratio_vs_plain"] = r["tok_s"] / base if base else None
        if device.type == "cuda":
            r["mfu"] = 6 * params * r["tok_s"] / gpu_peak_flops()
    result = {
        "shape": args.shape,
        "model_dir": args.model_dir,
        **device_info(device),
        "params": params,
        "batch": args.batch,
        "seq": args.seq,
        "lengths": args.lengths,
        "micro_batch_size": args.micro or args.batch,
        "max_tokens_per_micro_batch": args.max_tokens,
        "overrides": args.set,
        "plain_fsdp2_tok_s": plain,
        "plain_median_tok_s": base,
        "variants": results,
    }
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        Path(args.profile, f"profile_trainer_{args.shape}.txt").write_text(
            "\n\n".join(f"===== {k} =====\n{v}" for k, v in profiles.items())
        )
    emit(result, args.out)
    exit_now()  # processes that used a DeviceMesh sometimes abort at interpreter exit


if __name__ == "__main__":
    main()
