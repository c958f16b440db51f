"""Rollout throughput of the run's engine, built by the run's builder from a run config; prints JSON.

    python -m benchmarks.engine --shape 0.5b --batch 64 --new-tokens 256                   # against HF generate
    python -m benchmarks.engine --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512 \\
        --vary engine.native.shared_prefix_tokens=512,0                                    # two settings side by side
    python -m benchmarks.engine --case multiturn --shape 0.5b --trajectories 512 --max-rows 256 --turns 4 \\
        --turn-tokens 256 --tool-ms 50                                                     # the run's agent rollout
    python -m benchmarks.engine --case all --shape tiny --device cpu --new-tokens 8 --skip-hf   # a smoke check

The engine is the one `python -m hybridrl` builds for the same config: `build_components` builds the actor from the
model folder, the builder's `build_rollout` builds the engine (engine.name, engine.native.*, every --set override) and
fills it from the actor through the resharder, as a run's engine receives its weights. Each value of a `--vary KEY=A,B`
(every combination, with several) is another engine of the same actor, run on the same prompts in this process, one
after the other; every variant reports its figures and `tokens_per_s_vs_first`, its throughput over the first
variant's.

Cases (sampling per engine.temperature / top_p / top_k, temperature 1 by default; a sample ends at --new-tokens or at
EOS, which random weights seldom draw: `tokens` counts what was produced, `stopped_at_eos` the samples that stopped):

  single     --batch prompts, one sample each; against transformers' `generate` on the same weights (`hf_generate`,
             `tokens_per_s_vs_hf_generate`; --skip-hf leaves it out).
  grpo       --prompts × --samples, each group's samples sharing their prompt, as a GRPO rollout.
  multiturn  the run's agent rollout: a `HybridWorker` built from the run config with `rollout=agent` (per variant),
             its generate phase (`worker.generate`, the agent loop over the worker's engine, as the controller calls it)
             on --trajectories random prompts, with a tool that sleeps --tool-ms and returns --tool-tokens tokens
             (`benchmarks.multiturn_workload.SleepTool`, named by import path in agent.tools). A random-weight model
             writes no tool calls and no ends of turn: the loop reads every turn as a call (--turns turns each), and a
             turn ends at a random stop id, about one token in --turn-tokens (turns cut at random points). Against the
             same tokens single-turn: each trajectory's model tokens as one request, all at once through the same
             engine request path (`vs_single_turn`). There is no engine-only mode: the figure is the run's.

Figures per variant: `seconds_cold` (the first run, CUDA-graph capture included), `seconds_warm` (median of the warm
runs, each from an empty prefix cache as a rollout after a weight update starts), `tokens_per_s` (warm),
`decode_step_ms` ((warm - a prefill-only run) / (new tokens - 1)), `scheduler` (the native scheduler's counts over a
warm run), and for single and grpo `parity`: the run's `mismatch/*` metrics between the engine's log-probs and the
actor's log-prob pass on the same tokens. On the GPU also `roofline`: the bytes one decode step must read (the weights
and the K/V the rows attend at mid-generation; `unique` counts a shared prompt once) at --memory-bandwidth, and the
measured step over that bound. Times are the device's named in `gpu` (or the CPU's).

JSON: the labels (`shape`, `model_dir`, `device`, `gpu`, versions, `engine`, `dtype`, `prompt_len`, `new_tokens`,
`overrides`, `variants`, `switch_interval_ms`) and one object per case run with its workload and `variants` ({name:
figures}); single adds `hf_generate`; a multiturn variant holds `agent` (the generate phase's figures: tokens, turns,
mean turn length, seconds, tokens/s, the scheduler's counts, the CUDA graphs each warm run captured and the steps it
ran without one; with --host-timing each warm run's host times), `single_turn` and `vs_single_turn`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from benchmarks.common import (
    add_model_args,
    add_run_args,
    bench_config,
    bench_rollout,
    bench_worker,
    device_info,
    emit,
    exit_now,
    make_model_dir,
    model_vocab,
    note,
    pick_device,
    random_prompts,
    sync,
    timed,
)
from benchmarks.host_timing import HostTiming
from benchmarks.multiturn_workload import (
    agent_overrides,
    profile_rollout,
    time_agent_rollouts,
    time_single_turn,
)
from benchmarks.rollout_figures import (
    fresh_prefix_cache,
    model_shape,
    params_on_device,
    parity,
    profile_table,
    roofline,
    time_generate,
)
from hybridrl.config import RunConfig
from hybridrl.engines import engine_dtype
from hybridrl.engines.base import SamplingParams

CASES = ("single", "grpo", "multiturn")
PROFILE_TRAJECTORIES = 64  # a profile of every trajectory's events takes minutes to collect


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m benchmarks.engine`."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--case", choices=(*CASES, "all"), default="single", help="the workload (all: each in turn)")
    add_model_args(ap, "0.5b")
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    ap.add_argument(
        "--new-tokens",
        type=int,
        default=256,
        help="single, grpo: most new tokens per sample (multiturn takes --turn-tokens)",
    )
    ap.add_argument("--batch", type=int, default=64, help="single: prompts, one sample each")
    ap.add_argument("--prompts", type=int, default=32, help="grpo: distinct prompts")
    ap.add_argument("--samples", type=int, default=8, help="grpo: samples per prompt (algorithm.group_size)")
    ap.add_argument("--trajectories", type=int, default=256, help="multiturn: trajectories (one per prompt)")
    ap.add_argument("--turns", type=int, default=4, help="multiturn: turns per trajectory (agent.max_turns)")
    ap.add_argument(
        "--turn-tokens", type=int, default=256, help="multiturn: mean model tokens per turn (turns end at random)"
    )
    ap.add_argument("--tool-ms", type=float, default=50.0, help="multiturn: the tool's latency")
    ap.add_argument("--tool-tokens", type=int, default=16, help="multiturn: tokens of text the tool returns")
    ap.add_argument(
        "--max-rows",
        type=int,
        default=0,
        help="multiturn: the engine's rows (engine.native.max_batch_size); fewer than --trajectories keeps more "
        "trajectories in flight than rows, as agent RL runs do (the KV cache then holds every trajectory's "
        "context); 0: one row per trajectory",
    )
    ap.add_argument(
        "--vary",
        action="append",
        default=[],
        metavar="KEY=A,B,...",
        help="run the case once per value of this config key, side by side in this process, e.g. "
        "--vary engine.native.pdl=on,off (repeatable: every combination); the first values make the first "
        "variant, the one the others are compared with",
    )
    add_run_args(ap)
    ap.add_argument("--skip-hf", action="store_true", help="single: leave out transformers' generate (slow when large)")
    ap.add_argument(
        "--parity-rows", type=int, default=8, help="single, grpo: samples whose log-probs the actor recomputes"
    )
    ap.add_argument(
        "--memory-bandwidth",
        type=float,
        default=4.8,
        metavar="TB_S",
        help="GPU: the device's memory bandwidth in TB/s, the roofline's bound (default: H200 HBM3e, datasheet)",
    )
    ap.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        metavar="MS",
        help="the interpreter's thread switch interval for this process (sys.setswitchinterval; Python's default 5 "
        "ms): how long a thread waiting for the GIL, such as the engine's driver thread on a GPU, may wait while the "
        "event loop's thread runs the agents",
    )
    ap.add_argument(
        "--host-timing",
        action="store_true",
        help="multiturn: each warm run's host times (benchmarks/host_timing.py): the engine driver's host work and "
        "device wait per step, the event loop's callbacks; the wrapping costs about a microsecond a call",
    )
    ap.add_argument(
        "--profile",
        metavar="FILE",
        help="a profiler table of one more run of the first variant to FILE (single, grpo: one generate; multiturn: "
        f"one generate phase over the first {PROFILE_TRAJECTORIES} prompts); with --case all one file per case, the "
        "case's name added to FILE's stem",
    )
    return ap


# -- configs ------------------------------------------------------------------------------------------------------
def parse_variants(vary: list[str]) -> list[tuple[str, list[str]]]:
    """`--vary KEY=A,B` options as (name, overrides) per variant: every combination, the first values first."""
    axes, keys = [], set()
    for spec in vary:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values or key in keys:
            raise SystemExit(
                f"--vary {spec!r}: give KEY=VALUE[,VALUE...] once per key, e.g. --vary engine.native.pdl=on,off"
            )
        keys.add(key)
        axes.append([(key, v) for v in values.split(",")])
    variants = []
    for combo in itertools.product(*axes):
        name = ",".join(f"{k.removeprefix('engine.native.').removeprefix('engine.')}={v}" for k, v in combo)
        variants.append((name or "default", [f"{k}={v}" for k, v in combo]))
    return variants


def case_rows(case: str, args) -> int:
    """The engine rows a case fills (engine.native.max_batch_size)."""
    if case == "single":
        return args.batch
    if case == "grpo":
        return args.prompts * args.samples
    return min(args.max_rows or args.trajectories, args.trajectories)


def case_overrides(case: str, args, path: str, device: torch.device, user: list[str]) -> list[str]:
    """What the case sets in the run config (before the user's overrides, which win)."""
    rows = case_rows(case, args)
    out = [f"engine.native.max_batch_size={rows}"]
    if case != "multiturn":
        out.append(f"engine.max_new_tokens={args.new_tokens}")
    if case == "grpo":
        out.append(f"algorithm.group_size={args.samples}")
    if case == "multiturn":
        block = bench_config(path, device, [*out, *user]).engine.native.kv_block_size
        out += agent_overrides(
            model_vocab(path),
            args.trajectories,
            args.turns,
            args.turn_tokens,
            args.tool_ms,
            args.tool_tokens,
            args.prompt_len,
            rows,
            block,
        )
    return out


def case_configs(case: str, args, path: str, device: torch.device, variants) -> list[tuple[str, list[str], RunConfig]]:
    """Each variant's run config for `case`: the bench's base, the case's settings, --set, then the variant's."""
    # No reference model (the engine bench runs no update), no compiled trainer layers (only the parity pass runs
    # the actor); on the GPU the actor's parameters wait on the host while the engine runs, as in a run.
    base = ["algorithm.kl_coef=0", "trainer.compile=false"]
    if device.type == "cuda":
        base.append("trainer.offload=[params,optimizer]")
    out = []
    for name, overrides in variants:
        user = [*args.set, *overrides]
        cfg = bench_config(path, device, [*base, *case_overrides(case, args, path, device, user), *user])
        out.append((name, overrides, cfg))
    return out


def sampling(cfg: RunConfig, n: int, new_tokens: int) -> SamplingParams:
    """The run's sampling settings (engine.*) for `n` samples of `new_tokens`, seeded."""
    e = cfg.engine
    return SamplingParams(
        n=n,
        temperature=e.temperature,
        top_p=e.top_p,
        top_k=e.top_k,
        max_new_tokens=new_tokens,
        stop_token_ids=list(e.stop_token_ids),
        seed=0,
    )


@contextmanager
def engine_of(cfg: RunConfig, roles):
    """The engine `cfg` configures, built by the run's builder and filled from the actor; shut down after the block."""
    with params_on_device(roles.actor):  # the resharder reads the actor's parameters on the device
        rollout = bench_rollout(cfg, roles)
    try:
        yield rollout.engine
    finally:
        rollout.shutdown()


def profile_path(profile: str, case: str, several: bool) -> str:
    """--profile's file for `case`: FILE itself, or with several cases FILE's stem + _case."""
    path = Path(profile)
    return str(path.with_name(f"{path.stem}_{case}{path.suffix}")) if several else profile


def with_ratios(variants: dict[str, dict], keys: tuple[str, ...] = ()) -> dict[str, dict]:
    """Each variant's tokens/s over the first's (`tokens_per_s_vs_first`), at the top or inside each of `keys`."""
    first = next(iter(variants.values()))
    for v in variants.values():
        for part, base in [(v[k], first[k]) for k in keys] or [(v, first)]:
            part["tokens_per_s_vs_first"] = part["tokens_per_s"] / base["tokens_per_s"]
    return variants


# -- cases --------------------------------------------------------------------------------------------------------
def generate_variants(roles, configs, prompts: list[list[int]], n: int, args, device, profile: str | None) -> dict:
    """Every variant's `time_generate` figures on `prompts` × `n` samples, with parity and (GPU) the roofline."""
    actor = roles.actor
    shape = model_shape(actor.model.config, engine_dtype(configs[0][2].engine, device), actor_params(actor))
    rows, half = len(prompts) * n, args.new_tokens / 2
    out = {}
    for i, (name, overrides, cfg) in enumerate(configs):
        note(f"variant {name}: building the engine")
        with engine_of(cfg, roles) as engine:
            params = sampling(cfg, n, args.new_tokens)
            fig, completions = time_generate(engine, prompts, params, device)
            fig = {"overrides": overrides, **fig, "parity": parity(actor, prompts, completions, args.parity_rows)}
            if device.type == "cuda":
                unique = len(prompts) * args.prompt_len + rows * half
                step_s = fig["decode_step_ms"] / 1e3
                bandwidth = args.memory_bandwidth * 1e12
                fig["roofline"] = roofline(shape, rows, args.prompt_len + half, unique, step_s, bandwidth)
            if profile and i == 0:
                fresh_prefix_cache(engine)
                profile_table(lambda: engine.generate(prompts, params), device, profile)
        note(f"variant {name}: {fig['tokens_per_s']:.0f} tokens/s")
        out[name] = fig
    return with_ratios(out)


def actor_params(actor) -> int:
    """The policy's parameter count (the engine holds as many weights, in its own dtype)."""
    return sum(p.numel() for p in actor.model.parameters())


def case_single(roles, configs, args, device: torch.device, path: str, profile: str | None) -> dict:
    """--batch distinct prompts, one sample each, in every variant; then transformers' generate on them."""
    prompts = random_prompts(args.batch, args.prompt_len, roles.actor.model.config.vocab_size, seed=1)
    res = {
        "prompts": args.batch,
        "samples_per_prompt": 1,
        "rows": args.batch,
        "variants": generate_variants(roles, configs, prompts, 1, args, device, profile),
    }
    if not args.skip_hf:
        hf = hf_generate(path, engine_dtype(configs[0][2].engine, device), prompts, args.new_tokens, device)
        res["hf_generate"] = hf
        for v in res["variants"].values():
            v["tokens_per_s_vs_hf_generate"] = v["tokens_per_s"] / hf["tokens_per_s"]
    return res


def case_grpo(roles, configs, args, device: torch.device, path: str, profile: str | None) -> dict:
    """--prompts prompts × --samples samples sharing each, in every variant."""
    prompts = random_prompts(args.prompts, args.prompt_len, roles.actor.model.config.vocab_size, seed=2)
    return {
        "prompts": args.prompts,
        "samples_per_prompt": args.samples,
        "rows": args.prompts * args.samples,
        "variants": generate_variants(roles, configs, prompts, args.samples, args, device, profile),
    }


def case_multiturn(roles, configs, args, device: torch.device, path: str, profile: str | None) -> dict:
    """The run's agent rollout of --trajectories prompts in every variant (a worker of its own each), against the same
    tokens single-turn."""
    prompts = random_prompts(args.trajectories, args.prompt_len, model_vocab(path), seed=3)
    res = {
        "trajectories": args.trajectories,
        "rows": case_rows("multiturn", args),
        "turns": args.turns,
        "turn_tokens": args.turn_tokens,
        "tool_ms": args.tool_ms,
        "tool_tokens": args.tool_tokens,
        "variants": {},
    }
    for i, (name, overrides, cfg) in enumerate(configs):
        note(f"variant {name}: building the worker (rollout=agent)")
        v = multiturn_variant(cfg, prompts, device, profile if i == 0 else None, args.host_timing)
        res["variants"][name] = {"overrides": overrides, **v}
        note(f"variant {name}: {v['agent']['tokens_per_s']:.0f} tokens/s, {v['vs_single_turn']:.3f}x single-turn")
    with_ratios(res["variants"], ("agent",))
    return res


def multiturn_variant(
    cfg: RunConfig, prompts: list[list[int]], device: torch.device, profile: str | None, host_timing: bool = False
) -> dict:
    """One variant's figures: a `HybridWorker` for `cfg`, woken as the run's wake phase leaves it, its generate phase
    timed, then the same tokens single-turn on its engine; the worker's roles released after. `host_timing`: with
    each warm run's host times (`HostTiming`)."""
    from hybridrl.workers.worker import HybridWorker

    worker = HybridWorker(cfg)
    timing = HostTiming() if host_timing else None
    try:
        worker.wake()  # the engine's device memory, the actor's state on the host (per trainer.offload)
        with timing.installed() if timing else nullcontext():
            agent, lengths = time_agent_rollouts(worker, prompts, device, timing)
            single = time_single_turn(worker.roles.rollout.engine, prompts, lengths, cfg, device, timing)
        if profile:
            some = prompts[:PROFILE_TRAJECTORIES]
            profile_table(lambda: profile_rollout(worker, some), device, profile)
        return {
            "engine": type(worker.roles.rollout.engine).__name__,
            "agent": agent,
            "single_turn": single,
            "vs_single_turn": agent["tokens_per_s"] / single["tokens_per_s"],
        }
    finally:
        worker.roles.shutdown()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def hf_generate(path: str, dtype: torch.dtype, prompts: list[list[int]], new_tokens: int, device) -> dict:
    """transformers' `generate` on the same weights (its default dynamic cache), sampling at temperature 1, every
    sample to `new_tokens`: the labelled baseline."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        warm = ids[:, :8]
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, min_new_tokens=4, **kw)
        kw.update(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        seconds, out = timed(functools.partial(model.generate, ids, **kw), device)
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    del model
    sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


RUN_CASE = {"single": case_single, "grpo": case_grpo, "multiturn": case_multiturn}


def main() -> None:
    """Run the benchmark the command line describes and print its JSON."""
    args = parser().parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    device = pick_device(args.device)
    path = make_model_dir(args.shape, device, args.model_dir)
    cases = CASES if args.case == "all" else (args.case,)
    variants = parse_variants(args.vary)
    # Every case's and variant's config composed first: a bad key or value fails before any model loads.
    configs = {case: case_configs(case, args, path, device, variants) for case in cases}
    first = configs[cases[0]][0][2]
    roles = None
    if set(cases) - {"multiturn"}:  # the engine cases' shared actor (multiturn builds whole workers)
        roles = bench_worker(configs[next(c for c in cases if c != "multiturn")][0][2], device, with_engine=False)
        roles.actor.offload()  # the device is the engine's, as after a run's wake phase
    result = {
        "shape": args.shape,
        "model_dir": args.model_dir,
        **device_info(device),
        "engine": first.engine.name,
        "dtype": str(engine_dtype(first.engine, device)).removeprefix("torch."),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "overrides": args.set,
        "variants": [name for name, _ in variants],
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
    }
    for case in cases:
        note(f"case {case}")
        profile = profile_path(args.profile, case, len(cases) > 1) if args.profile else None
        result[case] = RUN_CASE[case](roles, configs[case], args, device, path, profile)
    emit(result, args.out)
    exit_now()


if __name__ == "__main__":
    main()
