"""A full GRPO step on one device with the phase breakdown, plus trainer throughput against plain FSDP2; JSON out.

    python tools/bench_step.py --shape 1.5b --device cuda            # the issue's case
    python tools/bench_step.py --shape tiny --device cpu --new-tokens 16 --prompts 4   # a quick check

Step: offload trainer → wake engine → generate → sleep(2) → onload params → log-probs (policy + ref)
→ onload optimizer → update → reshard. Switching = offload + wake + sleep + onload_* + reshard; its
share of the step is reported. Throughput: our trainer's update on batch × seq tokens, and in the
same run a plain FSDP2 step (fully_shard per layer + root, bf16 mixed precision, HF loss) on the
same tokens; tokens/s, MFU (6·N·tokens/s over the dense bf16 peak) and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_common import Timer, gpu_peak_flops, init_single_process, make_model_dir, random_prompts  # noqa: E402
from bench_trainer import plain_fsdp_tok_s, throughput_batch  # noqa: E402
from hybridrl.algorithms import AlgorithmConfig, grpo_advantages  # noqa: E402
from hybridrl.controller import completions_to_batch  # noqa: E402
from hybridrl.data.prompts import Prompt  # noqa: E402
from hybridrl.engines import build_engine  # noqa: E402
from hybridrl.engines.base import SamplingParams  # noqa: E402
from hybridrl.engines.config import EngineConfig  # noqa: E402
from hybridrl.models.config import ModelConfig  # noqa: E402
from hybridrl.models.loading import load_tokenizer  # noqa: E402
from hybridrl.reshard import ReshardConfig, Resharder  # noqa: E402
from hybridrl.training.config import TrainerConfig  # noqa: E402
from hybridrl.training.trainer import Trainer  # noqa: E402

SWITCH = ("offload", "wake", "sleep", "onload_params", "onload_optim", "reshard")


def grpo_step(step: int, trainer, engine, resharder, prompts, args, t: Timer) -> dict:
    with t("offload"):
        trainer.offload()
    with t("wake"):
        engine.wake_up(["weights", "kv_cache"])
    with t("generate"):
        comps = engine.generate([p.token_ids for p in prompts], SamplingParams(
            n=args.group, temperature=1.0, max_new_tokens=args.new_tokens, seed=step))
    with t("sleep"):
        engine.sleep(2)
    batch = completions_to_batch(prompts, comps)
    with t("onload_params"):
        trainer.onload_params()
    with t("logprob"):
        for k, v in trainer.compute_logprobs(batch).items():
            batch[k] = v
    batch["advantages"] = grpo_advantages(torch.randn(len(batch), generator=torch.Generator().manual_seed(step)), args.group)
    with t("onload_optim"):
        trainer.onload_optimizer()
    with t("update"):
        trainer.update(batch)
    with t("reshard"):
        engine.wake_up(["weights"])
        stats = resharder.sync(trainer.model)
    return {"response_tokens": int(batch["response_mask"].sum()), "reshard_bytes": stats.bytes_moved}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1.5b")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--micro", type=int, default=8, help="trainer micro-batch (sequences)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up steps")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed steps first: the first update creates Adam state, whose pinned host buffers "
                         "are allocated at the following offload")
    ap.add_argument("--tp-batch", type=int, default=8, help="throughput test: sequences")
    ap.add_argument("--tp-seq", type=int, default=1024, help="throughput test: tokens per sequence")
    ap.add_argument("--tp-iters", type=int, default=3)
    ap.add_argument("--impl", default="auto", help="native engine implementation (auto | fused | hf)")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--offload", default="params,optimizer", help="trainer.offload on GPU (none to keep all resident)")
    args = ap.parse_args()

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    init_single_process(device)
    path = make_model_dir(args.shape, device, args.model_dir)
    tok = load_tokenizer(path)
    mcfg = ModelConfig(name="hf", path=path)
    n_rows = args.prompts * args.group
    tcfg = TrainerConfig(lr=1e-6, micro_batch_size=args.micro, offload=args.offload if device.type == "cuda" else "none")
    acfg = AlgorithmConfig(group_size=args.group)
    trainer = Trainer(path, mcfg, tcfg, acfg, device, tok.pad_token_id, 1.0, total_optimizer_steps=100)
    ecfg = EngineConfig(max_new_tokens=args.new_tokens, max_batch_size=max(256, n_rows), impl=args.impl)
    engine = build_engine(ecfg, mcfg, path, tok, device)
    resharder = Resharder(ReshardConfig(dtype="bfloat16" if device.type == "cuda" else None), engine, trainer.model.config)
    vocab = trainer.model.config.vocab_size
    prompts = [Prompt(ids, "", {}) for ids in random_prompts(args.prompts, args.prompt_len, vocab)]
    n_params = sum(p.numel() for p in trainer.model.parameters())

    steps = []
    for step in range(args.warmup + args.steps):
        t = Timer(device)
        t0 = time.perf_counter()
        info = grpo_step(step, trainer, engine, resharder, prompts, args, t)
        total = time.perf_counter() - t0
        if step >= args.warmup:  # warm-up: allocators, CUDA graphs, kernels, pinned offload buffers
            steps.append({"total_s": total, "phases_s": dict(t.times), "memory_after": dict(t.memory), **info})
    med = {p: statistics.median(s["phases_s"][p] for s in steps) for p in steps[0]["phases_s"]}
    total = statistics.median(s["total_s"] for s in steps)
    switching = sum(med[p] for p in SWITCH)
    resp_tokens = statistics.median(s["response_tokens"] for s in steps)

    # Trainer throughput, ours vs plain FSDP2, same tokens, same process.
    tb = throughput_batch(args.tp_batch, args.tp_seq, args.prompt_len, vocab)
    trainer.cfg.micro_batch_size = args.tp_batch
    tt = []
    for i in range(args.tp_iters + 1):
        t = Timer(device)
        with t("u"):
            trainer.update(tb)
        if i:
            tt.append(t.times["u"])
    ours = args.tp_batch * args.tp_seq / statistics.median(tt)
    trainer.offload()  # make room for the baseline's own copy
    engine.sleep(2)
    plain = plain_fsdp_tok_s(path, device, args.tp_batch, args.tp_seq, vocab, args.tp_iters)
    peak = gpu_peak_flops()
    result = {
        "shape": args.shape, "device": str(device), "params": n_params, "engine": type(engine).__name__,
        "trainer_offload": ",".join(tcfg.offload) or "none",
        "engine_impl": getattr(engine, "impl", args.impl),
        "rollout": {"prompts": args.prompts, "group": args.group, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens},
        "step_s_median": total, "phases_s_median": med,
        "per_step_phases_s": [s["phases_s"] for s in steps],
        "switching_s": switching, "switching_share": switching / total,
        "rollout_tokens_per_s": resp_tokens / med["generate"],
        "reshard_gb_per_s": steps[-1]["reshard_bytes"] / med["reshard"] / 1e9 if med["reshard"] else None,
        "memory_after_phase": steps[-1]["memory_after"],
        "trainer_throughput": {
            "batch": args.tp_batch, "seq": args.tp_seq,
            "ours_tok_s": ours, "plain_fsdp2_tok_s": plain, "ratio": ours / plain,
            "ours_mfu": 6 * n_params * ours / peak if device.type == "cuda" else None,
            "plain_mfu": 6 * n_params * plain / peak if device.type == "cuda" else None,
        },
    }
    print(json.dumps(result, indent=2))
    out = os.environ.get("OUT")
    if out:
        Path(out, f"bench_step_{args.shape}_p{args.prompts}_n{args.new_tokens}_offload-{'-'.join(tcfg.offload) or 'none'}.json").write_text(json.dumps(result, indent=2))
    sys.stdout.flush()
    os._exit(0)  # processes that used DeviceMesh sometimes abort at interpreter exit


if __name__ == "__main__":
    main()
