"""Partial rollouts of the agent loop: trajectories run until enough groups are complete; the others restart.

    trajectories = generate_agent_partial(loop, engine, requests, groups, need, params)

Each request is one trajectory from its prompt (`AgentLoop.run_trajectory`), all in flight at once (or
`agent.max_concurrent_trajectories` at a time). Once `need` groups have every trajectory finished, no trajectory
starts another turn: the turns already running finish (a trajectory that ends on one counts as finished), and every
other trajectory comes back unfinished (finish_reason 'partial', no tokens), to restart from its prompt in the next
step. An unfinished trajectory is restarted rather than carried because its tools hold state outside the process (a
Python session, a sandbox, a remote service) that neither survives the weight update's wait nor fits a checkpoint of
tensors and plain values; a carried trajectory would resume from a checkpoint with its tools in another state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from hybridrl.agent.engine import LaneAware, as_async_engine, gather_settled
from hybridrl.agent.loop import AgentLoop, Trajectory
from hybridrl.engines.base import Completion, GenerationRequest, GroupCountdown, SamplingParams


class _Stopped(Exception):
    """Raised into a trajectory that asks for a turn after the rollout stopped."""


class _StoppingEngine:
    """Serves the trajectories' turns until `stopped`; a turn asked for after that raises `_Stopped`."""

    def __init__(self, inner) -> None:
        self.inner, self.stopped = inner, False
        self.served: set[tuple[int, int]] = set()  # (prompt_index, sample_index) of trajectories given a turn

    async def generate(self, request: GenerationRequest, params: SamplingParams) -> Completion:
        if self.stopped:
            raise _Stopped
        self.served.add((request.prompt_index, request.sample_index))
        return await self.inner.generate(request, params)


async def run_partial(
    loop: AgentLoop,
    gen: object,
    requests: Sequence[GenerationRequest],
    groups: Sequence[object],
    need: int,
    params: SamplingParams,
) -> list[Trajectory]:
    """The partial rollout over `gen`, an `AsyncGenerator` (`generate_agent_partial` without the engine's choice)."""
    stopping = _StoppingEngine(gen)
    countdown = GroupCountdown(groups, need)
    stopping.stopped = countdown.done
    out: list[Trajectory | None] = [None] * len(requests)
    queue = list(range(len(requests)))[::-1]
    lanes = min(len(requests), loop.cfg.max_concurrent_trajectories or len(requests))
    aware = isinstance(gen, LaneAware)

    async def lane() -> None:
        try:
            while queue and not stopping.stopped:
                i = queue.pop()
                r = requests[i]
                try:
                    out[i] = await loop.run_trajectory(
                        stopping, list(r.prompt_ids), r.prompt_index, r.sample_index, params
                    )
                except _Stopped:
                    continue
                if countdown.finish(i):
                    stopping.stopped = True
        finally:
            if aware:
                gen.leave()

    if aware:
        for _ in range(lanes):  # all lanes count before any asks, as AgentLoop.generate does
            gen.join()
    await gather_settled(gen, [lane() for _ in range(lanes)])
    return [
        o
        if o is not None
        else Trajectory(
            r.prompt_index,
            r.sample_index,
            list(r.prompt_ids),
            finish_reason="partial",
            turns=int((r.prompt_index, r.sample_index) in stopping.served),
        )
        for r, o in zip(requests, out)
    ]


def generate_agent_partial(
    loop: AgentLoop,
    engine: object,
    requests: Sequence[GenerationRequest],
    groups: Sequence[object],
    need: int,
    params: SamplingParams,
) -> list[Trajectory]:
    """One trajectory per request, in order, stopping new turns once `need` groups are complete (module docstring).
    An unfinished one has finish_reason 'partial' and `turns` 1 where it had started (its tokens were dropped), 0
    where it had not. `params.seed` is the step seed; each request's `prompt_index` its global index. The turns are
    served as `AgentLoop.generate_sync` serves them: from the loop's child process (`agent.process`), else the
    engine's continuous batching where it offers it (on the event loop its request stream names), else one batch per
    turn."""
    process = loop.child_process_for(engine)
    if process is not None:
        return process.run(engine, "partial", requests, groups, need, params)
    gen = as_async_engine(engine, loop.cfg.max_total_tokens)
    event_loop = getattr(gen, "event_loop", None)
    run = run_partial(loop, gen, requests, groups, need, params)
    return asyncio.run(run) if event_loop is None else event_loop.run_until_complete(run)
