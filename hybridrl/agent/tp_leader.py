"""The agent loop on one worker's engine, with one schedule per engine tensor-parallel group.

With engine.tp_size > 1 and an engine that keeps one schedule for its TP group (`lead`/`follow`,
engines/lockstep.py), the TP leader runs the loop (and the tools, once per group) and the other ranks replay its engine
steps and return no trajectories: the worker group takes the leader's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hybridrl.agent.process import generate_agent

if TYPE_CHECKING:
    from hybridrl.agent.loop import AgentLoop, Trajectory
    from hybridrl.engines.base import RolloutEngine, SamplingParams
    from hybridrl.topology import Topology


def agent_trajectories(
    loop: AgentLoop,
    engine: RolloutEngine,
    topology: Topology,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
) -> list[Trajectory]:
    """This rank's trajectories of `prompts` (none on a TP follower), the turns continuously batched where the
    engine can, the loop in its child process where `agent.process` puts it there."""
    if topology.engine_tp_size == 1 or not hasattr(engine, "follow"):
        return generate_agent(loop, engine, prompts, params)
    group = topology.engine_tp_group(backend="gloo")  # host messages: the device keeps running ahead
    if topology.engine_tp_rank:
        engine.follow(group)
        return []
    with engine.lead(group):
        return generate_agent(loop, engine, prompts, params)
