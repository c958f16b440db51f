"""Every benchmark under benchmarks/ runs on the CPU with the tiny shape and prints the JSON its docstring documents.

The GPU figures come from these commands; they build their roles with the product's own builder, so a change to the
builder or the controller that breaks a benchmark fails here, not on the next GPU run. The fast tests check the parts
that need no run: every option is documented, `--vary` makes every combination, the roofline's arithmetic, the device
monitor, and the kernel benchmark's block tables.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from tests.paths import REPO

SMALL = ["--shape", "tiny", "--device", "cpu"]
STEP = ["--prompts", "2", "--group", "2", "--prompt-len", "8", "--new-tokens", "4", "--steps", "2", "--warmup", "1"]
BENCHMARKS = ("engine", "step", "trainer", "lifecycle", "lora", "reshard", "kernels", "partial_demo")


def assert_tokens(fig: dict, budget: int, stopped: int) -> None:
    """A sample (or turn) runs to its budget unless it stopped at EOS: all `budget` tokens when none stopped, fewer
    (but at least one per stopped sample) when some did."""
    if stopped == 0:
        assert fig["tokens"] == budget, fig
    else:
        assert stopped <= fig["tokens"] < budget, fig


def check_engine_single(out: dict) -> None:
    case = out["single"]
    assert case["rows"] == 3 and list(case["variants"]) == ["default"]
    v = case["variants"]["default"]
    assert v["engine"] == "FusedEngine" and v["samples"] == 3
    assert_tokens(v, 3 * 5, v["stopped_at_eos"])
    assert v["scheduler"]["prefilled_tokens"] == 3 * 8  # each prompt prefilled once per run
    assert v["tokens_per_s_vs_first"] == 1.0
    # The engine and the actor agree on the log-probs of the engine's tokens (float32 on the CPU).
    assert v["parity"]["samples"] == 3 and v["parity"]["logp_abs_max"] < 1e-3
    hf = case["hf_generate"]
    assert hf["tokens"] == 3 * 5  # transformers' generate runs every sample to the end
    assert v["tokens_per_s_vs_hf_generate"] == pytest.approx(v["tokens_per_s"] / hf["tokens_per_s"])
    assert "roofline" not in v  # a bound at a GPU's bandwidth says nothing about the CPU


def check_engine_grpo(out: dict) -> None:
    case = out["grpo"]
    names = [f"shared_prefix_tokens={s},pdl={p}" for s in (0, 8) for p in ("on", "off")]
    assert out["variants"] == names and list(case["variants"]) == names  # every combination, in order
    first = case["variants"][names[0]]
    for name, v in case["variants"].items():
        assert v["overrides"] == [f"engine.native.{part}" for part in name.split(",")]
        assert_tokens(v, 2 * 3 * 4, v["stopped_at_eos"])
        assert v["scheduler"]["prefilled_tokens"] == 2 * 8  # a group's prompt is prefilled once for its 3 samples
        assert v["tokens_per_s_vs_first"] == pytest.approx(v["tokens_per_s"] / first["tokens_per_s"])
        assert v["parity"]["samples"] == 4 and v["parity"]["logp_abs_max"] < 1e-3


def check_engine_multiturn(out: dict) -> None:
    assert out["switch_interval_ms"] == pytest.approx(0.5)  # --switch-interval-ms, as the process ran with it
    case = out["multiturn"]
    assert (case["trajectories"], case["rows"], case["turns"], case["turn_tokens"]) == (6, 4, 3, 3)
    names = [f"join_step_tokens={j},join_wait_steps={w}" for j in (0, 512) for w in (0, 8)]
    assert list(case["variants"]) == names
    for name, v in case["variants"].items():
        agent, single = v["agent"], v["single_turn"]
        assert v["engine"] == "FusedEngine" and agent["trajectories"] == 6 and agent["tool_errors"] == 0
        # Every turn is read as a call: a trajectory asks for one per turn (the last turn's is not run), so 3 each,
        # but for one that a turn's token cap ended early.
        assert agent["tool_calls"] <= 3 * 6 and agent["turns_mean"] * 6 >= agent["tool_calls"]
        assert agent["turns_mean"] == 3 or agent["cut_by_turn_cap"] > 0
        # Turns end at random stop ids, about one token in 3 (the tiny vocabulary's ids from 300 on: 233 of 1000).
        assert 1 < agent["turn_tokens_mean"] < 12
        # The same tokens single-turn: each trajectory's, in one request (fewer only where one stopped at EOS).
        assert_tokens(single, agent["tokens"], single["stopped_at_eos"])
        assert v["vs_single_turn"] == pytest.approx(agent["tokens_per_s"] / single["tokens_per_s"])
        # Later turns join the running batch inside a decode step only when join_step_tokens allows it.
        assert (agent["scheduler"]["step_joins"] > 0) == name.startswith("join_step_tokens=512"), (name, agent)
        assert "tokens_per_s_vs_first" in agent
        # No CUDA graphs on the CPU: every warm run reports none captured.
        assert agent["graph_captures_warm_runs"] == [0.0, 0.0, 0.0] == agent["graph_capture_s_warm_runs"]
        # Both sides report the engine's steps: never more rows a step than the engine has.
        for side in (agent, single):
            assert side["scheduler"]["steps"] > 0 and 0 < side["mean_rows_per_step"] <= case["rows"], side
            # --host-timing: each warm run's host times, over the steps the scheduler counted in that run; on the
            # CPU the event loop's thread steps the engine (its callbacks hold the steps) and nothing waits on a device
            runs = side["host_timing_warm_runs"]
            assert [r["wall_s"] for r in runs] == pytest.approx(side["seconds_warm_runs"], abs=1e-4)
            assert runs[-1]["steps"] == side["scheduler"]["steps"]
            for r in runs:
                assert r["device_wait_s"] == 0 and 0 < r["step_s"] <= r["loop_s"] <= r["wall_s"], r
                assert r["loop_callbacks"] > 0 and r["host_ms_per_step"] > 0


def check_step(out: dict) -> None:
    phases = {f"time/{p}" for p in ("wake", "generate", "sleep", "logprob", "reward", "update", "reshard", "step")}
    assert phases <= set(out["phases_s_median"]), out["phases_s_median"]
    assert out["steps_timed"] == 2 and len(out["per_step"]) == 2
    assert out["rollout"] == {"prompts": 2, "group": 2, "prompt_len": 8, "new_tokens": 4}
    assert 0 <= out["switching_share"] < 1 and out["trainer_offload"] == "none"
    assert out["device_state_per_phase"] == {"available": False}  # no NVML on the CPU
    assert out["trainer_throughput"]["ratio"] > 0 and out["trainer_throughput"]["ours_mfu"] is None


def check_step_partial(out: dict) -> None:
    """Sync and partial side by side, the same samples trained per step, the partial side's rollout figures."""
    for name in ("sync", "partial"):
        side = out[name]
        assert side["trained_samples_per_step"] == 2 * 2 and len(side["per_step"]) == 2, name
        assert 0 <= side["engine_rows_idle"] < 1 and side["engine_rows_mean"] > 0, name
    # Throughput over every timed step: a median step would hide the long steps that finish the carried tails.
    sync, partial = out["sync"], out["partial"]
    for side in (sync, partial):
        times = [m["time/step"] for m in side["per_step"]]
        assert side["step_s_mean"] == pytest.approx(sum(times) / len(times))
        assert side["samples_per_s"] == pytest.approx(side["trained_samples_per_step"] / side["step_s_mean"])
    assert out["speedup"] == pytest.approx(sync["step_s_mean"] / partial["step_s_mean"])
    rollout = out["partial"]["rollout"]
    assert rollout["staleness_max"] <= 1
    # 2 prompts, oversample 0.75: 2 more groups a step, none in a step that must finish 2 carried groups anyway.
    started = [m["rollout/oversampled_groups"] for m in partial["per_step"]]
    assert set(started) <= {0.0, 2.0} and rollout["oversampled_groups"] == pytest.approx(sum(started) / 2)
    assert out["partial_config"] == {"oversample": 0.75, "max_staleness": 1, "mode": "carry"}


def check_step_vl(out: dict) -> None:
    assert out["rollout"] == {"prompts": 2, "group": 2, "prompt_len": 8, "new_tokens": 4}
    vision = out["vision"]
    assert vision["image_size"] == 56 and vision["image_tokens_per_prompt"] == 4  # (56 / 28)² merged patches
    assert 0 < vision["tower_s_median"] and 0 < vision["tower_share_of_generate"] < 1
    assert all(m["mismatch/logp_abs_max"] < 1e-4 for m in out["per_step"])  # float32 on the CPU
    assert "trainer_throughput" not in out


def check_step_ppo(out: dict) -> None:
    assert {"time/values", "time/update_critic"} <= set(out["phases_s_median"])  # the critic's phases ran
    assert out["algorithm"] == "ppo" and out["reward_models"] == 2
    assert "trainer_throughput" not in out  # measured for the GRPO actor only


def check_trainer(out: dict) -> None:
    assert list(out["variants"]) == ["default", "chunk"]
    assert out["variants"]["chunk"]["overrides"] == ["trainer.logprob_chunk_size=2048"]
    assert len(out["plain_fsdp2_tok_s"]) == 2 and out["params"] > 0  # the baseline first and last
    for v in out["variants"].values():
        assert len(v["steps_s"]) == 2 and v["ratio_vs_plain"] > 0


def check_lifecycle(out: dict) -> None:
    assert out["engine"] == "FusedEngine"
    for level in (1, 2):
        assert {f"sleep{level}", f"wake_weights_after_sleep{level}"} <= set(out[f"sleep{level}"]["seconds"])
    assert out["sleep2"]["reshard_gb"] > 0 and "onload" in out["trainer"]


def check_lora(out: dict) -> None:
    assert out["lora_rank"] == 4 and out["base_params"] > 0
    # The reshard merged an adapter into each of the 7 projections of the tiny model's 2 layers.
    assert out["lora"]["reshard"]["lora_merged"] == 2 * 7
    assert "full" in out and out["lora_step_over_full"] > 0 and out["reshard_merge_over_plain"] > 0


def check_reshard(out: dict) -> None:
    assert (out["workers"], out["tp_size"], out["style"]) == (1, 1, "fused")
    # The baseline copies every parameter once, in the engine's dtype (float32 on the CPU).
    assert out["baseline_state_dict_copy"]["bytes"] == out["params"] * 4
    assert out["reshard"]["bytes_moved_per_rank"] > 0 and out["verified"] is True


def check_reshard_tp(out: dict) -> None:
    assert (out["workers"], out["tp_size"], out["style"]) == (2, 2, "fused")
    # Each engine TP rank receives its shard: less than the whole model, more than half of it (norms are whole).
    assert out["params"] * 2 < out["reshard"]["bytes_moved_per_rank"] < out["params"] * 4


MULTITURN = ["--trajectories", "6", "--max-rows", "4", "--turns", "3", "--turn-tokens", "3", "--tool-ms", "1"]
JOINS = ["--vary", "engine.native.join_step_tokens=0,512", "--vary", "engine.native.join_wait_steps=0,8"]
GRPO = ["--case", "grpo", "--prompts", "2", "--samples", "3", "--new-tokens", "4", "--parity-rows", "4"]
TRAINER = ["--batch", "2", "--seq", "32", "--prompt-len", "8"]
VARY_GRPO = ["--vary", "engine.native.shared_prefix_tokens=0,8", "--vary", "engine.native.pdl=on,off"]

CASES: dict[str, tuple[list[str], Callable[[dict], None]]] = {
    "engine": (["--batch", "3", "--prompt-len", "8", "--new-tokens", "5", "--parity-rows", "3"], check_engine_single),
    "engine:grpo": ([*GRPO, "--prompt-len", "8", *VARY_GRPO], check_engine_grpo),
    "engine:multiturn": (
        [
            "--case",
            "multiturn",
            "--prompt-len",
            "8",
            *MULTITURN,
            *JOINS,
            "--switch-interval-ms",
            "0.5",
            "--host-timing",
        ],
        check_engine_multiturn,
    ),
    "step": (STEP, check_step),
    "step:ppo": ([*STEP, "--algorithm", "ppo", "--reward-models", "2"], check_step_ppo),
    "step:partial": ([*STEP, "--new-tokens", "32", "--lengths", "heavy", "--partial"], check_step_partial),
    "step:vl": ([*STEP, "--vl", "tiny", "--image-size", "56"], check_step_vl),
    "trainer": ([*TRAINER, "--variants", "default,chunk", "--warmup", "1", "--iters", "2"], check_trainer),
    "lifecycle": (["--batch", "2", "--new-tokens", "4"], check_lifecycle),
    "lora": (["--rank", "4", "--alpha", "8", *STEP], check_lora),
    "reshard": (["--verify"], check_reshard),
    "reshard:tp": (["--workers", "2", "--tp", "2"], check_reshard_tp),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_benchmark_runs_on_cpu_and_prints_json(case, tmp_path):
    args, check = CASES[case]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    module = case.split(":")[0]  # "module:case" runs another case of the same benchmark
    out_file = tmp_path / "out" / "result.json"
    r = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *SMALL, *args, "--out", str(out_file)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)  # stdout is the JSON alone (progress goes to stderr)
    assert json.loads(out_file.read_text()) == out  # --out writes the same object
    assert (out["shape"], out["device"], out["gpu"]) == ("tiny", "cpu", None), out
    check(out)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_option_is_documented(name):
    """`python -m benchmarks.<name> --help` explains the benchmark and every option it takes."""
    ap = importlib.import_module(f"benchmarks.{name}").parser()
    assert ap.prog == f"python -m benchmarks.{name}" and "JSON" in ap.description
    undocumented = [a.option_strings for a in ap._actions if a.option_strings and not a.help]
    assert not undocumented, undocumented


def test_vary_runs_every_combination_the_first_values_first():
    from benchmarks.engine import parse_variants

    assert parse_variants([]) == [("default", [])]
    got = parse_variants(["engine.native.pdl=on,off", "engine.top_p=1.0,0.9"])
    assert got == [
        ("pdl=on,top_p=1.0", ["engine.native.pdl=on", "engine.top_p=1.0"]),
        ("pdl=on,top_p=0.9", ["engine.native.pdl=on", "engine.top_p=0.9"]),
        ("pdl=off,top_p=1.0", ["engine.native.pdl=off", "engine.top_p=1.0"]),
        ("pdl=off,top_p=0.9", ["engine.native.pdl=off", "engine.top_p=0.9"]),
    ]
    for bad in (["engine.native.pdl"], ["=on"], ["engine.native.pdl=on", "engine.native.pdl=off"]):
        with pytest.raises(SystemExit, match="--vary"):
            parse_variants(bad)


def test_a_bad_override_fails_naming_the_key():
    import torch

    from benchmarks.common import bench_config

    with pytest.raises(SystemExit, match="engine.native.pdl"):
        bench_config("/nonexistent", torch.device("cpu"), ["engine.native.pdl=sometimes"])


def test_the_step_config_admits_the_prompts_it_is_fed():
    """A run's loader refuses prompts over data.max_prompt_tokens and the memory plan sizes sequences by it: a
    vision-language prompt (its image tokens included) past the default raises it; a shorter one leaves it."""
    from benchmarks.step import parser, step_overrides
    from hybridrl.data.config import DataConfig

    args = parser().parse_args(["--set", "data.max_prompt_tokens=1000"])
    default = DataConfig().max_prompt_tokens
    kept = [o for o in step_overrides(args, "m", "none", default) if o.startswith("data.max_prompt_tokens")]
    assert kept == ["data.max_prompt_tokens=1000"]
    raised = step_overrides(args, "m", "none", default + 130)
    # --set comes last, so it still wins
    assert raised.index(f"data.max_prompt_tokens={default + 130}") < raised.index("data.max_prompt_tokens=1000")


def test_the_roofline_is_bytes_over_bandwidth():
    """Hand-computed: the 0.5B shape's K/V per token (2 × 24 layers × 2 heads × 64 dims × 2 bytes), and one step of
    2 rows attending 3 tokens each over weights of 1000 bytes at 1 MB/s."""
    import torch
    import transformers

    from benchmarks.rollout_figures import ModelShape, model_shape, roofline

    config = transformers.Qwen2Config(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=1000
    )

    assert model_shape(config, torch.bfloat16, 500) == ModelShape(weight_bytes=1000, kv_bytes_per_token=12288)
    r = roofline(ModelShape(1000, 10), rows=2, context=3, unique_tokens=4, step_s=2e-3, bandwidth=1e6)
    assert r["attended"]["bytes"] == 1000 + 2 * 3 * 10 and r["unique"]["bytes"] == 1000 + 4 * 10
    assert r["attended"]["bound_ms"] == pytest.approx(1.06) and r["unique"]["bound_ms"] == pytest.approx(1.04)
    assert r["attended"]["step_over_bound"] == pytest.approx(2 / 1.06)


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
    """`benchmarks.kernels.engine_tables` is the layout the fused engine's scheduler gives a batch admitted at once
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


def test_the_benchmark_models_tool_turn_has_its_tags_as_tokens(tmp_path):
    """The multi-turn workload's tool turn, rendered by the benchmark model's tokenizer: each tag one token, as in
    Qwen2.5's tokenizer, the role names and the tool's 16 characters one byte each."""
    import torch
    from transformers import AutoTokenizer

    from benchmarks.common import make_model_dir
    from hybridrl.agent.render import TurnRenderer

    tok = AutoTokenizer.from_pretrained(make_model_dir("tiny", torch.device("cpu"), str(tmp_path / "m")))
    ids = TurnRenderer(tok).tool_turn_ids([{"role": "tool", "name": "sleep", "content": "x" * 16}])
    pieces = [tok.decode([i]) for i in ids]
    before = ["<|im_end|>", "\n", "<|im_start|>", *"user", "\n", "<tool_response>", "\n"]
    after = ["\n", "</tool_response>", "<|im_end|>", "\n", "<|im_start|>", *"assistant", "\n"]
    assert pieces == [*before, *["x"] * 16, *after]
    assert len(ids) == 41


def test_a_workload_that_does_not_fit_stops_before_the_controller_is_built(tmp_path, monkeypatch):
    """A benchmark checks the run's memory plan as a run does: on a (pretend) device too small, it stops with the
    plan's line before any worker starts or any weights load."""
    import torch

    import hybridrl.controller
    from benchmarks.common import bench_config, bench_controller, make_model_dir

    def no_controller(*args, **kwargs):
        raise AssertionError("the controller was built for a workload that does not fit")

    monkeypatch.setattr(hybridrl.controller, "Controller", no_controller)
    path = make_model_dir("tiny", torch.device("cpu"), str(tmp_path / "model"))
    cfg = bench_config(path, torch.device("cpu"), ["trainer.device_memory_gb=0.01"])
    with pytest.raises(SystemExit, match=r"does not fit: .* in its \w+ phase, .* GiB more than"):
        bench_controller(cfg, [[5, 6, 7]])
