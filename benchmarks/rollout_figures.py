"""Figures of one rollout workload on an engine: timed `generate` runs, the run's train–inference mismatch on the
sampled tokens, and the decode step against the bytes it must read. Used by `benchmarks.engine`.

    figures, completions = time_generate(engine, prompts, params, device)
    figures["parity"] = parity(roles.actor, prompts, completions, rows=8)
    figures["roofline"] = roofline(model_shape(config, dtype, weight_bytes), rows, context, unique, step_s, 4.8e12)
"""

from __future__ import annotations

import dataclasses
import statistics
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.common import sync, timed
from hybridrl.algorithms import mismatch_metrics
from hybridrl.controller import completions_to_batch
from hybridrl.data.prompts import Prompt
from hybridrl.engines.base import Completion, RolloutEngine, SamplingParams

WARM_RUNS = 5
"""Warm runs per figure; their median is reported (single runs on a busy host differ by up to a fifth)."""

SCHEDULER_COUNTERS = ("prefilled_tokens", "prefills", "step_joins", "steps", "row_steps")
"""The native scheduler's running counts: prompt tokens prefilled, prefill calls, requests that joined inside a decode
step (no prefill call of their own), decode steps, and rows summed over steps."""


def fresh_prefix_cache(engine: RolloutEngine) -> None:
    """Empty the native engine's prefix cache, as a weight update does before every rollout of a run: a timed run then
    finds no prompt computed by the run before it. Other engines are left as they are (their prefix caching is off
    unless configured)."""
    cache = getattr(engine, "cache", None)
    if cache is not None:
        cache.allocator.forget_prefixes()


def scheduler_counters(engine: RolloutEngine) -> dict[str, int]:
    """`SCHEDULER_COUNTERS` of the native engine's scheduler now (empty for engines without one)."""
    scheduler = getattr(engine, "scheduler", None)
    if scheduler is None:
        return {}
    return {k: getattr(scheduler, k) for k in SCHEDULER_COUNTERS}


def counter_deltas(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What each counter grew by between two readings."""
    return {k: after[k] - before[k] for k in before}


def time_generate(
    engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, device: torch.device
) -> tuple[dict, list[Completion]]:
    """Cold, warm and prefill-only timings of `engine.generate(prompts, params)`; returns the figures and the last warm
    run's completions. Every run starts with an empty prefix cache (`fresh_prefix_cache`)."""
    counters: dict[str, int] = {}

    def run(p: SamplingParams) -> tuple[float, list[Completion]]:
        fresh_prefix_cache(engine)
        before = scheduler_counters(engine)
        out = timed(lambda: engine.generate(prompts, p), device)
        counters.update(counter_deltas(before, scheduler_counters(engine)))
        return out

    cold, _ = run(params)
    # The first warm run still captures graphs first met at their second use (a packed prefill's bucket); the runs
    # after it replay every graph, as a rollout in a run does.
    warm_first, _ = run(params)
    warm_runs = [run(params) for _ in range(WARM_RUNS)]
    counters_warm = dict(counters)
    completions = warm_runs[-1][1]
    prefill, _ = run(dataclasses.replace(params, max_new_tokens=1))
    warm = statistics.median(s for s, _ in warm_runs)
    tokens = sum(len(c.token_ids) for c in completions)
    figures = {
        "engine": type(engine).__name__,
        "samples": len(completions),
        "tokens": tokens,
        "stopped_at_eos": sum(c.finish_reason == "stop" for c in completions),
        "seconds_cold": cold,
        "seconds_warm_first": warm_first,
        "seconds_warm": warm,
        "seconds_warm_runs": [s for s, _ in warm_runs],
        "seconds_prefill": prefill,
        "tokens_per_s_cold": tokens / cold,
        "tokens_per_s": tokens / warm,
        "decode_step_ms": (warm - prefill) / max(1, params.max_new_tokens - 1) * 1e3,
        "scheduler": counters_warm,  # one warm run's counts
        "memory": engine.memory_stats(),
    }
    return figures, completions


@contextmanager
def params_on_device(actor):
    """The actor's parameters on the device for the block (a run's log-prob phase onloads them the same way), and
    back to host after it where the actor offloads them."""
    actor.onload_params()
    try:
        yield actor
    finally:
        actor.offload()


def parity(actor, prompts: list[list[int]], completions: list[Completion], rows: int) -> dict:
    """The run's `mismatch/*` metrics (engine log-probs against the actor's `compute_logprobs`, its log-prob phase, on
    the same tokens) over the first `rows` completions."""
    comps = completions[:rows]
    batch = completions_to_batch([Prompt(p, "", {}) for p in prompts], comps)
    with params_on_device(actor):
        trainer_logprobs = actor.compute_logprobs(actor.micro_batches(batch))["old_logprobs"]
    metrics = mismatch_metrics(batch["engine_logprobs"], trainer_logprobs, batch["response_mask"])
    return {
        "samples": len(comps),
        "tokens": int(batch["response_mask"].sum()),
        **{k.removeprefix("mismatch/"): float(v) for k, v in metrics.items()},
    }


@dataclasses.dataclass
class ModelShape:
    """What one decode step reads: the engine's weight bytes and the K/V bytes per attended token."""

    weight_bytes: int
    kv_bytes_per_token: int


def model_shape(hf_config, dtype: torch.dtype, params: int) -> ModelShape:
    """The decode step's bytes for a model of `params` parameters held in `dtype`, from its Hugging Face config."""
    size = torch.empty(0, dtype=dtype).element_size()
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim * size
    return ModelShape(params * size, kv)


def roofline(
    shape: ModelShape, rows: int, context: float, unique_tokens: float, step_s: float, bandwidth: float
) -> dict:
    """The bytes of one decode step (the weights, and the K/V of `rows` rows attending `context` positions each), its
    time at `bandwidth` bytes/s, and the measured step time over that bound; `unique` counts shared K/V once."""
    out = {
        "weight_bytes": shape.weight_bytes,
        "kv_bytes_per_token": shape.kv_bytes_per_token,
        "rows": rows,
        "attended_per_row": context,
        "bandwidth_tb_s": bandwidth / 1e12,
        "step_ms": step_s * 1e3,
    }
    for name, tokens in (("attended", rows * context), ("unique", unique_tokens)):
        total = shape.weight_bytes + tokens * shape.kv_bytes_per_token
        bound_ms = total / bandwidth * 1e3
        out[name] = {"bytes": total, "bound_ms": bound_ms, "step_over_bound": step_s * 1e3 / bound_ms}
    return out


def profile_table(fn, device: torch.device, path: str, rows: int = 40) -> None:
    """The profiler's table of one call of `fn` to `path`: CPU and CUDA activity on the GPU, by device time; CPU
    activity on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    key = "cuda_time_total" if gpu else "cpu_time_total"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))


__all__ = [
    "ModelShape",
    "WARM_RUNS",
    "counter_deltas",
    "fresh_prefix_cache",
    "model_shape",
    "parity",
    "profile_table",
    "roofline",
    "scheduler_counters",
    "time_generate",
]
