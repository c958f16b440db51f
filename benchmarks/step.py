"""A full GRPO (or PPO) step through the run's own controller and workers, with the phase breakdown; trainer
throughput against plain FSDP2 in the same process; JSON out.

    python -m benchmarks.step --shape 1.5b --device cuda            # the issue's case
    python -m benchmarks.step --shape tiny --device cpu --new-tokens 16 --prompts 4   # a quick check
    python -m benchmarks.step --shape 1.5b --workers 2 --tp 2       # cluster=local, one process per GPU
    python -m benchmarks.step --shape 1.5b --algorithm ppo --reward-models 2   # + a 1.5B critic and two 1.5B RMs
    python -m benchmarks.step --shape tiny --device cpu --algorithm ppo --reward-models 2 --new-tokens 16 --prompts 4

With --algorithm ppo the step adds the critic's phases (values after logprob, update_critic before update) and
--reward-models N scores every sample with N reward models of the same shape (random heads), one on the device at
a time. Their extra switching — the critic's offload (inside wake), its onload waits, and each reward model's
onload/offload — is reported beside the step, and so is the reward phase's peak memory over what was resident
when it began, against one reward model's size (one at a time: about one model, not N).

The step is `Controller.train_step` on random prompts (no sample stops early), exactly as `python -m hybridrl`
runs it: wake (the trainer roles' offload, then the engine's wake) → generate → sleep → logprob (params back in
first) → reward → advantages → update (optimizer state joined first) → reshard. With the default lazy offload
(`trainer.offload_lazy`) the copies to host start at wake and the device memory is freed only where the engine finds
no room; `--eager-offload` frees it at wake, as every step did before. The JSON's `freed_gb_per_step` says how much
was freed. Switching = wake + sleep +
reshard + the parameter onload inside logprob + the optimizer-state wait inside update; its share of the step is
reported. Throughput (inline only): our actor's update on batch × seq tokens and a plain FSDP2 step (fully_shard
per layer + root, bf16 mixed precision, HF loss) on the same tokens; tokens/s, MFU (6·N·tokens/s over the dense
bf16 peak) and the ratio.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
from pathlib import Path

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from benchmarks.common import (
    Timer,
    add_model_args,
    bench_config,
    bench_controller,
    gpu_peak_flops,
    make_model_dir,
    random_prompts,
)  # noqa: E402
from benchmarks.device_monitor import DeviceMonitor  # noqa: E402
from benchmarks.engine import reset_persisting_l2  # noqa: E402
from benchmarks.lengths import LENGTHS, cap_engine_lengths  # noqa: E402
from benchmarks.trainer import plain_fsdp_tok_s, throughput_batch  # noqa: E402
from hybridrl.data.prompts import Prompt  # noqa: E402
from hybridrl.phases import Phase  # noqa: E402
from hybridrl.training.config import TrainerConfig  # noqa: E402

# Seconds of the step spent moving memory between the roles rather than computing.
SWITCH_PHASES = ("time/wake", "time/sleep", "time/reshard")
SWITCH_INSIDE = ("offload/actor/onload_params_s", "offload/actor/onload_optim_wait_s")


# The critic's and the reward models' own moves: the critic's offload (inside time/wake), its onload waits, and
# every reward model's onload/offload (inside time/reward).
EXTRA_SWITCH = re.compile(r"^offload/(critic|reward_model/[^/]+)/[a-z_]*_s$")
CRITIC_WAITS = ("offload/critic/onload_params_wait_s", "offload/critic/onload_optim_wait_s")
REWARD_MODEL_MOVES = re.compile(r"^offload/reward_model/[^/]+/(onload|offload)_s$")


def switching_s(metrics: dict) -> float:
    """Switching time of one step from its metrics (the critic's offload is already inside time/wake)."""
    inside = sum(v for k, v in metrics.items() if k in CRITIC_WAITS or REWARD_MODEL_MOVES.match(k))
    return sum(metrics.get(k, 0.0) for k in SWITCH_PHASES + SWITCH_INSIDE) + inside


def extra_switching_s(metrics: dict) -> float:
    """The part of the step's switching that the critic and the reward models add."""
    return sum(v for k, v in metrics.items() if EXTRA_SWITCH.match(k))


def algorithm_overrides(name: str) -> list[str]:
    """conf/algorithm/<name>.yaml as overrides (the benchmark builds its config without Hydra's groups)."""
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "1.5b")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=512)
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
        help="untimed steps first: the first update creates Adam state, whose pinned host buffers "
        "are allocated at the following offload",
    )
    ap.add_argument("--workers", type=int, default=1, help="1: cluster=inline; more: cluster=local, one per GPU")
    ap.add_argument("--tp", type=int, default=1, help="engine.tp_size")
    ap.add_argument("--tp-batch", type=int, default=8, help="throughput test: sequences")
    ap.add_argument("--tp-seq", type=int, default=1024, help="throughput test: tokens per sequence")
    ap.add_argument("--tp-iters", type=int, default=3)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--offload", default="params,optimizer", help="trainer.offload on GPU (none to keep all resident)")
    ap.add_argument("--algorithm", choices=["grpo", "ppo"], default="grpo", help="ppo adds a critic of the same shape")
    ap.add_argument("--reward-models", type=int, default=0, help="reward models of the same shape, scored in turn")
    ap.add_argument(
        "--eager-offload",
        action="store_true",
        help="trainer.offload_lazy=false: free the offloaded memory at wake-up even where the engine has room",
    )
    ap.add_argument("--set", action="append", default=[], help="any other config override, e.g. engine.native.impl=hf")
    ap.add_argument(
        "--lengths",
        choices=LENGTHS,
        default="fixed",
        help="response lengths (benchmarks/lengths.py): the engine stops each response at its drawn length, so the "
        "rollout, the log-probs and the update all see the mix; one worker, native fused engine",
    )
    ap.add_argument("--max-tokens", type=int, default=0, help="trainer.max_tokens_per_micro_batch (0: rows)")
    ap.add_argument(
        "--probe-first",
        action="store_true",
        help="with --probe-rollout: bench_engine's GRPO run in this process before the first step too "
        "(rollout_probe.bench_engine_before_steps): slow from what the process built, or from "
        "the steps",
    )
    ap.add_argument(
        "--probe-after-steps",
        type=int,
        nargs="*",
        default=[],
        help="with --probe-rollout: bench_engine's GRPO run also right after these steps (1-based, warm-up "
        "steps counted; rollout_probe.bench_engine_after_step): does the first update slow it, or "
        "does it grow with the steps",
    )
    ap.add_argument(
        "--probe-after-phases",
        nargs="*",
        default=[],
        choices=[p.value for p in Phase],
        help="with --probe-rollout (one worker): bench_engine's GRPO run also inside one step (see "
        "--probe-phases-step), right after each of these phase commands "
        "(rollout_probe.bench_engine_after_phase): which phase leaves the device slower",
    )
    ap.add_argument(
        "--probe-phases-step",
        type=int,
        default=1,
        help="the step (1-based, warm-up steps counted) whose phases --probe-after-phases probes",
    )
    ap.add_argument(
        "--l2-reset-after-update",
        action="store_true",
        help="one worker: cudaCtxResetPersistingL2Cache after every update phase command (lines the "
        "trainer's kernels left persisting in L2 handed back before the reshard and next rollout)",
    )
    ap.add_argument(
        "--probe-l2-reset",
        action="store_true",
        help="with --probe-rollout: after the probe that follows the steps, the same run after "
        "cudaCtxResetPersistingL2Cache (rollout_probe.bench_engine_after_l2_reset)",
    )
    ap.add_argument(
        "--probe-pdl-off",
        action="store_true",
        help="with --probe-rollout: each probe also times the run on an engine captured without PDL "
        "(launch_timing_pdl_off): where both launch alike, this process has lost PDL's overlap",
    )
    ap.add_argument(
        "--probe-pdl-completion",
        action="store_true",
        help="with --probe-rollout: each probe also times the run on an engine whose kernels let the next "
        "launch only at their completion (launch_timing_pdl_completion; the runner's pdl_trigger)",
    )
    ap.add_argument(
        "--probe-release",
        action="store_true",
        help="with --probe-rollout, after the probe that follows the steps: the same run after "
        "torch.cuda.empty_cache() (the trainer's cached segments handed back), after --probe-idle-s "
        "seconds idle, and after the controller's cleanup (trainer, engine and groups freed); "
        "rollout_probe.bench_engine_released. Skips the trainer throughput test",
    )
    ap.add_argument("--probe-idle-s", type=float, default=30.0, help="--probe-release: seconds the device idles")
    ap.add_argument(
        "--probe-rollout",
        action="store_true",
        help="inline: in each timed step, after the step's own generate, generate the same prompts again "
        "through the worker, then through the engine directly, then prefill only, and after the steps "
        "run bench_engine's GRPO case on a fresh engine in this process (rollout_probe; the step's "
        "time/generate then includes the repeats): tells a rollout slowed by the state the update "
        "leaves (first slower than the repeats), by the worker's path (direct faster), or by the "
        "process (bench_engine slower here than in its own process)",
    )
    ap.add_argument(
        "--probe-subprocess",
        action="store_true",
        help="with --probe-rollout: bench_engine's GRPO run (PDL on, then off) also in a process of its "
        "own, started before step 1 and after the steps while this process holds what it holds "
        "(rollout_probe.bench_engine_child): slow there after the steps too, the device carries the "
        "slowdown; fast there, this process's state does",
    )
    ap.add_argument(
        "--probe-profile",
        help="with --probe-rollout, GPU: a profiler table of one more run of bench_engine's GRPO case in "
        "this process, to this file (bench_engine.py --profile: its own process's)",
    )
    args = ap.parse_args()
    if args.probe_after_phases and not 1 <= args.probe_phases_step <= args.warmup + args.steps:
        ap.error(
            f"--probe-phases-step {args.probe_phases_step}: the run has steps 1..{args.warmup + args.steps} "
            "(warm-up steps counted)"
        )

    if args.lengths != "fixed" and args.workers != 1:
        ap.error("--lengths caps the engine of this process: use --workers 1")
    cap_engine_lengths(args.lengths)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    path = make_model_dir(args.shape, device, args.model_dir)
    offload = args.offload if device.type == "cuda" else "none"
    cluster = (
        ["cluster.name=inline"]
        if args.workers == 1
        else ["cluster.name=local", f"cluster.workers_per_node={args.workers}"]
    )
    cfg = bench_config(
        path,
        device,
        [
            *cluster,
            f"engine.tp_size={args.tp}",
            f"data.train_batch_size={args.prompts}",
            f"algorithm.group_size={args.group}",
            f"engine.max_new_tokens={args.new_tokens}",
            f"engine.native.max_batch_size={max(256, args.prompts * args.group)}",
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
        ],
    )
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    # A reward model reads text: each prompt's text is as many byte-level tokens as prompt + response, so it scores
    # sequences of the policy's length (the random ids decode to little text of their own).
    text = "x" * (args.prompt_len + args.new_tokens)
    prompts = [Prompt(ids, text, {"prompt": text}) for ids in random_prompts(args.prompts * 4, args.prompt_len, vocab)]
    controller = bench_controller(cfg, prompts)
    monitor = DeviceMonitor(device).start()
    timing = {"on": False, "step": 0}
    after_phase: dict[str, dict] = {}
    here = functools.partial(bench_engine_here, path, args, device, monitor)
    if args.workers == 1:  # the inline worker: each phase command tags the monitor's readings while timed steps run
        worker = controller.group.worker
        for phase in Phase:
            if hasattr(worker, phase.value):

                def tagged(*a, _run=getattr(worker, phase.value), _name=phase.value, **k):
                    monitor.tag = _name if timing["on"] else None
                    try:
                        return _run(*a, **k)
                    finally:
                        monitor.tag = None
                        if _name == "update" and args.l2_reset_after_update:
                            reset_persisting_l2(device)
                        if (
                            args.probe_rollout
                            and timing["step"] == args.probe_phases_step
                            and _name in args.probe_after_phases
                            and _name not in after_phase
                        ):
                            after_phase[_name] = {**here(f"after_{_name}"), "step": timing["step"]}

                setattr(worker, phase.value, tagged)
    probe = RolloutProbe(controller.group.worker, device, timing) if args.probe_rollout and args.workers == 1 else None
    # Before any step the process holds what it built (trainer, asleep engine, groups) but nothing the steps did.
    before = here("before_steps") if probe is not None and args.probe_first else None
    child = {"before_steps": bench_engine_child(path, args)} if probe is not None and args.probe_subprocess else {}
    steps, after_step = [], {}
    for step in range(1, args.warmup + args.steps + 1):
        timing["on"], timing["step"] = step > args.warmup, step
        metrics = controller.train_step(step)
        if step > args.warmup:  # warm-up: allocators, CUDA graphs, compiles, pinned offload buffers
            steps.append(metrics)
        if probe is not None and step in args.probe_after_steps:
            after_step[str(step)] = here(f"after_step_{step}")
    times = {k: statistics.median(m[k] for m in steps) for k in steps[0] if k.startswith("time/")}
    total = times["time/step"]
    switching = statistics.median(switching_s(m) for m in steps)
    result = {
        "shape": args.shape,
        "device": str(device),
        "workers": args.workers,
        "engine_tp": args.tp,
        "trainer_offload": offload,
        "offload_lazy": not args.eager_offload,
        "micro_batch_size": args.micro,
        "max_tokens_per_micro_batch": args.max_tokens,
        "lengths": args.lengths,
        "response_length_mean": statistics.median(m["response/length_mean"] for m in steps),
        "pad_frac": statistics.median(m.get("perf/pad_frac", 0.0) for m in steps),
        "trainer_real_tokens_per_s": statistics.median(m.get("perf/trainer_tokens_per_s", 0.0) for m in steps),
        "trainer_compiles": steps[-1].get("trainer/compiles", 0.0),
        "l2_reset_after_update": args.l2_reset_after_update,
        "overrides": args.set,
        "freed_gb_per_step": statistics.median(
            sum(v for k, v in m.items() if re.match(r"^offload/[^/]+/offload_gb$", k)) for m in steps
        ),
        "rollout": {
            "prompts": args.prompts,
            "group": args.group,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
        },
        "step_s_median": total,
        "phases_s_median": times,
        "per_step": [
            {k: v for k, v in m.items() if k.startswith(("time/", "offload/", "reshard/", "mismatch/", "engine/"))}
            for m in steps
        ],
        "algorithm": args.algorithm,
        "reward_models": args.reward_models,
        "switching_s": switching,
        "switching_share": switching / total,
        "critic_and_reward_model_switching_s": statistics.median(extra_switching_s(m) for m in steps),
        "critic_and_reward_model_switching_share": statistics.median(extra_switching_s(m) for m in steps) / total,
        "peak_memory_gb_per_phase": {
            k.split("/")[1]: v
            for k, v in steps[-1].items()
            if k.startswith("memory/") and k.endswith("/peak_allocated_gb")
        },
        "reward_phase": reward_phase_memory(steps[-1]),
        "rollout_tokens_per_s": statistics.median(m["perf/rollout_tokens_per_s"] for m in steps),
        # Host seconds inside time/generate spent capturing the CUDA graphs that the last sleep dropped.
        "graph_capture_s_median": statistics.median(m.get("engine/graph_capture_s", 0.0) for m in steps),
        "trainer_per_gpu": trainer_rates(steps, args, n_params(path)),
        "memory_after_phase": {k: v for k, v in steps[-1].items() if k.startswith("memory/")},
        # SM clock, power and temperature per phase of the timed steps (one worker; NVML): a rollout slower here than
        # in bench_engine on the same machine may be a device running hotter or lower clocked after the update.
        "device_state_per_phase": {k: v for k, v in monitor.summary().items() if not k.startswith("probe/")},
    }
    if probe is not None:
        result["rollout_probe"] = {
            **probe.summary(args.prompts * args.group, args.new_tokens),
            "bench_engine_here": here("after_steps"),
        }
        if child:
            child["after_steps"] = bench_engine_child(path, args)
            result["rollout_probe"]["bench_engine_child"] = child
        if before is not None:
            result["rollout_probe"]["bench_engine_before_steps"] = before
        if after_step:
            result["rollout_probe"]["bench_engine_after_step"] = after_step
        if after_phase:
            result["rollout_probe"]["bench_engine_after_phase"] = after_phase
        if args.probe_l2_reset:
            result["rollout_probe"]["l2_reset"] = reset_persisting_l2(device)
            result["rollout_probe"]["bench_engine_after_l2_reset"] = here("after_l2_reset")
    released = probe is not None and args.probe_release
    if released:
        result["rollout_probe"]["bench_engine_released"] = probe_released(controller, here, args, device)
    elif args.workers == 1 and args.algorithm == "grpo":
        result["trainer_throughput"] = trainer_throughput(controller, args, path, device, vocab)
    if not released:  # probe_released cleaned up before its last run
        controller.cleanup()
    monitor.stop()
    if probe is not None:  # SM clock, power and temperature during each of bench_engine's runs in this process
        result["rollout_probe"]["device_state"] = {
            k[len("probe/") :]: v for k, v in monitor.summary().items() if k.startswith("probe/")
        }
    print(json.dumps(result, indent=2))
    out = os.environ.get("OUT")
    if out:
        eager = "-eager" if args.eager_offload else ""
        name = (
            f"bench_step_{args.algorithm}_rm{args.reward_models}_{args.shape}_w{args.workers}_tp{args.tp}"
            f"_p{args.prompts}_n{args.new_tokens}_offload-{offload.replace(',', '-')}{eager}_{args.lengths}"
        )
        Path(out, name + ".json").write_text(json.dumps(result, indent=2))
    sys.stdout.flush()
    os._exit(0)  # processes that used DeviceMesh sometimes abort at interpreter exit


class RolloutProbe:
    """--probe-rollout: wraps the inline worker's generate. In timed steps it times the step's own call, then the same
    prompts again through the worker, through the engine directly, and prefill only (device-synchronized); the step
    gets the first call's output."""

    KINDS = ("step_generate", "worker_again", "engine_direct", "prefill_only")

    def __init__(self, worker, device: torch.device, timing: dict) -> None:
        self.worker, self.device, self.timing, self.run = worker, device, timing, worker.generate
        self.seconds: dict[str, list[float]] = {k: [] for k in self.KINDS}
        self.settings: dict = {}
        self.launches: list[dict] = []  # per timed step, bench_engine.launch_timing of the direct run
        worker.generate = self.generate

    def timed(self, fn) -> tuple[float, object]:
        from benchmarks.engine import timed  # device-synchronized, as the engine bench times its runs

        return timed(fn, self.device)

    def generate(self, prompts, step, params, prompt_offset: int = 0):
        import dataclasses

        from hybridrl.workers.worker import sampling_seed

        if not self.timing["on"]:
            return self.run(prompts, step, params, prompt_offset)
        engine = self.worker.roles.rollout.engine
        direct = dataclasses.replace(
            params, seed=sampling_seed(self.worker.cfg.trainer.seed, step), prompt_offset=prompt_offset
        )
        from benchmarks.engine import launch_timing

        first, out = self.timed(lambda: self.run(prompts, step, params, prompt_offset))
        again = self.timed(lambda: self.run(prompts, step, params, prompt_offset))[0]
        with launch_timing(engine) as launches:
            direct_s = self.timed(lambda: engine.generate(prompts, direct))[0]
        times = (
            first,
            again,
            direct_s,
            self.timed(lambda: engine.generate(prompts, dataclasses.replace(direct, max_new_tokens=1)))[0],
        )
        for kind, seconds in zip(self.KINDS, times):
            self.seconds[kind].append(seconds)
        self.launches.append(launches)
        self.settings = engine_settings(engine)  # while awake
        return out

    def summary(self, rows: int, new_tokens: int) -> dict:
        med = {k: statistics.median(v) for k, v in self.seconds.items()}
        return {
            **{
                k: {"seconds": self.seconds[k], "tokens_per_s_median": rows * new_tokens / med[k]}
                for k in self.KINDS[:3]
            },
            "prefill_only_s": self.seconds["prefill_only"],
            "decode_step_ms": (med["engine_direct"] - med["prefill_only"]) / max(1, new_tokens - 1) * 1e3,
            "engine_direct_launches": self.launches,
            "engine_settings": self.settings,
        }


def engine_settings(engine) -> dict:
    """What decides the fused engine's decode step: its options and the runner's and model's switches."""
    import dataclasses

    from hybridrl.engines.native.kernels import pdl

    r, m = engine.runner, engine.model
    runner_keys = ("width", "long_keys", "shared_prefix_tokens", "use_graphs", "rows")
    return {
        "options": dataclasses.asdict(engine.options),
        "eos": sorted(engine.scheduler.eos),
        "runner": {k: getattr(r, k, None) for k in runner_keys},
        "model": {k: getattr(m, k, None) for k in ("gemm_sms", "rope_attention", "kernels")},
        "pdl": pdl.is_enabled(),
        "pdl_mode": r.pdl_mode,
        "kv_blocks": engine.cache.num_blocks if engine.cache is not None else None,
    }


def process_memory(device: torch.device) -> dict:
    """What this process holds on the device as a probe starts: the caching allocator's allocated and reserved bytes,
    its segments (each a separate mapping), and the device's free memory."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {
        "allocated_gb": torch.cuda.memory_allocated(device) / 2**30,
        "reserved_gb": torch.cuda.memory_reserved(device) / 2**30,
        "segments": stats.get("segment.all.current", 0),
        "device_free_gb": torch.cuda.mem_get_info(device)[0] / 2**30,
    }


def probe_released(controller, here, args, device: torch.device) -> dict:
    """--probe-release: bench_engine's GRPO run after the trainer's cached segments are handed back, after the
    device idled --probe-idle-s seconds, and after the controller's cleanup (the process then holds no role).
    Recovering at one of them places what slows a fresh engine after the steps."""
    import gc
    import time

    out = {}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out["empty_cache"] = here("empty_cache")
    time.sleep(args.probe_idle_s)
    out[f"idle_{args.probe_idle_s:g}s"] = here(f"idle_{args.probe_idle_s:g}s")
    controller.cleanup()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out["cleanup"] = here("cleanup")
    return out


def bench_engine_here(
    path: str, args, device: torch.device, monitor: DeviceMonitor | None = None, name: str = ""
) -> dict:
    """benchmarks/engine.py's GRPO run in this process on a fresh engine over the saved model's weights: after the
    steps, and with --probe-first before them, --probe-after-steps between them, --probe-release after freeing.
    Slower here than in bench_engine's own process (--model-dir, same machine): the process's state slows it, not
    the step's engine or its path. `monitor`'s readings during the run are filed under `probe/<name>`."""
    import transformers

    from benchmarks.engine import build_engine, device_limits, run_generate, timed_launches
    from hybridrl.engines.base import SamplingParams
    from hybridrl.engines.native.kernels import pdl

    held, limits = process_memory(device), device_limits(device)
    switches = pdl.is_enabled(), pdl.early_trigger()  # the step's engine's; a probe engine sets its own
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    # One fixed kind of launch, the step's switch (`--probe-pdl-off` times the other).
    ns = argparse.Namespace(
        no_cuda_graphs=False,
        no_kernels=False,
        kv_block_size=16,
        join_step_tokens=[512],
        no_skinny_gemm=False,
        no_rope_attention=False,
        pdl=["on" if switches[0] else "off"],
    )
    engine = build_engine(model, ns, args.prompts * args.group)
    prompts = random_prompts(args.prompts, args.prompt_len, model.config.vocab_size, seed=5)
    if monitor is not None:
        monitor.tag = f"probe/{name}"
    try:
        res, _, _ = run_generate(engine, prompts, args.group, args.new_tokens, device)
    finally:
        if monitor is not None:
            monitor.tag = None
    out = {k: res[k] for k in ("tokens_per_s", "decode_step_ms", "seconds_warm_runs", "seconds_prefill")}
    params = SamplingParams(n=args.group, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    out["launch_timing"] = timed_launches(engine, prompts, params, device, args.probe_profile)  # as bench_engine's grpo
    out["engine_settings"] = engine_settings(engine)
    out["process_memory_before"] = held
    out["device_limits_before"] = limits
    busy = out["launch_timing"].get("busy_ms_median")
    print(
        f"probe {name or 'here'}: {out['tokens_per_s']:.0f} tok/s, decode launch "
        f"{'-' if busy is None else f'{busy:.4f} ms'}",
        file=sys.stderr,
        flush=True,
    )  # kept if a run is cut short
    engine.shutdown()
    # The same run on engines launched otherwise: without PDL (equal figures mean this process has lost PDL's
    # overlap), and with each kernel letting the next launch only at its completion. A new engine sets the process-wide
    # switches from its options, so each arm sets its own on the engine's runner, before its first capture.
    arms = []
    if switches[0]:  # a step that runs without PDL has nothing to compare these against
        if args.probe_pdl_off:
            arms.append(("pdl_off", "without PDL", lambda r: setattr(r, "pdl", False), lambda r: r.pdl))
        if args.probe_pdl_completion:
            arms.append(
                (
                    "pdl_completion",
                    "PDL triggered at completion",
                    lambda r: setattr(r, "pdl_trigger", "completion"),
                    lambda r: r.pdl_trigger,
                )
            )
    try:
        for key, label, switch, setting in arms:
            engine = build_engine(model, ns, args.prompts * args.group)
            switch(engine.runner)
            run_generate(engine, prompts, args.group, args.new_tokens, device)
            timing = timed_launches(engine, prompts, params, device)
            out[f"launch_timing_{key}"] = timing
            out[f"{key}_engine_setting"] = setting(engine.runner)  # what its graphs were captured with
            print(
                f"probe {name or 'here'} {label}: decode launch {timing.get('busy_ms_median', '-')} ms",
                file=sys.stderr,
                flush=True,
            )
            engine.shutdown()
    finally:  # the step's engine goes on with the switches it was built with
        pdl.set_enabled(switches[0])
        pdl.set_early_trigger(switches[1])
    del model
    return out


def bench_engine_child(path: str, args) -> dict:
    """--probe-subprocess: benchmarks/engine.py's GRPO run over the saved model, PDL on and then off, in a child
    process started while this one holds its roles and what the steps left. The child shares only the device with
    this process: a child as slow after the steps as this process's own probe puts the slowdown in the device, a
    child as fast as before step 1 puts it in this process's state (its CUDA context, allocator, loaded modules)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench_child_") as tmp:
        out = Path(tmp, "bench_engine.json")
        cmd = [
            sys.executable,
            str(Path(__file__).with_name("engine.py")),
            "--case",
            "grpo",
            "--shape",
            args.shape,
            "--device",
            args.device,
            "--model-dir",
            path,
            "--prompts",
            str(args.prompts),
            "--samples",
            str(args.group),
            "--prompt-len",
            str(args.prompt_len),
            "--new-tokens",
            str(args.new_tokens),
            "--pdl",
            "on",
            "off",
            "--out",
            str(out),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not out.exists():  # the step's figures are still worth having: say why, go on
            print(f"probe child: bench_engine exited {r.returncode}", file=sys.stderr, flush=True)
            return {"error": f"bench_engine exited {r.returncode}", "stderr_tail": r.stderr[-2000:]}
        grpo = json.loads(out.read_text())["grpo"]
    res = {k: grpo[k] for k in ("tokens_per_s", "decode_step_ms", "pdl_mode")}
    res["launch_busy_ms_median"] = grpo["launch_timing"].get("busy_ms_median")
    res["pdl_off"] = grpo["pdl_mode_variants"]["off"]
    res["device_state"] = grpo["device_state"]
    print(
        f"probe child: {res['tokens_per_s']:.0f} tok/s with PDL, {res['pdl_off']['tokens_per_s']:.0f} without",
        file=sys.stderr,
        flush=True,
    )
    return res


def n_params(model_dir: str) -> int:
    """Parameters of the policy, counted on a meta-device copy built from its config (no weights loaded)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def trainer_rates(steps: list[dict], args, params: int) -> dict:
    """Tokens per second per GPU of the log-prob and update phases (prompt + response tokens of every row) and the
    update's MFU (6·N per token over the dense bf16 peak per GPU), medians over the timed steps."""
    rows = []
    for m in steps:
        tokens = m["batch/samples"] * (args.prompt_len + m["response/length_mean"])
        rows.append((tokens / m["time/logprob"] / args.workers, tokens / m["time/update"] / args.workers))
    logprob = statistics.median(r[0] for r in rows)
    update = statistics.median(r[1] for r in rows)
    return {
        "logprob_tok_s": logprob,
        "update_tok_s": update,
        "update_mfu": 6 * params * update / gpu_peak_flops(),
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


def trainer_throughput(controller, args, path: str, device: torch.device, vocab: int) -> dict:
    """The actor's update on `tp_batch × tp_seq` tokens against plain FSDP2 on the same tokens (inline worker)."""
    roles = controller.group.worker.roles
    actor = roles.actor
    tb = throughput_batch(args.tp_batch, args.tp_seq, args.prompt_len, vocab)
    actor.cfg.micro_batch_size = args.tp_batch
    actor.onload_params()
    actor.onload_optimizer()
    times = []
    for i in range(args.tp_iters + 1):
        t = Timer(device)
        with t("u"):
            actor.update(tb)
        if i:
            times.append(t.times["u"])
    ours = args.tp_batch * args.tp_seq / statistics.median(times)
    actor.offload()  # make room for the baseline's own copy
    if roles.ref is not None:
        roles.ref.offload()
    roles.rollout.sleep()
    plain = plain_fsdp_tok_s(path, device, args.tp_batch, args.tp_seq, vocab, args.tp_iters)
    n_params = sum(p.numel() for p in actor.model.parameters())
    peak = gpu_peak_flops()
    return {
        "batch": args.tp_batch,
        "seq": args.tp_seq,
        "ours_tok_s": ours,
        "plain_fsdp2_tok_s": plain,
        "ratio": ours / plain,
        "ours_mfu": 6 * n_params * ours / peak if device.type == "cuda" else None,
        "plain_mfu": 6 * n_params * plain / peak if device.type == "cuda" else None,
    }


if __name__ == "__main__":
    main()
