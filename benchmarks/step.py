"""A full RL step through the run's own controller and workers, with its phase breakdown; JSON out.

    python -m benchmarks.step --shape 1.5b --device cuda                          # a GRPO step on one GPU
    python -m benchmarks.step --shape 1.5b --workers 2 --tp 2                     # cluster=local, one process per GPU
    python -m benchmarks.step --shape 1.5b --algorithm ppo --reward-models 2      # + a critic and two reward models
    python -m benchmarks.step --shape tiny --device cpu --new-tokens 16 --prompts 4   # a quick check
    python -m benchmarks.step --shape 1.5b --new-tokens 4096 --lengths heavy --partial   # sync, then partial rollouts
    python -m benchmarks.step --vl 3b --image-size 448 --prompts 16 --group 8 --new-tokens 256   # Qwen2.5-VL-3B

The step is `Controller.train_step` on random prompts, exactly as `python -m hybridrl` runs it: wake (the trainer
roles' offload, then the engine's wake) → generate → sleep → logprob (parameters back first) → reward → advantages →
update (optimizer state joined first) → reshard. The first --warmup steps are not timed (allocators, CUDA graphs,
compiled layers and the pinned buffers of the offloaded optimizer state are made there); the figures are medians over
the --steps after them. With `trainer.offload_lazy` (the default) the trainer's state is copied to host at wake and
its device memory freed only where the engine finds no room; --eager-offload frees it at wake; `freed_gb_per_step` says
how much was freed.

`switching_s` is the time the step spends moving memory between the roles rather than computing: wake + sleep +
reshard + the parameter onload inside logprob + the optimizer-state wait inside update (+ the critic's and the reward
models' own moves); `switching_share` is its share of the step. With --algorithm ppo the step adds the critic's phases
(values after logprob, update_critic before update), and --reward-models N scores every sample with N reward models of
the policy's shape (random heads), one on the device at a time; `reward_phase` compares the reward phase's peak memory
over what was resident when it began with one reward model's size.

On one worker the JSON also has the device's SM clock, power and temperature per phase (`device_state_per_phase`,
NVML), and `trainer_throughput`: the actor's update on --throughput-batch × --throughput-seq tokens against a plain
FSDP2 step (fully_shard per layer + root, bf16 mixed precision, the model's own loss) on the same tokens in this
process: tokens/s, MFU (6·N·tokens/s over the dense bf16 peak) and their ratio. Times are the device's named in
`gpu` (or the CPU's).

With --partial the same controller runs --warmup + --steps synchronous steps, then as many with partial rollouts
(rollout.partial, carry: --oversample groups over data.train_batch_size, at most --max-staleness versions behind),
both training --prompts × --group samples per step; the JSON then holds `sync` and `partial` (each the figures below,
the partial one with its staleness, carried and dropped samples), `speedup` (trained samples per second over all the
timed steps, partial over sync: partial steps alternate between short and long ones, so a median step says nothing;
time an even number of them) and each side's engine idle share (`perf/engine_rows_idle`: rows the rollout could have
kept busy that sat idle). The engine's rows are raised to hold every over-sampled request at once.

JSON: the labels (`shape`, `device`, `gpu`, versions, `workers`, `engine_tp`, `algorithm`, `trainer_offload`,
`overrides`, `rollout`: the batch shape), `step_s_median`, `phases_s_median` ({time/<phase>: s}), the switching
figures, `freed_gb_per_step`, `rollout_tokens_per_s`, `trainer_per_gpu` (log-prob and update tokens/s, MFU),
`peak_memory_gb_per_phase`, `reward_phase`, `memory_after_phase`, `per_step` (each timed step's time/, offload/,
reshard/, mismatch/ and engine/ metrics), `device_state_per_phase` and `trainer_throughput`.

With --vl the policy is a random-init Qwen2.5-VL of that size (benchmarks/vision.py) and each prompt carries one
--image-size² picture; `vision` gives the image's tokens and the engine's vision tower seconds per step and their
share of time/generate (one worker; trainer_throughput is left out).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

import torch
from omegaconf import OmegaConf

from benchmarks.common import (
    Timer,
    add_model_args,
    add_run_args,
    bench_config,
    bench_controller,
    device_info,
    emit,
    exit_now,
    gpu_peak_flops,
    make_model_dir,
    model_vocab,
    note,
    pick_device,
    random_prompts,
)
from benchmarks.device_monitor import DeviceMonitor
from benchmarks.lengths import LENGTHS, cap_engine_lengths
from benchmarks.trainer import plain_fsdp_tok_s, throughput_batch
from benchmarks.vision import VL_SHAPES, TowerTimer, make_vl_model_dir, vl_prompts
from hybridrl.data.config import DataConfig
from hybridrl.data.prompts import Prompt
from hybridrl.phases import Phase
from hybridrl.rollout.config import PartialConfig
from hybridrl.training.config import TrainerConfig

# Seconds of the step spent moving memory between the roles rather than computing.
SWITCH_PHASES = ("time/wake", "time/sleep", "time/reshard")
SWITCH_INSIDE = ("offload/actor/onload_params_s", "offload/actor/onload_optim_wait_s")
# The critic's and the reward models' own moves: the critic's offload (inside time/wake), its onload waits, and
# every reward model's onload/offload (inside time/reward).
EXTRA_SWITCH = re.compile(r"^offload/(critic|reward_model/[^/]+)/[a-z_]*_s$")
CRITIC_WAITS = ("offload/critic/onload_params_wait_s", "offload/critic/onload_optim_wait_s")
REWARD_MODEL_MOVES = re.compile(r"^offload/reward_model/[^/]+/(onload|offload)_s$")
PER_STEP_METRICS = ("time/", "offload/", "reshard/", "mismatch/", "engine/", "rollout/", "perf/engine_rows", "batch/")


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m benchmarks.step`."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.step", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(ap, "1.5b")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step (data.train_batch_size)")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (algorithm.group_size)")
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--new-tokens", type=int, default=512, help="most new tokens per sample (engine.max_new_tokens)")
    ap.add_argument(
        "--micro",
        type=int,
        default=TrainerConfig.micro_batch_size,
        help="trainer.micro_batch_size (sequences; default: the trainer's own default)",
    )
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up steps")
    ap.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps first: the first update creates the Adam state, whose pinned host buffers the next "
        "offload allocates",
    )
    ap.add_argument("--workers", type=int, default=1, help="1: cluster=inline; more: cluster=local, one per GPU")
    ap.add_argument("--tp", type=int, default=1, help="engine.tp_size")
    ap.add_argument(
        "--offload",
        default="params,optimizer",
        help="trainer.offload on the GPU: params,optimizer / params / none (on the CPU always none)",
    )
    ap.add_argument(
        "--eager-offload",
        action="store_true",
        help="trainer.offload_lazy=false: free the offloaded memory at wake even where the engine has room",
    )
    ap.add_argument("--algorithm", choices=["grpo", "ppo"], default="grpo", help="ppo adds a critic of the same shape")
    ap.add_argument("--reward-models", type=int, default=0, help="reward models of the policy's shape, scored in turn")
    ap.add_argument(
        "--throughput-batch", type=int, default=8, help="trainer_throughput: sequences per update (one worker, grpo)"
    )
    ap.add_argument("--throughput-seq", type=int, default=1024, help="trainer_throughput: tokens per sequence")
    ap.add_argument(
        "--throughput-iters", type=int, default=3, help="trainer_throughput: timed updates each (0: leave it out)"
    )
    ap.add_argument(
        "--lengths",
        choices=LENGTHS,
        default="fixed",
        help="response lengths (benchmarks/lengths.py): the engine stops each response at its drawn length, so the "
        "rollout, the log-probs and the update all see the mix; one worker, native fused engine",
    )
    ap.add_argument("--max-tokens", type=int, default=0, help="trainer.max_tokens_per_micro_batch (0: rows)")
    ap.add_argument(
        "--partial",
        action="store_true",
        help="run the synchronous steps, then as many with partial rollouts, side by side (one worker)",
    )
    ap.add_argument(
        "--oversample",
        type=float,
        default=0.75,
        help="--partial: rollout.partial.oversample; about the share of groups holding a tail response (the heavy mix "
        "with groups of 8: 1 - 0.9^8 = 0.57) or more",
    )
    ap.add_argument("--max-staleness", type=int, default=1, help="--partial: rollout.partial.max_staleness")
    ap.add_argument(
        "--vl",
        choices=list(VL_SHAPES),
        help="a random-init Qwen2.5-VL of this size instead of --shape, one --image-size picture per prompt",
    )
    ap.add_argument("--image-size", type=int, default=448, help="--vl: pixels a side of each prompt's picture")
    add_run_args(ap)
    return ap


# -- the run's config ---------------------------------------------------------------------------------------------
def algorithm_overrides(name: str) -> list[str]:
    """conf/algorithm/<name>.yaml as overrides (the benchmark composes its config without Hydra's groups)."""
    conf = Path(__file__).resolve().parents[1] / "conf" / "algorithm" / f"{name}.yaml"
    return [f"algorithm.{k}={v}" for k, v in OmegaConf.to_container(OmegaConf.load(conf)).items()]


def reward_model_dir(policy_dir: str) -> str:
    """The policy's folder as a one-label sequence classifier: its files linked, its config given num_labels=1 (the
    classifier's head is drawn fresh at load)."""
    rm_dir = Path(policy_dir + "-rm")
    if not (rm_dir / "config.json").exists():
        rm_dir.mkdir(exist_ok=True)
        for f in Path(policy_dir).iterdir():
            if f.name != "config.json" and not (rm_dir / f.name).exists():
                (rm_dir / f.name).symlink_to(f.resolve())
        config = json.loads((Path(policy_dir) / "config.json").read_text())
        config.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
        (rm_dir / "config.json").write_text(json.dumps(config, indent=2))
    return str(rm_dir)


def reward_model_overrides(n: int, policy_dir: str) -> list[str]:
    """`n` reward models of the policy's shape and weights (a fresh scalar head each)."""
    if not n:
        return []
    path = reward_model_dir(policy_dir)
    models = ", ".join(f"{{name: rm{i}, path: '{path}', weight: 0.1, micro_batch_size: 16}}" for i in range(n))
    return [f"reward_model.models=[{models}]"]


def step_overrides(args, path: str, offload: str, prompt_tokens: int = 0) -> list[str]:
    """The run's settings for this step: cluster, batch shape, trainer, algorithm, reward models, then --set.
    `prompt_tokens`: the longest prompt fed; data.max_prompt_tokens is raised to it where it is below (a run's data
    loader refuses longer prompts, and the memory plan sizes sequences by that limit)."""
    if args.workers == 1:
        cluster = ["cluster.name=inline"]
    else:
        cluster = ["cluster.name=local", f"cluster.workers_per_node={args.workers}"]
    partial = []
    rows = args.prompts * args.group
    if args.partial:
        partial = [
            "rollout.partial.enabled=true",
            "rollout.partial.mode=carry",
            f"rollout.partial.oversample={args.oversample}",
            f"rollout.partial.max_staleness={args.max_staleness}",
        ]
        rows = (args.prompts + PartialConfig(oversample=args.oversample).extra_groups(args.prompts)) * args.group
    limit = [f"data.max_prompt_tokens={prompt_tokens}"] if prompt_tokens > DataConfig().max_prompt_tokens else []
    return [
        *cluster,
        *limit,
        f"engine.tp_size={args.tp}",
        f"data.train_batch_size={args.prompts}",
        f"algorithm.group_size={args.group}",
        f"engine.max_new_tokens={args.new_tokens}",
        f"engine.native.max_batch_size={max(256, rows)}",
        *partial,
        f"trainer.micro_batch_size={args.micro}",
        f"trainer.max_tokens_per_micro_batch={args.max_tokens}",
        f"trainer.offload={offload}",
        f"trainer.offload_lazy={not args.eager_offload}",
        "trainer.lr=1e-6",
        f"trainer.steps={args.warmup + args.steps}",
        "reward.name=format",
        *algorithm_overrides(args.algorithm),
        *reward_model_overrides(args.reward_models, path),
        *args.set,
    ]


def step_prompts(args, path: str) -> list[Prompt]:
    """Random prompts for every step. A reward model reads text: each prompt's text is as many byte-level tokens as
    prompt + response, so it scores sequences of the policy's length (the random ids decode to little text)."""
    text = "x" * (args.prompt_len + args.new_tokens)
    ids = random_prompts(args.prompts * 4, args.prompt_len, model_vocab(path))
    return [Prompt(p, text, {"prompt": text}) for p in ids]


# -- the steps ----------------------------------------------------------------------------------------------------
def tag_phases(worker, monitor: DeviceMonitor, timing: dict) -> None:
    """Wrap the inline worker's phase commands so the monitor files its readings under the phase running, in timed
    steps only (`timing["on"]`)."""
    for phase in Phase:
        run = getattr(worker, phase.value, None)
        if run is None:
            continue

        def tagged(*a, _run=run, _name=phase.value, **k):
            monitor.tag = _name if timing["on"] else None
            try:
                return _run(*a, **k)
            finally:
                monitor.tag = None

        setattr(worker, phase.value, tagged)


def run_steps(
    controller, args, timing: dict, first: int = 1, label: str = "", tower: TowerTimer | None = None
) -> list[dict]:
    """The warm-up steps, then the timed ones, numbered from `first`; the timed steps' metrics (with `tower`, its
    seconds as `vision/tower_s`)."""
    timed_steps = []
    for step in range(first, first + args.warmup + args.steps):
        timing["on"] = step >= first + args.warmup
        metrics = controller.train_step(step)
        if tower is not None:
            metrics["vision/tower_s"] = tower.take()
        note(f"{label}step {step}: {metrics['time/step']:.2f} s{'' if timing['on'] else ' (warm-up)'}")
        if timing["on"]:
            timed_steps.append(metrics)
    timing["on"] = False
    return timed_steps


# -- figures ------------------------------------------------------------------------------------------------------
def switching_s(metrics: dict) -> float:
    """Switching time of one step from its metrics (the critic's offload is already inside time/wake)."""
    inside = sum(v for k, v in metrics.items() if k in CRITIC_WAITS or REWARD_MODEL_MOVES.match(k))
    return sum(metrics.get(k, 0.0) for k in SWITCH_PHASES + SWITCH_INSIDE) + inside


def extra_switching_s(metrics: dict) -> float:
    """The part of the step's switching that the critic and the reward models add."""
    return sum(v for k, v in metrics.items() if EXTRA_SWITCH.match(k))


def median_of(steps: list[dict], fn) -> float:
    """The median of `fn(metrics)` over the timed steps."""
    return statistics.median(fn(m) for m in steps)


def n_params(model_dir: str) -> int:
    """Parameters of the policy, counted on a meta-device copy built from its config (no weights loaded); of a
    vision-language policy, the language model's (the tower reads image patches, not the sequence's tokens)."""
    import transformers

    from hybridrl.models.vision import is_vision_param, model_class

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = model_class(config).from_config(config)
    return sum(p.numel() for n, p in model.named_parameters() if not is_vision_param(n))


def trainer_rates(steps: list[dict], args, params: int, gpu: bool) -> dict:
    """Tokens per second per device of the log-prob and update phases (prompt + response tokens of every row) and, on
    the GPU, the update's MFU (6·N per token over the dense bf16 peak per GPU), medians over the timed steps."""
    rows = []
    for m in steps:
        tokens = m["batch/samples"] * (args.prompt_len + m["response/length_mean"])
        rows.append((tokens / m["time/logprob"] / args.workers, tokens / m["time/update"] / args.workers))
    logprob = statistics.median(r[0] for r in rows)
    update = statistics.median(r[1] for r in rows)
    return {
        "logprob_tok_s": logprob,
        "update_tok_s": update,
        "update_mfu": 6 * params * update / gpu_peak_flops() if gpu else None,
        "params": params,
    }


def reward_phase_memory(metrics: dict) -> dict:
    """The reward phase's peak over what was allocated when it began, against one reward model's parameters (GPU)."""
    before = metrics.get("memory/values/allocated_gb", metrics.get("memory/logprob/allocated_gb"))
    peak = metrics.get("memory/reward/peak_allocated_gb")
    sizes = [v for k, v in metrics.items() if k.startswith("memory/roles/reward_model/") and k.endswith("_host_gb")]
    if peak is None or before is None:
        return {}
    return {
        "peak_gb": peak,
        "allocated_before_gb": before,
        "extra_peak_gb": peak - before,
        "one_reward_model_gb": max(sizes) if sizes else None,
        "reward_models": len(sizes),
    }


def step_figures(steps: list[dict], args, path: str, gpu: bool) -> dict:
    """The timed steps' medians: the step and its phases, switching, memory, rollout and trainer rates."""
    times = {k: statistics.median(m[k] for m in steps) for k in steps[0] if k.startswith("time/")}
    total = times["time/step"]
    switching, extra = median_of(steps, switching_s), median_of(steps, extra_switching_s)
    last = steps[-1]
    return {
        "step_s_median": total,
        "phases_s_median": times,
        "switching_s": switching,
        "switching_share": switching / total,
        "critic_and_reward_model_switching_s": extra,
        "critic_and_reward_model_switching_share": extra / total,
        "freed_gb_per_step": median_of(
            steps, lambda m: sum(v for k, v in m.items() if re.match(r"^offload/[^/]+/offload_gb$", k))
        ),
        "rollout_tokens_per_s": median_of(steps, lambda m: m["perf/rollout_tokens_per_s"]),
        # Host seconds inside time/generate spent capturing CUDA graphs (those a sleep dropped).
        "graph_capture_s_median": median_of(steps, lambda m: m.get("engine/graph_capture_s", 0.0)),
        "trainer_per_gpu": trainer_rates(steps, args, n_params(path), gpu),
        "peak_memory_gb_per_phase": {
            k.split("/")[1]: v for k, v in last.items() if k.startswith("memory/") and k.endswith("/peak_allocated_gb")
        },
        "reward_phase": reward_phase_memory(last),
        "memory_after_phase": {k: v for k, v in last.items() if k.startswith("memory/")},
        "per_step": [{k: v for k, v in m.items() if k.startswith(PER_STEP_METRICS)} for m in steps],
    }


def partial_figures(steps: list[dict]) -> dict:
    """What a partial rollout did over the timed steps: medians of the staleness and of the samples carried, dropped
    and over-sampled, and the smallest share of trained tokens at most one version behind."""
    keys = ("staleness_mean", "staleness_max", "carried", "dropped", "oversampled_groups", "pending_groups")
    out = {k: median_of(steps, lambda m, k=k: m[f"rollout/{k}"]) for k in keys}
    out["staleness_le1_frac_min"] = min(m["rollout/staleness_le1_frac"] for m in steps)
    return out


def side(steps: list[dict], args, path: str, gpu: bool) -> dict:
    """One side of the comparison: the step figures, the trained samples per step and the engine's idle share."""
    seconds = sum(m["time/step"] for m in steps)
    return {
        **step_figures(steps, args, path, gpu),
        "step_s_mean": seconds / len(steps),
        "samples_per_s": sum(m["batch/samples"] for m in steps) / seconds,
        "generate_s_mean": sum(m["time/generate"] for m in steps) / len(steps),
        "trained_samples_per_step": median_of(steps, lambda m: m["batch/samples"]),
        "response_length_mean": median_of(steps, lambda m: m["response/length_mean"]),
        "engine_rows_mean": median_of(steps, lambda m: m.get("perf/engine_rows_mean", 0.0)),
        "engine_rows_idle": median_of(steps, lambda m: m.get("perf/engine_rows_idle", 0.0)),
    }


def sync_and_partial(controller, args, timing: dict, path: str, gpu: bool) -> dict:
    """The synchronous steps (the controller's partial rollouts switched off), then the partial ones, numbered on."""
    partial, controller.partial = controller.partial, None
    sync_steps = run_steps(controller, args, timing, label="sync ")
    controller.partial = partial
    partial_steps = run_steps(controller, args, timing, first=1 + args.warmup + args.steps, label="partial ")
    sync_side, partial_side = side(sync_steps, args, path, gpu), side(partial_steps, args, path, gpu)
    partial_side["rollout"] = partial_figures(partial_steps)
    return {
        "sync": sync_side,
        "partial": partial_side,
        "speedup": partial_side["samples_per_s"] / sync_side["samples_per_s"],
        "rollout_speedup": sync_side["generate_s_mean"] / partial_side["generate_s_mean"],
        "partial_config": {"oversample": args.oversample, "max_staleness": args.max_staleness, "mode": "carry"},
    }


def trainer_throughput(controller, args, path: str, device: torch.device) -> dict:
    """The actor's update on `throughput_batch × throughput_seq` tokens against plain FSDP2 on the same tokens (inline
    worker). The engine sleeps and the trainer roles go to host first, to give the baseline the device."""
    roles = controller.group.worker.roles
    actor = roles.actor
    vocab = model_vocab(path)
    batch, seq, iters = args.throughput_batch, args.throughput_seq, args.throughput_iters
    tb = throughput_batch(batch, seq, args.prompt_len, vocab)
    actor.cfg.micro_batch_size = batch
    actor.onload_params()
    actor.onload_optimizer()
    times = []
    for i in range(iters + 1):  # the first is a warm-up
        t = Timer(device)
        with t("update"):
            actor.update(tb)
        if i:
            times.append(t.times["update"])
    ours = batch * seq / statistics.median(times)
    actor.offload()  # room for the baseline's own copy
    if roles.ref is not None:
        roles.ref.offload()
    roles.rollout.sleep()
    plain = plain_fsdp_tok_s(path, device, batch, seq, vocab, iters)
    params = sum(p.numel() for p in actor.model.parameters())
    gpu = device.type == "cuda"
    return {
        "batch": batch,
        "seq": seq,
        "ours_tok_s": ours,
        "plain_fsdp2_tok_s": plain,
        "ratio": ours / plain,
        "ours_mfu": 6 * params * ours / gpu_peak_flops() if gpu else None,
        "plain_mfu": 6 * params * plain / gpu_peak_flops() if gpu else None,
    }


def vision_figures(steps: list[dict], args, prompt: Prompt) -> dict:
    """The images' size and tokens, and the engine's vision tower seconds per step and their share of generate."""
    tower = median_of(steps, lambda m: m["vision/tower_s"])
    return {
        "model": f"Qwen2.5-VL {args.vl} (random init)",
        "image_size": args.image_size,
        "image_tokens_per_prompt": prompt.token_ids.count(prompt.token_ids[1]),
        "tower_s_median": tower,
        "tower_share_of_generate": tower / median_of(steps, lambda m: m["time/generate"]),
    }


def main() -> None:
    """Run the benchmark the command line describes and print its JSON."""
    ap = parser()
    args = ap.parse_args()
    if args.lengths != "fixed" and args.workers != 1:
        ap.error("--lengths caps the engine of this process: use --workers 1")
    if args.partial and args.workers != 1:
        ap.error("--partial switches the controller's rollouts between the two runs in this process: use --workers 1")
    if args.vl and (args.workers != 1 or args.image_size < 28 or args.image_size % 28):
        ap.error("--vl runs one worker, with --image-size a multiple of 28")
    if args.vl and args.partial:
        ap.error("--vl and --partial are measured apart")
    # With --partial a length belongs to the sample (carried samples continue as new requests), on both sides.
    cap_engine_lengths(args.lengths, args.prompt_len if args.partial else None)
    device = pick_device(args.device)
    offload = args.offload if device.type == "cuda" else "none"
    if args.vl:
        path = make_vl_model_dir(args.vl, args.image_size, device, args.model_dir)
        prompts = vl_prompts(args.prompts * 4, args.prompt_len, args.image_size, path)
    else:
        path = make_model_dir(args.shape, device, args.model_dir)
        prompts = step_prompts(args, path)
    longest = max(len(p.token_ids) for p in prompts)  # image placeholders included
    cfg = bench_config(path, device, step_overrides(args, path, offload, longest))
    controller = bench_controller(cfg, prompts)
    monitor, timing = DeviceMonitor(device).start(), {"on": False}
    if args.workers == 1:  # the inline worker lives in this process: its phases can be tagged
        tag_phases(controller.group.worker, monitor, timing)
    if args.partial:
        compared = sync_and_partial(controller, args, timing, path, device.type == "cuda")
        monitor.stop()
        result = {
            "shape": args.shape,
            **device_info(device),
            "lengths": args.lengths,
            "rollout": {"prompts": args.prompts, "group": args.group, "prompt_len": args.prompt_len},
            "new_tokens": args.new_tokens,
            "steps_timed": args.steps,
            "overrides": args.set,
            **compared,
            "device_state_per_phase": monitor.summary(),
        }
        controller.cleanup()
        emit(result, args.out)
        exit_now()
    tower = TowerTimer(controller.group.worker.roles.rollout.engine, device) if args.vl else None
    steps = run_steps(controller, args, timing, tower=tower)
    monitor.stop()
    result = {
        "shape": args.vl or args.shape,  # with --vl a Qwen2.5-VL of that size (`vision`)
        "model_dir": args.model_dir,
        **device_info(device),
        "workers": args.workers,
        "engine_tp": args.tp,
        "algorithm": args.algorithm,
        "reward_models": args.reward_models,
        "trainer_offload": offload,
        "offload_lazy": not args.eager_offload,
        "micro_batch_size": args.micro,
        "max_tokens_per_micro_batch": args.max_tokens,
        "lengths": args.lengths,
        "response_length_mean": statistics.median(m["response/length_mean"] for m in steps),
        "pad_frac": statistics.median(m.get("perf/pad_frac", 0.0) for m in steps),
        "trainer_real_tokens_per_s": statistics.median(m.get("perf/trainer_tokens_per_s", 0.0) for m in steps),
        "trainer_compiles": steps[-1].get("trainer/compiles", 0.0),
        "overrides": args.set,
        "rollout": {
            "prompts": args.prompts,
            "group": args.group,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
        },
        "steps_timed": len(steps),
        **step_figures(steps, args, path, device.type == "cuda"),
        # SM clock, power and temperature per phase of the timed steps (one worker, NVML): tells a phase slowed by a
        # hot or throttled device from one slowed by its code.
        "device_state_per_phase": monitor.summary(),
    }
    if args.vl:
        result["vision"] = vision_figures(steps, args, prompts[0])
    elif args.workers == 1 and args.algorithm == "grpo" and args.throughput_iters:
        result["trainer_throughput"] = trainer_throughput(controller, args, path, device)
    controller.cleanup()
    emit(result, args.out)
    exit_now()


if __name__ == "__main__":
    main()
