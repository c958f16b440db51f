"""A worker's part of a partial rollout: its engine replica's requests, stopped once its quota of groups is complete.

    outs = generate_partial_on(roles, requests, groups, need, wait_for, params)   # HybridWorker.generate_partial

Single-turn: the engine's `generate_partial`; an engine that cannot stop early (`stops_early` False) runs every
request to its end, which the log says once: the step then over-samples (the groups it does not train stay complete
for the next step) but waits for its longest response as a synchronous step does. rollout=agent:
`generate_agent_partial` (unfinished trajectories restart).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from hybridrl.engines.base import GenerationRequest, SamplingParams
from hybridrl.rollout.agent import generate_agent_partial

log = logging.getLogger("hybridrl")
_warned: set[str] = set()


def generate_partial_on(
    roles,
    requests: Sequence[GenerationRequest],
    groups: Sequence[int],
    need: int,
    wait_for: Sequence[int],
    params: SamplingParams,
) -> list[Any]:
    """Completions (trajectories with rollout=agent) of `requests` on this worker's engine, in order."""
    engine = roles.rollout.engine
    if roles.agent_loop is not None:  # agent trajectories are never carried: there is nothing to wait for
        return generate_agent_partial(roles.agent_loop, engine, requests, groups, need, params)
    name = type(engine).__name__
    if not engine.stops_early and name not in _warned:
        _warned.add(name)
        log.warning(
            "rollout.partial: %s cannot stop a rollout early; every request runs to its end, so steps over-sample "
            "(groups not trained stay for the next step) without shortening the rollout's tail. engine=native "
            "stops early",
            name,
        )
    return engine.generate_partial(list(requests), params, list(groups), need, list(wait_for))
