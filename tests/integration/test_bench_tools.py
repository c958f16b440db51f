"""Every benchmark under benchmarks/ runs on the CPU with the tiny shape and prints the JSON it documents.

The GPU figures come from these scripts; they build their roles with the product's own builder, so a change to the
builder or the controller that breaks a benchmark must fail here, on the CPU, not on a GPU machine.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.paths import REPO

SMALL = ["--shape", "tiny", "--device", "cpu"]

CASES = {
    "bench_step": (
        [
            *SMALL,
            "--prompts",
            "2",
            "--group",
            "2",
            "--prompt-len",
            "8",
            "--new-tokens",
            "4",
            "--steps",
            "2",
            "--warmup",
            "1",
        ],
        ["rollout", "trainer_offload", "device_state_per_phase"],
    ),
    "bench_step:probe": (
        [
            *SMALL,
            "--prompts",
            "2",
            "--group",
            "2",
            "--prompt-len",
            "8",
            "--new-tokens",
            "4",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--probe-rollout",
            "--probe-first",
            "--probe-after-steps",
            "1",
            "--probe-after-phases",
            "sleep",
            "update",
            "--probe-phases-step",
            "2",
            "--probe-l2-reset",
            "--l2-reset-after-update",
            "--probe-pdl-off",
            "--probe-pdl-completion",
            "--probe-release",
            "--probe-subprocess",
            "--probe-idle-s",
            "0",
            "--model-dir",
            "model",
        ],
        ["rollout_probe"],
    ),
    "bench_lora": (
        [
            *SMALL,
            "--rank",
            "4",
            "--alpha",
            "8",
            "--prompts",
            "2",
            "--group",
            "2",
            "--prompt-len",
            "8",
            "--new-tokens",
            "4",
            "--steps",
            "2",
            "--warmup",
            "1",
        ],
        ["lora_rank", "base_params"],
    ),
    "bench_lifecycle": ([*SMALL, "--batch", "2", "--new-tokens", "4"], ["sleep1", "engine"]),
    "bench_trainer": (
        [
            *SMALL,
            "--batch",
            "2",
            "--seq",
            "32",
            "--prompt-len",
            "8",
            "--variants",
            "default",
            "--warmup",
            "1",
            "--iters",
            "2",
        ],
        ["plain_fsdp2_tok_s", "params"],
    ),
    "bench_reshard": (SMALL, ["style", "params"]),
    "bench_engine": ([*SMALL, "--batch", "2", "--new-tokens", "4"], ["prompt_len", "dtype"]),
    "bench_engine:multiturn": (
        [
            *SMALL,
            "--case",
            "multiturn",
            "--trajectories",
            "6",
            "--max-rows",
            "4",
            "--turns",
            "3",
            "--new-tokens",
            "9",
            "--prompt-len",
            "8",
            "--tool-ms",
            "1",
            "--join-wait",
            "0",
            "8",
            "--join-step-tokens",
            "0",
            "512",
        ],
        ["multiturn"],
    ),
    "bench_engine:grpo": (
        [
            *SMALL,
            "--case",
            "grpo",
            "--prompts",
            "2",
            "--samples",
            "2",
            "--prompt-len",
            "8",
            "--new-tokens",
            "4",
            "--shared-prefix-tokens",
            "0",
            "8",
            "--long-keys",
            "0",
            "4",
            "--pdl",
            "off",
            "auto",
            "--pdl-trial-pairs",
            "2",
            "--pdl-trial-first",
            "off",
            "--pdl-trigger",
            "completion",
            "start",
            "--sleep-cycle",
            "none",
            "0.001x0.25",
            "--heat-s",
            "0.01",
            "--process-state",
            "nccl",
            "nccl-avg",
            "fsdp",
            "actor",
            "compile",
            "pinned",
            "backward",
            "adam",
            "--l2-reset",
        ],
        ["grpo"],
    ),
    "bench_engine:grpo-actor-parts": (
        [
            *SMALL,
            "--case",
            "grpo",
            "--prompts",
            "2",
            "--samples",
            "2",
            "--prompt-len",
            "8",
            "--new-tokens",
            "4",
            "--process-state",
            "actor-logprob",
            "--stack-reset",
            "--release-state",
        ],
        ["grpo"],
    ),
}


def _json_object(stdout: str) -> dict:
    """The JSON object a benchmark prints last (some print a progress line first)."""
    start = stdout.index("{")
    return json.loads(stdout[start:])


@pytest.mark.slow
@pytest.mark.parametrize("tool", sorted(CASES))
def test_benchmark_runs_on_cpu_and_prints_json(tool, tmp_path):
    args, keys = CASES[tool]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    module = tool.split(":")[0].removeprefix("bench_")  # "tool:case" runs another case of the same benchmark
    r = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = _json_object(r.stdout)
    assert out["shape"] == "tiny" and out["device"] == "cpu", out
    for key in keys:
        assert key in out, (key, sorted(out))
    if tool == "bench_engine:grpo-actor-parts":  # the role up to its log-prob pass (no update metrics), then dropped
        assert out["process_state"]["actor_update"] == {} and out["process_state"]["group_for"] == ["actor-logprob"]
        assert out["process_state"]["released"] is True and out["process_state"]["stack_reset"] is False  # no CUDA
        assert out["grpo"]["tokens"] == 2 * 2 * 4
        return
    if "grpo" in out:  # the A/Bs of grouped attention and long-context splits: the first value in full, others beside
        assert out["grpo"]["shared_prefix_tokens"] == 0 and list(out["grpo"]["shared_prefix_tokens_variants"]) == ["8"]
        assert out["grpo"]["long_keys"] == 0 and list(out["grpo"]["long_keys_variants"]) == ["4"]
        assert out["grpo"]["pdl_mode"] == "off" and list(out["grpo"]["pdl_mode_variants"]) == ["auto"]
        assert out["grpo"]["pdl_mode_final"] == "off"  # the reported run's, set back after the variants
        assert out["grpo"]["pdl_trigger"] == "completion" and list(out["grpo"]["pdl_trigger_variants"]) == ["start"]
        assert out["grpo"]["sleep_cycle"] == "none" and list(out["grpo"]["sleep_cycle_variants"]) == ["0.001x0.25"]
        assert out["grpo"]["tokens"] == 2 * 2 * 4
        assert out["grpo"]["launch_timing"] == {"available": False}
        # the CPU's group; no compile, pinned memory or L2 off the GPU; a backward and an AdamW step run anywhere
        limits = out["process_state"].pop("device_limits")
        norm = out["process_state"].pop("fsdp_grad_norm")  # the FSDP2 actor's update ran: a real gradient's norm
        assert math.isfinite(norm) and norm > 0
        actor = out["process_state"].pop("actor_update")  # the product's actor role ran its update phase
        assert math.isfinite(actor["actor/grad_norm"]) and actor["actor/grad_norm"] > 0
        assert actor["actor/nonfinite_steps"] == 0 and "actor/kl" in actor  # the KL to the reference was in the loss
        assert out["process_state"] == {
            "nccl": "gloo",
            "group_for": ["actor", "fsdp", "nccl", "nccl-avg"],
            "nccl_avg": False,
            "compile": False,
            "pinned_gb": 0.0,
            "backward": True,
            "adam": True,
            "l2_reset": False,
        }
        assert set(limits) == {"threads"} and limits["threads"] >= 1
        assert out["grpo"]["device_state"] == {"available": False}  # no NVML on the CPU
    if "rollout_probe" in out:  # each timed step's generate, repeated three ways; bench_engine's run in the process
        probe = out["rollout_probe"]
        assert all(len(probe[k]["seconds"]) == 2 for k in ("step_generate", "worker_again", "engine_direct"))
        assert len(probe["prefill_only_s"]) == 2
        assert probe["engine_settings"]["eos"] == [2] and probe["bench_engine_here"]["engine_settings"]["eos"] == []
        assert probe["bench_engine_here"]["tokens_per_s"] > 0
        assert probe["bench_engine_before_steps"]["tokens_per_s"] > 0  # --probe-first: the same run before step 1
        assert list(probe["bench_engine_after_step"]) == ["1"]  # --probe-after-steps 1: after the warm-up step only
        # --probe-after-phases: inside step 2 (--probe-phases-step; the first timed one), in the order it runs them
        assert list(probe["bench_engine_after_phase"]) == ["sleep", "update"]
        assert {v["step"] for v in probe["bench_engine_after_phase"].values()} == {2}
        assert probe["bench_engine_after_phase"]["update"]["device_limits_before"]["threads"] >= 1
        assert probe["device_state"] == {}  # no NVML on the CPU: nothing filed under the probes
        assert probe["l2_reset"] is False and probe["bench_engine_after_l2_reset"]["tokens_per_s"] > 0  # no L2 here
        # --probe-release: after empty_cache, after idling, after the controller's cleanup; no throughput test then
        assert list(probe["bench_engine_released"]) == ["empty_cache", "idle_0s", "cleanup"]
        assert all(r["tokens_per_s"] > 0 for r in probe["bench_engine_released"].values())
        assert "trainer_throughput" not in out
        # device timestamps per launch exist only on CUDA: on CPU each run says so instead of reporting zeros
        assert probe["engine_direct_launches"] == [{"available": False}] * 2
        assert probe["bench_engine_here"]["launch_timing"] == {"available": False}
        assert probe["bench_engine_here"]["launch_timing_pdl_off"] == {"available": False}  # --probe-pdl-off ran
        here = probe["bench_engine_here"]
        assert here["pdl_off_engine_setting"] is False  # on an engine without PDL, not a new engine's default
        assert here["launch_timing_pdl_completion"] == {"available": False}  # --probe-pdl-completion ran
        assert here["pdl_completion_engine_setting"] == "completion"
        # --probe-subprocess: bench_engine in a process of its own before step 1 and after the steps, PDL on then off
        child = probe["bench_engine_child"]
        assert list(child) == ["before_steps", "after_steps"], child
        for run in child.values():
            assert run["pdl_mode"] == "on" and run["tokens_per_s"] > 0 and run["pdl_off"]["tokens_per_s"] > 0, run
            assert run["launch_busy_ms_median"] is None  # no device timestamps on the CPU
    if "multiturn" in out:  # lockstep and staggered turns, each join wait with joins prefilled apart and riding
        variants = out["multiturn"]["variants"]
        assert sorted(variants) == [
            f"{kind}_join{wait}_ride{ride}"
            for kind in ("lockstep", "staggered")
            for wait in (0, 8)
            for ride in (0, 512)
        ]
        assert all(v["tokens"] == 6 * 9 for v in variants.values())  # every token produced
        assert all((v["step_joins"] > 0) == (v["join_step_tokens"] > 0) for v in variants.values())


def test_device_monitor_files_readings_by_phase():
    """Readings go under the tag set last (none while the tag is None), summarized as medians; without NVML (this
    CPU) the monitor reads nothing and says so."""
    import torch

    from benchmarks.device_monitor import DeviceMonitor

    readings = iter([(1980.0, 500.0, 60.0), (1980.0, 510.0, 61.0), (1755.0, 690.0, 70.0), (1800.0, 650.0, 72.0)])
    m = DeviceMonitor(torch.device("cpu"), read=lambda: next(readings))  # the first reading is the probe's
    m.sample()  # no tag: nothing read
    m.tag = "generate"
    m.sample()
    m.tag = "update"
    m.sample()
    m.sample()
    assert m.summary() == {
        "generate": {"samples": 1, "sm_clock_mhz": 1980.0, "power_w": 510.0, "temperature_c": 61.0},
        "update": {"samples": 2, "sm_clock_mhz": 1777.5, "power_w": 670.0, "temperature_c": 71.0},
    }
    plain = DeviceMonitor(torch.device("cpu")).start()
    plain.tag = "generate"
    plain.stop()
    assert plain.summary() == {"available": False}


@pytest.mark.parametrize("group,prompt_len,new_tokens", [(3, 8, 6), (1, 6, 9)])
def test_the_kernel_bench_times_attention_on_the_engines_block_tables(group, prompt_len, new_tokens):
    """`bench_decode_kernels.engine_tables` is the layout the fused engine's scheduler gives a batch admitted at once
    (a group's prompt blocks shared, each row's own blocks in one run): read off the engine's runner in its first
    decode step, for GRPO groups and for distinct prompts with a partial last prompt block."""
    import torch

    from benchmarks.kernels import engine_tables
    from hybridrl.engines.base import SamplingParams
    from hybridrl.engines.config import NativeOptions
    from hybridrl.engines.native.engine import FusedEngine
    from hybridrl.reshard import ReshardConfig, Resharder
    from tests.tiny_models import tiny_model

    model = tiny_model("qwen2")
    rows, bs = 6, 4
    engine = FusedEngine(
        model.config,
        [0],
        1,
        device="cpu",
        dtype=torch.float32,
        seed=0,
        options=NativeOptions(max_batch_size=rows, kv_block_size=bs, kv_blocks=64),
    )
    Resharder(ReshardConfig(), engine, model.config).sync(model)
    prompts = [[5 + 7 * i + j for j in range(prompt_len)] for i in range(rows // group)]
    seen = []
    launch = engine.runner.launch
    engine.runner.launch = lambda n, *a, **k: seen.append(engine.runner.table[:n].clone()) or launch(n, *a, **k)
    engine.generate(prompts, SamplingParams(n=group, max_new_tokens=new_tokens, seed=0))
    want = engine_tables(rows, group, prompt_len, new_tokens, bs)
    assert torch.equal(seen[0][:, : want.shape[1]], want), (seen[0], want)
    assert not seen[0][:, want.shape[1] :].any()
