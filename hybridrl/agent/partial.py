"""A partial rollout of the agent loop over an `AsyncGenerator`: trajectories run until enough groups are complete;
the others come back unfinished (`hybridrl.rollout.agent` says why they restart, and picks what serves the turns).

    trajectories = await run_partial(loop, gen, requests, groups, need, params)
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridrl.agent.engine import LaneAware, gather_settled
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
    """One trajectory per request, in order, no new turn once `need` groups are complete; an unfinished one has
    finish_reason 'partial' and `turns` 1 where it had started (its tokens were dropped), 0 where it had not."""
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
