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

from hybridrl.agent.engine import as_async_engine
from hybridrl.agent.loop import AgentLoop, Trajectory
from hybridrl.agent.partial import run_partial
from hybridrl.agent.process import child_process_for
from hybridrl.engines.base import GenerationRequest, SamplingParams


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
    child = child_process_for(loop, engine)
    if child is not None:
        return child.run(engine, "partial", requests, groups, need, params)
    gen = as_async_engine(engine, loop.cfg.max_total_tokens)
    event_loop = getattr(gen, "event_loop", None)
    run = run_partial(loop, gen, requests, groups, need, params)
    return asyncio.run(run) if event_loop is None else event_loop.run_until_complete(run)
