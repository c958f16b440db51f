"""A worker's part of a partial rollout: its engine replica's requests, stopped once its quota of groups is complete.

    outs = generate_partial_on(roles, ReplicaShare(requests, groups, need, wait_for), params)   # the worker's phase

Single-turn: the engine's `generate_partial`; an engine that cannot stop early (`stops_early` False) runs every
request to its end, which the log says once: the step then over-samples (the groups it does not train stay complete
for the next step) but waits for its longest response as a synchronous step does. rollout=agent:
`generate_agent_partial` (unfinished trajectories restart).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from hybridrl.engines.base import GenerationRequest, SamplingParams
from hybridrl.rollout.agent import generate_agent_partial

log = logging.getLogger("hybridrl")
_warned: set[str] = set()


@dataclasses.dataclass
class ReplicaShare:
    """One engine replica's part of a partial rollout: what `HybridWorker.generate_partial` runs."""

    requests: list[GenerationRequest]
    """The replica's requests (a carried sample's context is its prompt plus its tokens so far)."""
    groups: list[int]
    """Each request's group."""
    need: int
    """How many of these groups must be complete before the engine may stop."""
    wait_for: list[int] = dataclasses.field(default_factory=list)
    """Requests (indices into `requests`) that must finish before the engine may stop."""


def generate_partial_on(roles, share: ReplicaShare, params: SamplingParams) -> list[Any]:
    """Completions (trajectories with rollout=agent) of `share.requests` on this worker's engine, in order."""
    engine = roles.rollout.engine
    requests, groups, need = share.requests, share.groups, share.need
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
    return engine.generate_partial(requests, params, groups, need, share.wait_for)
