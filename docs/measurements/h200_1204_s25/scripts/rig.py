"""Session 25's rig for layout.py, forced.py and pin.py: the GRPO bench's 1.5B engine (256 rows: 32 prompts x 8
samples, 512 new tokens, PDL off to start), one measured rollout, and an `auto` choice forced to a kind. As run, a
forced choice captured only that kind's decode graphs; since commit 13ae26a `auto` captures each with its twin of the
other kind (never replayed here)."""

import dataclasses
import sys
import types

import torch

sys.path.insert(0, "tools")
import bench_engine as be  # noqa: E402
from hybridrl.engines.fused.launch_choice import PdlVerdict  # noqa: E402
from hybridrl.engines.kernels import pdl as pdl_switch  # noqa: E402

DEVICE = torch.device("cuda")


def grpo_engine():
    """The bench's model and engine, and its 32 prompts of 128 tokens."""
    args = types.SimpleNamespace(no_cuda_graphs=False, no_kernels=False, kv_block_size=16, join_step_tokens=[512],
                                 pdl=["off"], no_skinny_gemm=False, no_rope_attention=False)
    model = be.build_model("1.5b", torch.bfloat16, DEVICE)
    engine = be.build_engine(model, args, 256)
    gen = torch.Generator().manual_seed(2)
    return engine, torch.randint(2, model.config.vocab_size, (32, 128), generator=gen).tolist()


def measure(engine, prompts) -> dict:
    """bench_engine's run_generate (tok/s, decode step) and launch_timing (device time per decode launch)."""
    res, _, params = be.run_generate(engine, prompts, 8, 512, DEVICE)
    lt = be.timed_launches(engine, prompts, params, DEVICE)
    return {"tokens_per_s": res["tokens_per_s"], "decode_step_ms": res["decode_step_ms"],
            "busy_ms_median": lt["busy_ms_median"], "gap_ms_total": lt["gap_ms_total"]}


def force_choice(run, kind: bool) -> None:
    """`auto`'s verdict given from the first step (no trial, no new choice at a wake-up)."""
    choice = run.pdl_choice
    choice.verdict, choice._deciding = PdlVerdict(kind, 0.0, 0.0), False
    choice.restart = lambda: None


def describe(run) -> dict:
    """The runner's launch settings and graphs after an arm."""
    choice = run.pdl_choice
    return {"mode": run.pdl_mode, "switch": pdl_switch.is_enabled(),
            "verdict": None if choice is None or choice.verdict is None else dataclasses.asdict(choice.verdict),
            "graph_kinds": sorted({str(k[-1]) for k in run.graphs}), "graphs": len(run.graphs)}
