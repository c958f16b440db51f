"""The multi-turn workload of `benchmarks.engine --case multiturn`, run through the run's own generate phase: a
`HybridWorker` built from a run config with `rollout=agent`, its agent loop driving its engine, a tool of fixed latency.

    overrides = agent_overrides(vocab, trajectories, turns, turn_tokens, tool_ms, tool_tokens, prompt_len)
    worker = HybridWorker(bench_config(model_dir, device, overrides)); worker.wake()
    figures = time_agent_rollouts(worker, prompts, device)          # worker.generate, as the controller calls it
    twin = time_single_turn(worker.roles.rollout.engine, prompts, figures["model_tokens"], cfg, device)

A random-weight model writes neither tool calls nor ends of turn, so the workload gives it both, and nothing else:
the loop reads every turn as one call to `SleepTool` (registered by import path in `agent.tools`, as a user's tool
is; the parser, `every_turn_calls_the_tool`, by import path in `agent.format`), so each trajectory runs
`agent.max_turns` turns; and a turn ends where the model samples one of `stop_ids`, about one token in `turn_tokens`
of the vocabulary (`engine.stop_token_ids`): turns cut at random points, `turn_tokens` long on average, different
for every trajectory, as real turns fall. The loop, the tool runner, the chat template between turns and the
engine's request path are the run's.

The single-turn twin generates the same tokens without turns or tools: each trajectory's model tokens as one request,
all submitted at once through the same engine request path (`as_async_engine`), so the ratio between the two is
what turns and tool latency cost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time

import torch

from benchmarks.common import timed
from benchmarks.host_timing import HostTiming
from benchmarks.rollout_figures import counter_deltas, fresh_prefix_cache, scheduler_counters
from hybridrl.agent import ParsedTurn, Tool, ToolCall, as_async_engine
from hybridrl.engines.base import GenerationRequest, RolloutEngine, SamplingParams
from hybridrl.engines.native.kv_cache import blocks_for

WARM_RUNS = 3
"""Warm runs per workload; their median is reported."""
TOOL = "benchmarks.multiturn_workload:SleepTool"
"""The tool's import path, as `agent.tools` names it."""
FORMAT = "benchmarks.multiturn_workload:every_turn_calls_the_tool"
"""The workload's tool-call parser, by import path as `agent.format` names it."""
TURN_CAP = 4
"""A turn's token cap (engine.max_new_tokens) in mean turn lengths: about 2% of turns reach it (e^-4) and end their
trajectory there, as a turn cut by its cap does in a run."""
TOOL_TURN_MARKUP = 96
"""Room for the chat template's tokens around a tool result (the benchmarks' tokenizer spends 25: its tool tags are
tokens, the role names bytes)."""
FIRST_STOP_ID = 300
"""Stop ids start here, past every special token of the benchmarks' tokenizer."""


class SleepTool(Tool):
    """Sleeps `ms` milliseconds (asynchronously, as an I/O-bound tool waits) and returns `tokens` characters of text
    (one token each with the benchmarks' byte-level tokenizer)."""

    name = "sleep"
    description = "Waits a while and answers."

    def __init__(self, ms: float = 50.0, tokens: int = 16) -> None:
        self.ms, self.tokens = float(ms), int(tokens)

    async def acall(self, arguments: dict) -> str:
        await asyncio.sleep(self.ms / 1e3)
        return "x" * self.tokens


def stop_ids(vocab: int, turn_tokens: int) -> list[int]:
    """About one id in `turn_tokens` of a `vocab`-token vocabulary: a random-weight model samples one of them about
    once every `turn_tokens` tokens."""
    count = max(1, round((vocab - FIRST_STOP_ID) / turn_tokens))
    return list(range(FIRST_STOP_ID, FIRST_STOP_ID + count))


def agent_overrides(
    vocab: int,
    trajectories: int,
    turns: int,
    turn_tokens: int,
    tool_ms: float,
    tool_tokens: int,
    prompt_len: int,
    rows: int,
    block_size: int,
) -> list[str]:
    """The run config of the workload: rollout=agent with `SleepTool`, `turns` turns of `turn_tokens` on average, every
    trajectory's tool calls at once, and (with fewer rows than trajectories) a KV cache that holds every trajectory's
    context twice over, so a turn back from its tool finds its prefix still cached, as a run's pool sized by
    engine.native.kv_memory_fraction would."""
    cap = TURN_CAP * turn_tokens
    tool_turn = tool_tokens + TOOL_TURN_MARKUP
    out = [
        "rollout.name=agent",
        f"agent.tools=[{TOOL}]",
        f"agent.format={FORMAT}",
        f"agent.tool_options.SleepTool.ms={tool_ms}",
        f"agent.tool_options.SleepTool.tokens={tool_tokens}",
        f"agent.max_turns={turns}",
        f"agent.max_total_tokens={prompt_len + turns * (cap + tool_turn)}",
        f"agent.max_concurrent_tools={trajectories}",
        f"agent.tool_timeout_s={max(10.0, 100 * tool_ms / 1e3)}",
        f"engine.max_new_tokens={cap}",
        f"engine.stop_token_ids=[{','.join(map(str, stop_ids(vocab, turn_tokens)))}]",
    ]
    if rows < trajectories:
        context = prompt_len + turns * (turn_tokens + tool_turn)
        out.append(f"engine.native.kv_blocks={1 + trajectories * blocks_for(2 * context, block_size)}")
    return out


def every_turn_calls_the_tool(text: str) -> ParsedTurn:
    """The workload's tool-call format (`agent.format`): every turn is one call to the tool (a random-weight model
    writes none)."""
    return ParsedTurn(text, [ToolCall(SleepTool.name, {})])


def time_agent_rollouts(
    worker, prompts: list[list[int]], device: torch.device, timing: HostTiming | None = None
) -> tuple[dict, list[int]]:
    """A cold and `WARM_RUNS` warm runs (median) of the worker's generate phase over `prompts` (one trajectory each),
    each from an empty prefix cache as a rollout after a weight update starts; the figures and each trajectory's model
    tokens (of the last warm run; every run draws the same). `timing` (installed): each warm run's host times too."""
    engine = worker.roles.rollout.engine
    params = sampling(worker.cfg, 1)

    def run():
        fresh_prefix_cache(engine)
        engine.take_stats()  # from here on: this run's graph captures
        before = scheduler_counters(engine)
        seconds, trajs = timed_host(timing, lambda: worker.generate(prompts, 0, params), device)
        return seconds, trajs, counter_deltas(before, scheduler_counters(engine)), engine.take_stats()

    cold, _, _, _ = run()
    warm = [run() for _ in range(WARM_RUNS)]
    seconds = statistics.median(s for s, *_ in warm)
    _, trajs, counters, _ = warm[-1]
    tokens = sum(t.model_tokens for t in trajs)
    turns = sum(t.turns for t in trajs)
    out = {
        "trajectories": len(trajs),
        "tokens": tokens,
        "turns_mean": turns / len(trajs),
        "turn_tokens_mean": tokens / max(1, turns),
        "tool_calls": sum(t.tool_calls for t in trajs),
        "tool_errors": sum(t.tool_errors for t in trajs),
        "cut_by_turn_cap": sum(t.end_reason == "max_new_tokens" for t in trajs),
        "seconds_cold": cold,
        "seconds_warm": seconds,
        "seconds_warm_runs": [s for s, *_ in warm],
        # CUDA graphs captured in each warm run, and the host seconds they took: a rollout's first use of a step
        # shape runs eagerly, its second captures (runner.MIXED_CAPTURE_USE)
        "graph_captures_warm_runs": [st.get("engine/graph_captures", 0.0) for *_, st in warm],
        "graph_capture_s_warm_runs": [st.get("engine/graph_capture_s", 0.0) for *_, st in warm],
        "eager_steps_warm_runs": [st.get("engine/eager_steps", 0.0) for *_, st in warm],
        **host_timing_runs(timing, len(warm)),
        "tokens_per_s": tokens / seconds,
        **engine_step_figures(counters, seconds),
    }
    return out, [t.model_tokens for t in trajs]


def timed_host(timing: HostTiming | None, fn, device: torch.device) -> tuple[float, object]:
    """`timed(fn, device)`, and with `timing` this run's host times kept (`timing.runs`)."""
    if timing is None:
        return timed(fn, device)
    timing.reset()
    seconds, out = timed(fn, device)
    timing.runs.append(timing.figures(seconds))
    return seconds, out


def host_timing_runs(timing: HostTiming | None, warm: int) -> dict:
    """The host times of the last `warm` runs (the warm ones), taken off `timing`; nothing without it."""
    if timing is None:
        return {}
    runs, timing.runs = timing.runs[-warm:], []
    return {"host_timing_warm_runs": runs}


def engine_step_figures(counters: dict[str, int], seconds: float) -> dict:
    """The scheduler's counts of one run (`scheduler`) and, from a native engine, its mean rows per engine step and
    milliseconds per engine step: how much of the rows a workload fills, and what a step costs it."""
    out: dict = {"scheduler": counters}
    if counters:
        out["mean_rows_per_step"] = counters["row_steps"] / max(1, counters["steps"])
        out["ms_per_engine_step"] = seconds / max(1, counters["steps"]) * 1e3
    return out


def time_single_turn(
    engine: RolloutEngine,
    prompts: list[list[int]],
    lengths: list[int],
    cfg,
    device: torch.device,
    timing: HostTiming | None = None,
) -> dict:
    """The same tokens in one turn each, no tools: request i continues prompt i for exactly `lengths[i]` tokens (no
    stop ids), all at once through the engine's request path (`as_async_engine`, as the loop takes it); a cold and
    `WARM_RUNS` warm runs (median)."""
    params = dataclasses.replace(sampling(cfg, 1), stop_token_ids=[], seed=0)
    longest = max(len(p) for p in prompts) + max(lengths)
    requests = [GenerationRequest(list(p), i, 0) for i, p in enumerate(prompts)]

    async def all_at_once():
        stream = as_async_engine(engine, longest)
        return await asyncio.gather(
            *(stream.generate(r, dataclasses.replace(params, max_new_tokens=n)) for r, n in zip(requests, lengths))
        )

    def run():
        fresh_prefix_cache(engine)
        engine.take_stats()  # from here on: this run's graph captures
        before = scheduler_counters(engine)
        seconds, completions = timed_host(timing, lambda: asyncio.run(all_at_once()), device)
        return seconds, completions, counter_deltas(before, scheduler_counters(engine)), engine.take_stats()

    cold, *_ = run()
    warm = [run() for _ in range(WARM_RUNS)]
    seconds = statistics.median(s for s, *_ in warm)
    _, completions, counters, _ = warm[-1]
    tokens = sum(len(c.token_ids) for c in completions)
    return {
        "tokens": tokens,
        "stopped_at_eos": sum(c.finish_reason == "stop" for c in completions),
        "seconds_cold": cold,
        "seconds_warm": seconds,
        "seconds_warm_runs": [s for s, *_ in warm],
        # CUDA graphs captured in each warm run, and the host seconds they took: a rollout's first use of a step
        # shape runs eagerly, its second captures (runner.MIXED_CAPTURE_USE)
        "graph_captures_warm_runs": [st.get("engine/graph_captures", 0.0) for *_, st in warm],
        "graph_capture_s_warm_runs": [st.get("engine/graph_capture_s", 0.0) for *_, st in warm],
        "eager_steps_warm_runs": [st.get("engine/eager_steps", 0.0) for *_, st in warm],
        **host_timing_runs(timing, len(warm)),
        "tokens_per_s": tokens / seconds,
        **engine_step_figures(counters, seconds),
    }


def sampling(cfg, n: int) -> SamplingParams:
    """The run's sampling settings (engine.*): what the controller passes to the generate phase."""
    e = cfg.engine
    return SamplingParams(
        n=n,
        temperature=e.temperature,
        top_p=e.top_p,
        top_k=e.top_k,
        max_new_tokens=e.max_new_tokens,
        stop_token_ids=list(e.stop_token_ids),
        seed=0,
    )


def profile_rollout(worker, prompts: list[list[int]]) -> float:
    """One more generate phase over `prompts` (for a profiler around it); its wall seconds."""
    fresh_prefix_cache(worker.roles.rollout.engine)
    t0 = time.perf_counter()
    worker.generate(prompts, 0, sampling(worker.cfg, 1))
    return time.perf_counter() - t0


__all__ = [
    "TOOL",
    "WARM_RUNS",
    "SleepTool",
    "agent_overrides",
    "every_turn_calls_the_tool",
    "profile_rollout",
    "sampling",
    "stop_ids",
    "time_agent_rollouts",
    "time_single_turn",
]
