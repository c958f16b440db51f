"""Benchmark the native engine (fused decoder, KV cache, CUDA graphs) against transformers' `generate` (dynamic
cache) on random-init Qwen2.5 shapes, in one run, on the same weights; prints JSON.

    python tools/bench_engine.py --shape 0.5b --batch 64 --new-tokens 256 --device cuda
    python tools/bench_engine.py --shape 1.5b --batch 256 --new-tokens 1024 --device cuda --skip-hf
    python tools/bench_engine.py --shape tiny --device cpu

Both sample at temperature 1 with no top-k/top-p and never stop early (no EOS), so both produce exactly
batch × new_tokens tokens. The engine is timed twice: `cold` includes CUDA-graph capture (what every RL
iteration pays, since sleep drops the graphs), `warm` reuses them. Parity: the engine's log-probs of its own
tokens against a trainer-style full forward of the transformers model (float32 log_softmax of its logits).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridrl.engines.base import SamplingParams  # noqa: E402
from hybridrl.engines.config import EngineConfig  # noqa: E402
from hybridrl.engines.native import NativeEngine  # noqa: E402

# Qwen2.5 shapes (hidden, layers, heads, kv heads, intermediate, vocab, tied)
SHAPES = {
    "tiny": (64, 2, 4, 2, 128, 1000, True),
    "0.5b": (896, 24, 14, 2, 4864, 151936, True),
    "1.5b": (1536, 28, 12, 2, 8960, 151936, True),
}


def build_model(shape: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A randomly initialized Qwen2 causal LM of `shape` (transformers' own init), on `device`."""
    h, n, heads, kv, inter, vocab, tied = SHAPES[shape]
    config = transformers.Qwen2Config(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads,
                                      num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                                      tie_word_embeddings=tied, max_position_embeddings=32768)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[float, object]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def bench_hf(model, prompts: torch.Tensor, new_tokens: int, device: torch.device) -> dict:
    """transformers `generate` with its default dynamic cache, sampling, no early stop."""
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0,
              top_p=1.0, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(prompts))
    with torch.inference_mode():
        model.generate(prompts[:, :8], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4,
                                          "attention_mask": torch.ones_like(prompts[:, :8])})  # warm-up
        seconds, out = timed(lambda: model.generate(prompts, **kw), device)
    tokens = (out.shape[1] - prompts.shape[1]) * out.shape[0]
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


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


def step_breakdown(engine, batch: int, attend: int, device: torch.device) -> dict:
    """What one decode step costs, part by part, at `batch` rows attending `attend` positions: the (graphed)
    forward, and the sampler as a fused kernel and on the torch path; plus kernel-vs-torch agreement."""
    from hybridrl.engines.sampling import sample_tokens

    run = engine.runner
    length = run.length_for(attend)
    logits = run.step(batch, length)[:, : engine.vocab].clone()
    keys = torch.arange(batch, device=device, dtype=torch.int64) * 7919 + 11
    out = {"batch": batch, "attended": length,
           "forward_ms": cuda_ms(lambda: run.step(batch, length), device),
           "sampler_kernel_ms": cuda_ms(lambda: sample_tokens(logits, 1.0, keys=keys, step=3), device),
           "sampler_torch_ms": cuda_ms(lambda: sample_tokens(logits, 1.0, keys=keys, step=3, kernel=False), device)}
    same, lp_diff, rows = 0, 0.0, 0
    for step in range(20):
        tk, lk = sample_tokens(logits, 1.0, keys=keys, step=step)
        tt, lt = sample_tokens(logits, 1.0, keys=keys, step=step, kernel=False)
        same += int((tk == tt).sum())
        rows += batch
        lp_diff = max(lp_diff, float((lk - lt).abs().max()))
    out["kernel_vs_torch"] = {"draws": rows, "same_token": same / rows, "max_abs_logprob_diff": lp_diff}
    return out


def profile_table(fn, device: torch.device, rows: int = 30) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--skip-hf", action="store_true", help="skip transformers generate (slow at large sizes)")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly")
    ap.add_argument("--parity-rows", type=int, default=8, help="samples checked against a full forward")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--torch-sampler", action="store_true",
                    help="also time generation with the sampler on the torch path (no fused kernel), side by side")
    ap.add_argument("--profile", help="GPU: write profiler tables (one warm generate; step parts) to this file")
    args = ap.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = build_model(args.shape, dtype, device)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts_t = torch.randint(2, vocab, (args.batch, args.prompt_len), generator=gen)
    prompts = prompts_t.tolist()

    cfg = EngineConfig(max_batch_size=args.batch, cuda_graphs=not args.no_cuda_graphs)
    engine = NativeEngine.fused(model.config, [], 0, device=device, dtype=dtype, cfg=cfg, seed=0)
    engine.load_from(model)
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    total = args.batch * args.new_tokens
    cold, outs = timed(lambda: engine.generate(prompts, params), device)
    warm, outs = timed(lambda: engine.generate(prompts, params), device)
    produced = sum(len(o.token_ids) for o in outs)
    result = {
        "shape": args.shape, "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "engine": {"tokens": produced, "seconds_cold": cold, "seconds_warm": warm,
                   "tokens_per_s_cold": total / cold, "tokens_per_s": total / warm,
                   "cuda_graphs": len(engine.runner.graphs), "graphs_enabled": engine.runner.use_graphs,
                   "kv_cache_gb": engine.memory_stats()["engine_kv_cache_gb"]},
        "parity": parity(model, prompts, outs, args.parity_rows),
    }
    if produced != total:
        result["error"] = f"engine produced {produced} tokens, expected {total}"
    if device.type == "cuda":
        result["engine"]["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["step_parts"] = step_breakdown(engine, args.batch, args.prompt_len + args.new_tokens, device)
        if args.profile:
            Path(args.profile).write_text(profile_table(lambda: engine.generate(prompts, params), device))
    if args.torch_sampler:
        engine.cfg.sampler_kernel = False
        t_torch, _ = timed(lambda: engine.generate(prompts, params), device)
        engine.cfg.sampler_kernel = True
        result["engine_torch_sampler"] = {"seconds_warm": t_torch, "tokens_per_s": total / t_torch}
    engine.sleep(2)
    if not args.skip_hf:
        result["hf_generate"] = bench_hf(model, prompts_t.to(device), args.new_tokens, device)
        result["speedup"] = result["engine"]["tokens_per_s"] / result["hf_generate"]["tokens_per_s"]
        result["speedup_cold"] = result["engine"]["tokens_per_s_cold"] / result["hf_generate"]["tokens_per_s"]
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
