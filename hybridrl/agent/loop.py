"""The agent loop: multi-turn, tool-calling rollouts, token in and token out, many trajectories in flight.

One trajectory, as `AgentLoop.run_trajectory` drives it::

    context = prompt_ids
    for turn t in 0 .. agent.max_turns-1:
        c = await engine.generate(GenerationRequest(context, prompt_index, sample_index),
                                  params(seed=turn_seed(step_seed, t), max_new_tokens=min(cap, budget left)))
        context += c.token_ids              # the engine's ids, kept as they are: mask 1, the engine's log-probs
        calls = parse(decode(c.token_ids))  # decoded only to read the calls
        if no calls: done
        results = await run tools          # off the event loop: other trajectories keep generating
        context += template(results)       # tool turn rendered by the chat template: mask 0, log-prob 0

`AgentLoop.generate` runs every sample of a batch of prompts this way concurrently (asyncio), with the same
prompt-major layout `RolloutEngine.generate` returns. The model's tokens are never decoded and re-encoded, so the
trainer scores exactly the ids the engine sampled.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridrl.agent.config import AgentConfig
from hybridrl.agent.engine import LaneAware, as_async_engine, gather_settled
from hybridrl.agent.parsers import ParsedTurn, get_parser
from hybridrl.agent.render import TurnRenderer
from hybridrl.agent.runner import ToolOutcome, ToolRunner
from hybridrl.agent.tools import Tool, build_tools
from hybridrl.engines.base import GenerationRequest, SamplingParams

_SEED_MODULUS = 2**31 - 1
_TURN_STRIDE = 2_654_435_761  # Knuth's multiplicative-hash constant: turns land far apart in seed space


def turn_seed(step_seed: int | None, turn: int) -> int | None:
    """The sampling seed of turn `turn` (0-based) of every trajectory of one step.

    Turn 0 uses the step seed itself, so a trajectory that calls no tool draws exactly the tokens of a single-turn
    rollout; turn t > 0 uses (step_seed + t * 2654435761) mod (2^31 - 1). Engines key each request's stream by
    (seed, prompt_index, sample_index), so turn t of a trajectory draws from a stream fixed by
    (step seed, t, prompt index, sample index): the same however trajectories interleave, batch or split over
    workers. None (no step seed) stays None: the engine's own generator.
    """
    if step_seed is None:
        return None
    if turn == 0:
        return step_seed
    return (step_seed + turn * _TURN_STRIDE) % _SEED_MODULUS


@dataclass
class Trajectory:
    """One sample of the agent loop: the token sequence for training and the conversation for the reward."""

    prompt_index: int
    """Index of the prompt in the list given to `generate` (as `Completion.prompt_index`)."""
    sample_index: int
    """Which of the prompt's samples this is."""
    prompt_ids: list[int]
    """The initial prompt."""
    response_ids: list[int] = field(default_factory=list)
    """Everything after the prompt: model tokens (as the engine produced them) and tool/template tokens."""
    response_mask: list[int] = field(default_factory=list)
    """1 on model tokens (trained on), 0 on tool and template tokens; aligned with response_ids."""
    logprobs: list[float] = field(default_factory=list)
    """The engine's log-prob of each model token, 0.0 on tool and template tokens; aligned with response_ids."""
    finish_reason: str = "stop"
    """'stop' (the model ended, or a policy ended the trajectory) or 'length' (a token limit cut it)."""
    end_reason: str = "done"
    """done (a turn without tool calls) | max_turns | max_total_tokens | max_new_tokens (one turn hit its cap) |
    tool_error (agent.on_tool_error=stop)."""
    turns: int = 0
    """Assistant turns generated."""
    tool_calls: int = 0
    """Tool calls the model made (well-formed or not)."""
    tool_errors: int = 0
    """Calls that failed: raised, timed out, malformed, unknown tool, bad arguments, over the per-turn limit."""
    tool_seconds: float = 0.0
    """Wall-clock seconds spent in this trajectory's tool calls (summed over calls)."""
    truncated: bool = False
    """True when a limit (turns, total tokens, a turn's token cap) ended the trajectory before the model did."""
    model_tokens: int = 0
    """Tokens the model generated (counted before `agent.on_truncation=mask` zeroes a truncated one's mask)."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation: the initial messages (when given), then assistant and tool messages, for the reward."""


class AgentLoop:
    """Drives trajectories against an engine, with the tools, parser and chat template of one run (per worker)."""

    def __init__(self, cfg: AgentConfig, tokenizer, tools: Mapping[str, Tool] | None = None) -> None:
        """`tools`: instances by name (default: built from `cfg.tools` and `cfg.tool_options`)."""
        self.cfg, self.tokenizer = cfg, tokenizer
        self.tools_from_config = tools is None  # what a child process can rebuild (`agent.process`)
        self.tools = dict(tools) if tools is not None else build_tools(cfg.tools, cfg.tool_options)
        # The child process that runs this loop's turns where `agent.process` says so (`hybridrl.agent.process`).
        self.child: Any = None
        self.runner = ToolRunner(self.tools, cfg.timeout_for, cfg.max_tool_output_chars, cfg.max_concurrent_tools)
        self.parse = get_parser(cfg.format)
        self.renderer = TurnRenderer(tokenizer)
        self._token_texts: dict[int, str] = {}

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools' schemas for `apply_chat_template(messages, tools=...)` when rendering prompts."""
        return [t.schema() for t in self.tools.values()]

    # -- a batch ----------------------------------------------------------------------------------------------
    async def generate(
        self,
        engine: object,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        messages: Sequence[Sequence[dict[str, Any]]] | None = None,
    ) -> list[Trajectory]:
        """`params.n` trajectories per prompt, prompt-major (like `RolloutEngine.generate`), all in flight at once
        (or `agent.max_concurrent_trajectories` at a time). `params.seed` is the step seed; sample j of prompt i
        is request (params.prompt_offset + i, j). `messages[i]`: prompt i's conversation, copied into the
        trajectories' transcripts. `engine`: a rollout engine, served as `as_async_engine` decides (its continuous
        batching where it has one, else one batch per turn)."""
        gen = as_async_engine(engine, self.cfg.max_total_tokens)
        jobs = [(i, j) for i in range(len(prompts)) for j in range(params.n)]
        out: list[Trajectory | None] = [None] * len(jobs)
        queue = list(enumerate(jobs))[::-1]
        lanes = min(len(jobs), self.cfg.max_concurrent_trajectories or len(jobs))
        aware = isinstance(gen, LaneAware)

        async def lane() -> None:
            try:
                while queue:
                    slot, (i, j) = queue.pop()
                    out[slot] = await self.run_trajectory(
                        gen, list(prompts[i]), i, j, params, list(messages[i]) if messages is not None else []
                    )
            finally:
                if aware:
                    gen.leave()

        if aware:
            for _ in range(lanes):  # all lanes count before any asks, or the first request would run alone
                gen.join()
        await gather_settled(gen, [lane() for _ in range(lanes)])
        return out  # type: ignore[return-value]

    def generate_sync(
        self,
        engine: object,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        messages: Sequence[Sequence[dict[str, Any]]] | None = None,
    ) -> list[Trajectory]:
        """`generate` from synchronous code, in this process (`hybridrl.agent.process.generate_agent` runs it in the
        loop's child process where `agent.process` says so): on an event loop of its own, or on the loop the engine's
        request stream names as its `event_loop` (SGLang answers on the loop its engine was made on)."""
        gen = as_async_engine(engine, self.cfg.max_total_tokens)
        loop = getattr(gen, "event_loop", None)
        run = self.generate(gen, prompts, params, messages)
        return asyncio.run(run) if loop is None else loop.run_until_complete(run)

    # -- one trajectory ---------------------------------------------------------------------------------------
    async def run_trajectory(
        self,
        engine,
        prompt_ids: list[int],
        prompt_index: int,
        sample_index: int,
        params: SamplingParams,
        messages: list[dict[str, Any]] | None = None,
    ) -> Trajectory:
        """One trajectory of the loop in the module docstring (`prompt_index` local; the stream uses
        `params.prompt_offset + prompt_index`)."""
        cfg = self.cfg
        traj = Trajectory(prompt_index, sample_index, list(prompt_ids), messages=list(messages or []))
        context = list(prompt_ids)
        request_index = params.prompt_offset + prompt_index
        for turn in range(cfg.max_turns):
            room = cfg.max_total_tokens - len(context)
            if room <= 0:
                self._end(traj, "max_total_tokens")
                break
            cap = min(params.max_new_tokens, room)
            turn_params = dataclasses.replace(
                params, n=1, seed=turn_seed(params.seed, turn), max_new_tokens=cap, prompt_offset=0
            )
            c = await engine.generate(GenerationRequest(list(context), request_index, sample_index), turn_params)
            traj.turns += 1
            traj.model_tokens += len(c.token_ids)
            context += c.token_ids
            traj.response_ids += c.token_ids
            traj.response_mask += [1] * len(c.token_ids)
            traj.logprobs += [float(x) for x in c.logprobs]
            stopped = c.finish_reason == "stop" and bool(c.token_ids)
            body = c.token_ids[:-1] if stopped else c.token_ids
            stop_text = self._token_text(c.token_ids[-1]) if stopped else ""
            parsed = self.parse(self.tokenizer.decode(body, skip_special_tokens=False))
            traj.messages.append(_assistant_message(parsed))
            if c.finish_reason == "length":
                self._end(traj, "max_total_tokens" if cap < params.max_new_tokens else "max_new_tokens")
                break
            if not parsed.calls and not parsed.errors:
                traj.end_reason = "done"
                break
            if turn == cfg.max_turns - 1:
                traj.tool_calls += len(parsed.calls) + len(parsed.errors)  # asked for, but never run
                self._end(traj, "max_turns")
                break
            outcomes = await self._run_calls(parsed)
            traj.tool_calls += len(outcomes)
            traj.tool_errors += sum(o.error for o in outcomes)
            traj.tool_seconds += sum(o.seconds for o in outcomes)
            tool_messages = [{"role": "tool", "name": o.name, "content": o.content} for o in outcomes]
            if cfg.on_tool_error == "stop" and any(o.error for o in outcomes):
                traj.messages += tool_messages
                traj.end_reason = "tool_error"
                break
            tool_ids = self.renderer.tool_turn_ids(tool_messages, stop_text)
            if len(context) + len(tool_ids) >= cfg.max_total_tokens:  # no room left for the model to answer
                self._end(traj, "max_total_tokens")
                break
            context += tool_ids
            traj.response_ids += tool_ids
            traj.response_mask += [0] * len(tool_ids)
            traj.logprobs += [0.0] * len(tool_ids)
            traj.messages += tool_messages
        if traj.truncated and cfg.on_truncation == "mask":
            traj.response_mask = [0] * len(traj.response_mask)
        return traj

    def _token_text(self, token_id: int) -> str:
        """One token's text (a turn's stop token: a few ids, decoded once each)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    @staticmethod
    def _end(traj: Trajectory, reason: str) -> None:
        traj.end_reason, traj.truncated, traj.finish_reason = reason, True, "length"

    async def _run_calls(self, parsed: ParsedTurn) -> list[ToolOutcome]:
        """Well-formed calls run concurrently (up to the per-turn limit); malformed and extra ones become errors."""
        limit = self.cfg.max_tool_calls_per_turn
        runnable = parsed.calls[:limit]
        if len(runnable) == 1:  # the usual turn: awaited in place, without a task and a gather's callbacks
            outcomes = [await self.runner.run(runnable[0])]
        else:
            outcomes = list(await asyncio.gather(*(self.runner.run(call) for call in runnable)))
        for call in parsed.calls[limit:]:
            outcomes.append(
                self.runner.error(call.name, f"more than {limit} tool calls in one turn; this one was not run")
            )
        outcomes += [self.runner.error("", msg) for msg in parsed.errors]
        return outcomes

    def close(self) -> None:
        """Release the tools, the thread pool and the child process."""
        if self.child is not None:
            self.child.close()
            self.child = None
        self.runner.close()


def _assistant_message(parsed: ParsedTurn) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        msg["tool_calls"] = [c.as_message_part() for c in parsed.calls]
    return msg
