"""The multi-turn workload of `benchmarks.engine --case multiturn`: trajectories that generate a turn, wait for a
simulated tool, append its result to the context and generate the next turn, many in flight at once.

    lengths = turn_lengths(trajectories, turns, new_tokens, staggered=True, gen=gen)
    figures = run_trajectories(engine, prompts, tool_results, lengths, sampling, tool_ms, device)

The trajectories drive the engine through `AsyncEngine` (`hybridrl.engines.native.async_engine`): each turn is one
request, submitted when the previous turn and its tool call are done, and joins the running batch at the next decode
step (continuous batching). It measures the engine's request path under tool latency; tokenizing, parsing tool calls
and running tools (the run's agent loop) are not in it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics

import torch

from benchmarks.common import timed
from benchmarks.rollout_figures import counter_deltas, fresh_prefix_cache, scheduler_counters
from hybridrl.engines.base import GenerationRequest, RolloutEngine, SamplingParams
from hybridrl.engines.native.async_engine import AsyncEngine

WARM_RUNS = 3
"""Warm runs per workload; their median is reported."""


def turn_lengths(t: int, turns: int, new: int, staggered: bool, gen: torch.Generator) -> list[list[int]]:
    """Each trajectory's new tokens per turn, summing to `new`: equal turns (lockstep: every trajectory reaches its
    tool call at the same step), or cut at random points (staggered: as real turns fall, different trajectories call
    their tools at different steps)."""
    if not staggered:
        return [[new // turns] * turns for _ in range(t)]
    out = []
    for _ in range(t):
        cuts = sorted(torch.randperm(new - 1, generator=gen)[: turns - 1].add(1).tolist())
        out.append([b - a for a, b in zip([0, *cuts], [*cuts, new])])
    return out


async def _all_trajectories(
    engine: RolloutEngine,
    prompts: list[list[int]],
    tool_results: list[list[list[int]]],
    lengths: list[list[int]],
    sampling: SamplingParams,
    tool_ms: float,
) -> tuple[int, int]:
    """Every trajectory at once; the tokens they produced and the turns that stopped at EOS."""
    agent = AsyncEngine(engine)

    async def trajectory(i: int) -> tuple[int, int]:
        context, produced, stopped = list(prompts[i]), 0, 0
        for k, length in enumerate(lengths[i]):
            params = dataclasses.replace(sampling, n=1, max_new_tokens=length)
            out = await agent.generate(GenerationRequest(context, i, k), params)
            produced += len(out.token_ids)
            stopped += out.finish_reason == "stop"
            if k < len(lengths[i]) - 1:
                await asyncio.sleep(tool_ms / 1e3)  # the tool call
                context = context + out.token_ids + tool_results[i][k]
        return produced, stopped

    done = await asyncio.gather(*(trajectory(i) for i in range(len(prompts))))
    return sum(p for p, _ in done), sum(s for _, s in done)


def run_trajectories(
    engine: RolloutEngine,
    prompts: list[list[int]],
    tool_results: list[list[list[int]]],
    lengths: list[list[int]],
    sampling: SamplingParams,
    tool_ms: float,
    device: torch.device,
) -> dict:
    """A cold run and `WARM_RUNS` warm runs (median) of every trajectory's turns, each warm run from an empty prefix
    cache; the scheduler's counts over the last warm run (native engine)."""

    def run() -> tuple[float, tuple[int, int]]:
        return timed(
            lambda: asyncio.run(_all_trajectories(engine, prompts, tool_results, lengths, sampling, tool_ms)), device
        )

    cold, _ = run()
    warm, produced, stopped, counters = [], 0, 0, {}
    for _ in range(WARM_RUNS):
        fresh_prefix_cache(engine)  # each run finds only the prefixes of its own earlier turns
        before = scheduler_counters(engine)
        seconds, (produced, stopped) = run()
        warm.append(seconds)
        counters = counter_deltas(before, scheduler_counters(engine))
    seconds = statistics.median(warm)
    out = {
        "tokens": produced,
        "turns_stopped_at_eos": stopped,
        "seconds_cold": cold,
        "seconds_warm": seconds,
        "seconds_warm_runs": warm,
        "tokens_per_s": produced / seconds,
        "scheduler": counters,
    }
    if counters:
        out["mean_rows_per_step"] = counters["row_steps"] / max(1, counters["steps"])
        out["ms_per_engine_step"] = seconds / max(1, counters["steps"]) * 1e3
    return out


def profile_trajectories(engine, prompts, tool_results, lengths, sampling, tool_ms: float) -> None:
    """One more run of the trajectories (for a profiler around it)."""
    fresh_prefix_cache(engine)
    asyncio.run(_all_trajectories(engine, prompts, tool_results, lengths, sampling, tool_ms))


__all__ = ["WARM_RUNS", "profile_trajectories", "run_trajectories", "turn_lengths"]
